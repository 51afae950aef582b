"""What a commit is asked to do and what it reports: plain records, no I/O.

Apart from commit.py so that the public API (and the ``tailor`` command) can name them
without importing the checkpoint readers, which need torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tailorstore.core.policies import PolicySpec
from tailorstore.store.records import MAIN_RUN


@dataclass
class CommitOptions:
    step: int | None = None
    tag: str | None = None
    force: bool = False
    trust_pickles: bool = False
    level: int = 1
    threads: int = 3  # compression uses both cores; a third thread keeps them busy while one waits on a write
    lock_timeout: float = 600.0
    policy: PolicySpec = field(default_factory=PolicySpec)
    derive_weights: bool = True
    part: bool = False  # commit only these files, as one part of a step several hosts write (finalize.py)
    run: str = MAIN_RUN  # steps are numbered per run (runs.py)


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
