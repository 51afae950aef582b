"""Rank-parallel commits under torch.distributed: every rank writes its own files' blobs.

::

    from tailorstore.integrations.common.distributed import commit_rank_parallel

    engine.save_checkpoint("saves", tag=f"global_step{step}")          # collective
    commit_rank_parallel(store, f"saves/global_step{step}")            # collective too

Every rank calls it with a store handle on the same store. The protocol (survey, gather, plan,
write a part each, finalize on rank 0) is ``Store.commit_together``'s (``ingest/rank_parallel.py``
writes its call order); this module is its glue to ``torch.distributed``: :class:`TorchGroup`, the
collectives it needs, each of which fails on every rank when the work failed on any, naming every
failure. No manifest is written then; a failure while writing deletes the parts already
published; a failed finalize keeps them, for a later ``Store.finalize`` (or
``gc(drop_parts=True)``). Every rank returns rank 0's result and every rank's part.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from tailorstore import RankParallelResult
from tailorstore.api import Store
from tailorstore.core.errors import LOCK_TIMEOUT, RanksFailedError, StoreError
from tailorstore.core.policies import Policy
from tailorstore.core.threads import compute_threads
from tailorstore.integrations.common.ranks import is_distributed, node_ranks
from tailorstore.integrations.common.ranks import rank as global_rank
from tailorstore.integrations.common.session import Session
from tailorstore.integrations.common.store_session import StoreSession

T = TypeVar("T")

__all__ = ["RankParallelResult", "TorchGroup", "commit_rank_parallel", "from_rank0"]


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
    parts (and the finalize takes only them; without one, a label is chosen for this call, so the
    parts a killed try of the same step left are never taken for this one's); ``owns`` says which
    files each member commits (default: DeepSpeed's rank R's files are group rank R's).
    ``metrics`` (rank 0's) are recorded with the step."""
    if not is_distributed():
        raise StoreError("commit_rank_parallel needs torch.distributed initialized; use Store.commit in one process.")
    session = Session(group)
    session.barrier()  # every rank has finished writing its files before any rank reads the folder
    if not label:  # the parts of this try alone are finalized, never a killed try's of the same step
        label = session.decide(lambda: f"together.{uuid.uuid4().hex[:16]}", "choosing the save's label")
    return StoreSession(store).commit_together(
        path,
        TorchGroup(group),
        step=step,
        tag=tag,
        level=level,
        trust_pickles=trust_pickles,
        lock_timeout=lock_timeout,
        threads=compute_threads(threads, share=len(node_ranks(global_rank()))),
        policy=policy,
        metrics=metrics,
        label=label,
        part_label=f"{label}-n{global_rank()}" if label else "",
        owns=owns,
        **policy_params,
    )


class TorchGroup:
    """``ingest.rank_parallel.Collective`` over a torch.distributed group (None: the default one),
    through the one rank session: a failure on any member is raised on every member as
    :class:`RanksFailedError`, each member's own error kept whole (its class, so its exit code)."""

    def __init__(self, group: Any = None) -> None:
        self.group = group
        self.session = Session(group)

    @property
    def member(self) -> int:
        return self.session.member

    def together(self, work: Callable[[], T], doing: str, undo: Callable[[T], object] | None = None) -> T:
        """Run ``work`` on every member; if it failed on any, undo this member's and raise on all."""
        done: list[T] = []

        def mine() -> T:
            value = work()
            done.append(value)
            return value

        try:
            return self.session.all_or_none(mine, doing)
        except RanksFailedError:
            if done and undo is not None:
                undo(done[0])
            raise

    def gather(self, value: T) -> list[T]:
        return self.session.gather(value)

    def from_member0(self, work: Callable[[], T], doing: str) -> T:
        return self.session.decide(work, doing)


def from_rank0(work: Callable[[], T], group: Any, doing: str) -> T:
    """``work`` on ``group``'s member 0, its value (or its failure, whole) on every rank."""
    return Session(group).decide(work, doing)
