"""A rank-parallel commit under a policy: one decision for every rank's part.

A policy needs the whole step: its layers and their sizes (parity, filter, budget), where each
layer was last stored (all of them), and for adaptive and budget how far each layer's FP32
master moved since then, which only the ranks holding the masters can measure. So the ranks
survey their own files (rank_share.py); global rank 0 finds, under the shared lock, what the
step may inherit from; each rank measures its own files' terms of the change against those
sources; rank 0 sums the terms in the order a single-process commit reads the files, so that
every change is the same number to the last bit, and decides. Every rank then writes only its
pieces of the stored layers, and inherits the others' pieces as a single-process commit would.
The manifest the finalize records is the one a single-process commit of the same save records.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Protocol

from tailorstore.access.changes import ChangeTerms
from tailorstore.core.errors import StoreError
from tailorstore.core.policies import CommitFacts, PolicySpec, decide, needs_changes
from tailorstore.formats.deepspeed import is_model_states
from tailorstore.formats.reader import write_order
from tailorstore.ingest.commit import (
    CommitHistory,
    ages_of,
    combine_changes,
    file_change_terms,
    inheritance,
    inherited_from,
)
from tailorstore.ingest.commit_options import PartPlan
from tailorstore.ingest.rank_share import Share, Survey
from tailorstore.store.repo import Repository, StepReader


class RankPlanLookup(Protocol):
    """The index as rank 0 plans a rank-parallel commit: the run's history (each rank looks up the
    steps a plan names through ``commit.inherited_from``)."""

    def commits_before(self, step: int, run: str) -> int: ...


@dataclass(frozen=True)
class Sources:
    """What rank 0 found the step may inherit from, by object keys every host resolves alike."""

    inherited: dict[str, tuple[str, str, int]]  # layer -> (manifest holding it, its source, source step)
    commits_before: int
    ages: dict[str, int]


def step_order(share: Share, surveys: Sequence[Survey]) -> list[str]:
    """Every file of the step in the order one process commits them. Where each member sees the
    whole folder, its own survey's order; where each sees only its node's files, the order of
    their union, as the folder of all of them would list it (model states first)."""
    every = {rel for found in surveys for rel in found.files}
    if every <= set(share.order):
        return share.order
    model = sorted(rel for rel in every if is_model_states(PurePosixPath(rel).name))
    files = model + sorted(every - set(model))
    return write_order(dataclasses.replace(share.layout, files=files))


def layers_and_sizes(surveys: Sequence[Survey]) -> tuple[frozenset[str], dict[str, int]]:
    sizes: dict[str, int] = {}
    for found in surveys:
        for layer, nbytes in found.layer_bytes.items():
            sizes[layer] = sizes.get(layer, 0) + nbytes
    return frozenset(sizes), sizes


def find_sources(repo: StepReader, step: int, layers: frozenset[str], run: str, spec: PolicySpec) -> Sources:
    """Rank 0, under the shared lock: every layer's newest earlier version, as a commit finds it."""
    base = repo.run_base(run)
    history = repo.view(CommitHistory)
    found = inheritance(history, step, layers, run, base)
    commits_before = repo.view(RankPlanLookup).commits_before(step, run) + (base is not None)
    ages = ages_of(history, found, commits_before, run) if needs_changes(spec) else {}

    def key(manifest: int) -> str:
        record = repo.manifest(manifest)
        if record.object_key is None:
            raise ValueError(f"manifest {manifest} has no object yet")
        return record.object_key

    inherited = {layer: (key(src.manifest), key(src.source), src.source_step) for layer, src in found.items()}
    return Sources(inherited, commits_before, ages)


def own_terms(repo: StepReader, share: Share, sources: Sources) -> dict[str, dict[str, ChangeTerms]]:
    """Each rank: its own files' terms of every inheritable layer's change, by file."""
    mine = inherited_from(repo.view(CommitHistory), sources.inherited)  # this rank's own index's ids of the sources
    return {f.path: file_change_terms(repo, f, mine) for f in share.scan.files}


def decide_plan(
    repo: StepReader,
    spec: PolicySpec,
    surveys: Sequence[Survey],
    sources: Sources,
    terms: dict[str, dict[str, ChangeTerms]],
    order: list[str],
) -> PartPlan:
    """Rank 0: the layers to store, as a single-process commit of the same save decides them."""
    layers, sizes = layers_and_sizes(surveys)
    adaptive = needs_changes(spec)
    history = repo.view(CommitHistory)
    mine = inherited_from(history, sources.inherited) if adaptive else {}
    changes = combine_changes(history, [terms[p] for p in order if p in terms], mine) if adaptive else {}
    facts = CommitFacts(
        layers, sources.commits_before, frozenset(sources.inherited), changes if adaptive else None, sizes, sources.ages
    )
    stored = decide(spec, facts)
    inherited = {layer: found for layer, found in sources.inherited.items() if layer in layers - stored}
    return PartPlan(spec.as_json(), frozenset(stored), inherited, changes)


def check_sized_policy(spec: PolicySpec) -> PolicySpec:
    """``spec``, if a plan from layers' sizes alone can apply it (the DCP writer checks this when it
    is built, and :func:`plan_from_sizes` again): a policy that measures how far the masters moved
    (adaptive, budget) needs the whole step in one place."""
    if needs_changes(spec):
        raise StoreError(
            f"the {spec.name} policy measures how far each layer moved, which needs the whole step in one place; "
            "save through the DCP writer with the full, parity or filter policy, or commit a DCP folder."
        )
    return spec


def plan_from_sizes(
    repo: Repository, spec: PolicySpec, step: int, layer_bytes: dict[str, int], run: str, lock_timeout: float
) -> PartPlan:
    """One host, for a step whose parts are written from memory (the DCP writer): the plan from
    the layers' sizes alone, under the shared lock. A policy that measures how far the masters
    moved (adaptive, budget) needs their bytes on one host, so it is refused here."""
    check_sized_policy(spec)
    layers = frozenset(layer_bytes)
    with repo.lock(exclusive=False, timeout=lock_timeout) as lock:
        repo.refresh(lock)
        found = find_sources(repo, step, layers, run, spec)
    facts = CommitFacts(layers, found.commits_before, frozenset(found.inherited), None, dict(layer_bytes), found.ages)
    stored = frozenset(decide(spec, facts))
    inherited = {layer: where for layer, where in found.inherited.items() if layer in layers - stored}
    return PartPlan(spec.as_json(), stored, inherited, {})
