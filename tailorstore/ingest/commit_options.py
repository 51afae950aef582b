"""What a commit is asked to do and what it reports: plain records, no I/O.

Apart from commit.py so that the public API (and the ``tailor`` command) can name them
without importing the checkpoint readers, which need torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from tailorstore.core.errors import LOCK_TIMEOUT
from tailorstore.core.policies import Policy, PolicySpec, policy_spec
from tailorstore.core.records import MAIN_RUN


@dataclass(frozen=True)
class CommitRequest:
    """What a caller asks of a commit, the same for ``Store.commit`` and ``Store.commit_async``
    (either takes one, or these fields as keywords; parameters of a policy named by string go
    with them: ``commit(path, policy="budget", fraction=0.2)``)."""

    step: int | None = None  # default: the step the checkpoint names
    tag: str | None = None
    policy: str | Policy | PolicySpec = "full"  # "budget", or Budget(fraction=0.2), ...
    policy_params: dict[str, float] = field(default_factory=dict)
    force: bool = False  # replace the step if the store holds it
    level: int = 1  # zstd level, 1 to 22
    trust_pickles: bool = False  # load pickles outside the allowlist
    lock_timeout: float = LOCK_TIMEOUT
    delete_after_commit: bool = False  # delete the committed files once every blob is checked
    run: str | None = None  # commit to this run (default: the store handle's)
    threads: int | None = None  # compressing threads (default: $TAILOR_THREADS, else from the usable cores)
    metrics: dict[str, float] | None = None  # recorded with the step (eval_loss=2.31): gc can keep the best

    @classmethod
    def of(cls, request: CommitRequest | None, keywords: dict[str, Any]) -> CommitRequest:
        """``request`` with ``keywords`` on top: a field's name sets it, any other keyword is a
        parameter of the policy (which ``spec`` refuses if the policy does not take it)."""
        names = {f.name for f in fields(cls)} - {"policy_params"}
        base = request or cls()
        given = {k: v for k, v in keywords.items() if k in names}
        params = {**base.policy_params, **{k: v for k, v in keywords.items() if k not in names}}
        return cls(**{**{f.name: getattr(base, f.name) for f in fields(cls)}, **given, "policy_params": params})

    def spec(self) -> PolicySpec:
        return policy_spec(self.policy, self.policy_params)


@dataclass(frozen=True)
class PartPlan:
    """What a rank-parallel commit decided once, from every rank's survey, for every rank's part:
    the policy, the layers stored, where each other layer comes from, and the measured changes.
    Manifests are named by their object keys, which every host resolves alike."""

    policy: dict  # PolicySpec.as_json()
    stored: frozenset[str]
    inherited: dict[str, tuple[str, str, int]]  # layer -> (manifest holding it, its source manifest, source step)
    changes: dict[str, float]


@dataclass(frozen=True)
class CommitOptions:
    """How a commit runs, built whole once (``Store._options``) and never changed after: what a
    commit was given is what it ran with, in the background too, and a value with other fields
    (a rank-parallel part's try token and plan) is a new one (``dataclasses.replace``)."""

    step: int | None = None
    tag: str | None = None
    force: bool = False
    trust_pickles: bool = False
    level: int = 1
    threads: int | None = None  # the blob writers: default from the usable cores (core/threads.py)
    lock_timeout: float = LOCK_TIMEOUT
    policy: PolicySpec = field(default_factory=PolicySpec)
    derive_weights: bool = True
    part: bool = False  # commit only these files, as one part of a step several hosts write (finalize.py)
    part_label: str = ""  # the part's key begins with it: finalize can take one save's parts only
    part_try: str = ""  # the try token its part carries ("": $TAILOR_TRY or the label's, store/parts.py)
    plan: PartPlan | None = None  # a part of a rank-parallel commit under a policy: what to store
    run: str = MAIN_RUN  # steps are numbered per run (runs.py)
    metrics: str | None = None  # JSON, checked (core/metric_values.py): recorded with the manifest


@dataclass
class CommitResult:
    step: int
    manifest: int
    files: int
    atoms: int
    raw_bytes: int
    new_blobs: int
    new_bytes: int
    derived_bytes: int
    seconds: float
    stored_layers: list[str] = field(default_factory=list)
    inherited_layers: dict[str, int] = field(default_factory=dict)  # layer -> source step
    changes: dict[str, float] = field(default_factory=dict)
    part: str | None = None  # the part object written, for a --part commit (manifest is 0 then)
