"""The ranks of one job as a session: a decision made once and shipped whole to every rank.

A choice that several ranks act on (which step to resume, whether a folder on disk is loaded,
what the recovery of a dead run's staging did, whether to start fresh) must be the same choice
on every rank. Made on each rank from what that rank sees, it differed: one rank saw a folder on
disk that rank 0 was committing and deleting, took DeepSpeed's on-disk path and waited in
DeepSpeed's collectives, while rank 0 waited in ours (tests/system/test_restarts.py,
``test_a_job_killed_while_its_save_commits_restarts_with_every_rank_alike``). So such a choice
is made here, by construction: :meth:`Session.decide` runs it on global rank 0 alone and every
rank returns what rank 0 returned, or raises what it raised.

Failures cross ranks whole: a :class:`TailorError` is shipped as itself (its class, its parts and
so its category), never flattened to a string, and raised on every rank as a
:class:`RanksFailedError` that keeps each failed rank's own error by rank. Any other exception
is shipped as a :class:`RankError` that holds the exception itself wherever it pickles (an
``OSError`` as a :class:`RankBackendError`, a backend failure); its traceback stays on the rank it
happened on, chained. So no rank is left waiting for one that failed, and none learns less of
another's failure than the class and arguments it was raised with.

Every collective runs on the session's group: the tailor gloo group (``ranks.tailor_group``),
with its own timeout, so nothing interleaves with training's collectives.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from tailorstore.core.errors import RankError, RanksFailedError, TailorError
from tailorstore.integrations.common import ranks

T = TypeVar("T")


class Session:
    """The job's ranks over ``group`` (``ranks.tailor_group()``; None outside torch.distributed)."""

    def __init__(self, group: Any) -> None:
        self.group = group

    @classmethod
    def open(cls) -> Session:
        """A session over a new tailor group (collective: every rank calls it, in the same order)."""
        return cls(ranks.tailor_group())

    @property
    def member(self) -> int:
        """This rank's number in the session's group (its global rank on the tailor group)."""
        return ranks.member(self.group)

    def decide(self, fn: Callable[[], T], doing: str = "") -> T:
        """``fn()`` run on the group's member 0 alone (global rank 0 on the tailor group); its result
        on every rank (collective). A failure of ``fn`` is raised on every rank as
        :class:`RanksFailedError` ``{0: error}``."""
        outcome: tuple[bool, Any] | None = None
        cause: BaseException | None = None
        if self.member == 0:
            outcome, cause = _attempt(fn)
        if ranks.is_distributed():
            outcome = ranks.broadcast(outcome, self.group)
        assert outcome is not None
        ok, value = outcome
        if ok:
            return value  # type: ignore[no-any-return]
        raise RanksFailedError({0: value}, doing) from cause

    def each(self, fn: Callable[[], T], doing: str = "") -> list[T]:
        """``fn()`` run on every rank; every rank's result, by rank (collective). Where it failed
        on any rank, every rank raises :class:`RanksFailedError` with each failed rank's error."""
        outcome, cause = _attempt(fn)
        every = ranks.gathered((ranks.rank(), outcome), self.group) if ranks.is_distributed() else [(0, outcome)]
        # failures are keyed by global rank, what a user's log names
        failures = {rank: value for rank, (ok, value) in every if not ok}
        if failures:
            raise RanksFailedError(failures, doing) from cause
        return [value for _, (_, value) in sorted(every, key=lambda one: one[0])]


    def barrier(self) -> None:
        """Every rank has reached this point (collective): what each did before it is done."""
        ranks.barrier(self.group)

    def gather(self, fact: T) -> list[T]:
        """Every rank's ``fact``, in rank order, on every rank (collective): for a choice each rank
        then computes alike from the same facts (which nodes hold a store, which files a rank staged)."""
        return ranks.gathered(fact, self.group) if ranks.is_distributed() else [fact]

    def all_or_none(self, fn: Callable[[], T], doing: str = "") -> T:
        """``fn()`` run on every rank; this rank's own result, once it held on every rank (collective).
        Only the outcomes cross ranks, not the results: for work whose results stay where they
        were made (each rank's part of a commit). A failure anywhere is raised on every rank as
        :class:`RanksFailedError` with each failed rank's error."""
        outcome, cause = _attempt(fn)
        ok, value = outcome
        shipped = None if ok else value
        every = ranks.gathered((ranks.rank(), shipped), self.group) if ranks.is_distributed() else [(0, shipped)]
        failures = {rank: error for rank, error in every if error is not None}
        if failures:
            raise RanksFailedError(failures, doing) from cause
        return value  # type: ignore[no-any-return]


def _attempt(fn: Callable[[], T]) -> tuple[tuple[bool, Any], BaseException | None]:
    """(ok, value or the error to ship), and the exception raised here (to chain on this rank).
    A :class:`TailorError` is shipped as itself; any other exception as a :class:`RankError` that
    holds it whole (its class and arguments), never as a string alone."""
    try:
        return (True, fn()), None
    except TailorError as exc:
        return (False, exc), exc
    except Exception as exc:  # every rank must hear it, not wait for it
        return (False, RankError.of(exc)), exc
