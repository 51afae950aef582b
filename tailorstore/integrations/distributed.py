"""Rank-parallel commits under torch.distributed: every rank writes its own files' blobs.

::

    from tailorstore.integrations.distributed import commit_rank_parallel

    engine.save_checkpoint("saves", tag=f"global_step{step}")          # collective
    commit_rank_parallel(store, f"saves/global_step{step}")            # collective too

Every rank calls it with a store handle on the same store. Each surveys its share, the
surveys are gathered, each writes its share as a part, and global rank 0 finalizes the
step into one manifest (rank_share.py says why it equals a single-process commit). Every
rank returns rank 0's result and every rank's part. A failure on any rank fails the commit on every rank, with
every rank's error in the message, and no manifest is written. A failure while writing
deletes the parts already published; a failed finalize keeps them, for a later
``Store.finalize`` (or ``gc(drop_parts=True)``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch.distributed as dist

from tailorstore.api import Store
from tailorstore.core.errors import LOCK_TIMEOUT, RankParallelCommitError, StoreError
from tailorstore.core.policies import Policy, PolicySpec, needs_changes, policy_spec
from tailorstore.core.threads import compute_threads
from tailorstore.ingest import rank_plan
from tailorstore.ingest.commit_options import CommitOptions, CommitResult, PartPlan
from tailorstore.ingest.finalize import FinalizeResult
from tailorstore.ingest.rank_share import Share, Survey, checked_weights, survey, write_share, writers
from tailorstore.integrations.ranks import gathered, is_distributed, node_ranks
from tailorstore.integrations.ranks import rank as global_rank

T = TypeVar("T")


@dataclass
class RankParallelResult:
    """The step as rank 0 finalized it, and what each rank's part wrote (None: a rank with no files)."""

    finalized: FinalizeResult
    parts: list[CommitResult | None] = field(default_factory=list)  # by rank


def commit_rank_parallel(
    store: Store,
    path: str | os.PathLike,
    *,
    step: int | None = None,
    tag: str | None = None,
    level: int = 1,
    trust_pickles: bool = False,
    lock_timeout: float = LOCK_TIMEOUT,
    group: Any = None,
    threads: int | None = None,
    policy: str | Policy = "full",
    label: str = "",
    owns: Callable[[str], bool] | None = None,
    metrics: Mapping[str, float] | None = None,
    **policy_params: float,
) -> RankParallelResult:
    """Commit the save at ``path`` (a folder every rank can read) from all ranks of ``group``.

    Each rank compresses on its share of its node's cores (``threads``, else ``$TAILOR_THREADS``,
    else the usable cores divided among the node's ranks). ``policy`` (and its parameters) is
    decided once for every rank, from all ranks' surveys (ingest/rank_plan.py): the manifest is
    the one a single-process commit of the save with that policy records. ``label`` marks the
    parts (and the finalize takes only them); ``owns`` says which files each member commits
    (default: DeepSpeed's rank R's files are group rank R's). ``metrics`` (rank 0's) are recorded
    with the step."""
    if not is_distributed():
        raise StoreError("commit_rank_parallel needs torch.distributed initialized; use Store.commit in one process.")
    rank = dist.get_rank(group)
    dist.barrier(group)  # every rank has finished writing its files before any rank reads the folder
    ranks_here = len(node_ranks(global_rank()))
    options = CommitOptions(
        step=step,
        trust_pickles=trust_pickles,
        level=level,
        lock_timeout=lock_timeout,
        part=True,
        run=store.run,
        threads=compute_threads(threads, share=ranks_here),
    )
    spec = policy_spec(policy, policy_params)
    if label:
        options.part_label = f"{label}-n{global_rank()}"
    share, mine = _together(lambda: survey(store.repo, Path(path), options, rank, owns), group, "surveying its files")
    surveys: list[Survey] = gathered(mine, group)
    elsewhere, derived = writers(surveys)[rank], checked_weights(surveys)
    if spec.name != "full":
        options.plan = _planned(store, share, surveys, spec, group, lock_timeout)
        # a blob a lower rank would have written counts only where it falls in a layer the plan stores
        elsewhere = writers(surveys, options.plan.stored)[rank]
    written = _together(
        lambda: write_share(store.repo, share, options, elsewhere, derived),
        group,
        "writing its files",
        undo=lambda result: result is not None and result.part and store.repo.backend.delete(result.part),
    )
    parts: list[CommitResult | None] = gathered(written, group)
    outcome: list[Any] = [None]
    if rank == 0:
        try:
            outcome[0] = store.finalize(
                share.step, tag=tag, lock_timeout=lock_timeout, label=label or None, metrics=metrics
            )
        except Exception as exc:  # handed to every rank below
            outcome[0] = f"rank 0 failed finalizing step {share.step}: {exc}"
    dist.broadcast_object_list(outcome, src=_global(0, group), group=group)
    if not isinstance(outcome[0], FinalizeResult):
        raise RankParallelCommitError(f"the rank-parallel commit of {path} failed: {outcome[0]}")
    return RankParallelResult(outcome[0], parts)


def _planned(
    store: Store, share: Share, surveys: list[Survey], spec: PolicySpec, group: Any, lock_timeout: float
) -> PartPlan:
    """Every rank: the one plan of this commit (rank 0 finds the sources and decides; every
    rank measures its own files' share of the changes the policy needs)."""
    layers, _ = rank_plan.layers_and_sizes(surveys)

    def sources() -> rank_plan.Sources:
        with store.repo.lock(exclusive=False, timeout=lock_timeout) as lock:
            store.repo.refresh(lock)
            return rank_plan.find_sources(store.repo, share.step, layers, store.run, spec)

    found: rank_plan.Sources = from_rank0(sources, group, "finding the step's sources")
    terms: dict[str, Any] = {}
    if needs_changes(spec):
        mine = _together(lambda: rank_plan.own_terms(store.repo, share, found), group, "measuring its layers' change")
        for part in gathered(mine, group):
            terms.update(part)
    return from_rank0(
        lambda: rank_plan.decide_plan(store.repo, spec, surveys, found, terms, rank_plan.step_order(share, surveys)),
        group,
        "deciding the plan",
    )


def from_rank0(work: Callable[[], T], group: Any, doing: str) -> T:
    """``work`` on rank 0, its value (or its failure) on every rank."""
    box: list[Any] = [None]
    if dist.get_rank(group) == 0:
        try:
            box[0] = ("ok", work())
        except Exception as exc:
            box[0] = ("failed", f"rank 0 failed {doing}: {exc}")
    dist.broadcast_object_list(box, src=_global(0, group), group=group)
    status, value = box[0]
    if status != "ok":
        raise RankParallelCommitError(value)
    return value


def _together(work: Callable[[], T], group: Any, doing: str, undo: Callable[[T], object] | None = None) -> T:
    """Run ``work`` on every rank; if it failed on any, raise on all, naming every failure."""
    rank = dist.get_rank(group)
    value: T | None = None
    error: str | None = None
    try:
        value = work()
    except Exception as exc:
        error = f"rank {rank} failed {doing}: {exc}"
    errors: list[str | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(errors, error, group=group)
    failed = [e for e in errors if e]
    if failed:
        if value is not None and undo is not None:
            undo(value)
        raise RankParallelCommitError("the rank-parallel commit failed: " + "; ".join(failed))
    return value  # type: ignore[return-value]


def _global(rank: int, group: Any) -> int:
    return rank if group is None else dist.get_global_rank(group, rank)
