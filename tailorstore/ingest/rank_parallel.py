"""A rank-parallel commit: every member of a group writes its own files' blobs as a part, and
member 0 records the step from the parts (rank_share.py says why the manifest equals a
single-process commit's).

This module holds the protocol; how the members talk is the caller's (:class:`Collective`):
``integrations/common/distributed.py`` implements it over ``torch.distributed``, and anything that can
gather a value, broadcast one from member 0 and fail everywhere at once could.

Call order, on every member (each step a collective, so all reach it or all fail):

1. ``together``: each member surveys its share of the save (its files, their layers and sizes);
2. ``gather``: every member sees all surveys; the writers of shared blobs and the weights
   derived from masters are decided from them alike on every member;
3. with a policy other than full: member 0 finds the step's sources under the shared lock
   (``from_member0``); each member measures its own layers' change where the policy needs it
   (``together`` and ``gather``); member 0 decides the one plan (``from_member0``);
4. ``together``: each member writes its share as one part (its blobs, then its part object); a
   failure on any member deletes the parts the others published;
5. ``gather``: every member's part result;
6. ``from_member0``: member 0 finalizes the step from the parts. A failed finalize keeps the
   parts for a later finalize (or ``gc`` with ``drop_parts``).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol, TypeVar

from tailorstore.core.policies import PolicySpec, needs_changes
from tailorstore.ingest import rank_plan
from tailorstore.ingest.commit_options import CommitOptions, CommitResult, PartPlan
from tailorstore.ingest.finalize import FinalizeResult
from tailorstore.ingest.rank_share import Share, Survey, checked_weights, survey, write_share, writers
from tailorstore.store.backends.roles import Remover
from tailorstore.store.parts import try_token
from tailorstore.store.repo import Repository, StoreWriter

T = TypeVar("T")


class Collective(Protocol):
    """How the members of a rank-parallel commit act together; each call is made by every member."""

    @property
    def member(self) -> int:
        """This member's number in the group, 0 to size - 1."""

    def together(self, work: Callable[[], T], doing: str, undo: Callable[[T], object] | None = None) -> T:
        """``work`` on every member; if it failed on any, ``undo`` this member's value and raise on all."""

    def gather(self, value: T) -> list[T]:
        """Every member's ``value``, by member."""

    def from_member0(self, work: Callable[[], T], doing: str) -> T:
        """``work`` on member 0; its value on every member, or its failure raised on every member."""


@dataclass
class RankParallelResult:
    """The step as member 0 finalized it, and what each member's part wrote (None: no files)."""

    finalized: FinalizeResult
    parts: list[CommitResult | None] = field(default_factory=list)  # by member


def commit_together(
    repo: Repository,
    path: Path,
    options: CommitOptions,
    spec: PolicySpec,
    group: Collective,
    finalize: Callable[[int], FinalizeResult],
    owns: Callable[[str], bool] | None = None,
) -> RankParallelResult:
    """Commit the save at ``path`` (a folder every member can read) with the members of ``group``;
    ``options`` are this member's (a part each), ``finalize(step)`` is member 0's last call."""
    member = group.member
    # one token for every member's part (decided once, on member 0): the parts prove they are one try
    token = group.from_member0(lambda: _try_token(options.part_label), "choosing the try token")
    options = replace(options, part_try=token)
    share, mine = group.together(lambda: survey(repo, path, options, member, owns), "surveying its files")
    surveys: list[Survey] = group.gather(mine)
    elsewhere, derived = writers(surveys)[member], checked_weights(surveys)
    if spec.name != "full":
        plan = _planned(repo, options, share, surveys, spec, group)
        options = replace(options, plan=plan)
        # a blob a lower member would have written counts only where it falls in a layer the plan stores
        elsewhere = writers(surveys, plan.stored)[member]
    written = group.together(
        lambda: write_share(repo, share, options, elsewhere, derived),
        "writing its files",
        undo=lambda result: result is not None and result.part and repo.objects(Remover).delete(result.part),
    )
    parts: list[CommitResult | None] = group.gather(written)
    finalized = group.from_member0(lambda: finalize(share.step), f"finalizing step {share.step}")
    return RankParallelResult(finalized, parts)


def _try_token(label: str) -> str:
    """$TAILOR_TRY or the save's label (store/parts.py), else one made for this commit alone."""
    return try_token(label) or f"together-{os.urandom(8).hex()}"


def _planned(
    repo: StoreWriter, options: CommitOptions, share: Share, surveys: list[Survey], spec: PolicySpec, group: Collective
) -> PartPlan:
    """Every member: the one plan of this commit (member 0 finds the sources and decides; every
    member measures its own files' share of the changes the policy needs)."""
    layers, _ = rank_plan.layers_and_sizes(surveys)

    def sources() -> rank_plan.Sources:
        with repo.lock(exclusive=False, timeout=options.lock_timeout) as lock:
            repo.refresh(lock)
            return rank_plan.find_sources(repo, share.step, layers, options.run, spec)

    found: rank_plan.Sources = group.from_member0(sources, "finding the step's sources")
    terms: dict[str, Any] = {}
    if needs_changes(spec):
        mine = group.together(lambda: rank_plan.own_terms(repo, share, found), "measuring its layers' change")
        for part in group.gather(mine):
            terms.update(part)
    return group.from_member0(
        lambda: rank_plan.decide_plan(repo, spec, surveys, found, terms, rank_plan.step_order(share, surveys)),
        "deciding the plan",
    )
