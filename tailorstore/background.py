"""Commits in the background of a training loop, in order, a bounded number at a time.

A training loop saves, hands the save to :meth:`CommitQueue.submit` and goes on training
while one worker thread commits. At most ``max_in_flight`` commits are queued or running:
at the bound, ``submit`` blocks and says so in the log at level INFO (the disk or the network
is slower than the saves). One worker keeps commits in step order, so a policy that inherits layers
always finds the previous step committed.

Errors are never swallowed. A failed commit is raised from the next ``submit`` (the next
save) or from ``flush``/``close``, whichever comes first, and its save is left in place.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Generic, TypeVar

from tailorstore.core.errors import BackgroundCommitError, TailorError

log = logging.getLogger("tailorstore")
T = TypeVar("T")


class CommitQueue(Generic[T]):
    def __init__(self, max_in_flight: int = 1) -> None:
        if max_in_flight < 1:
            raise TailorError(f"max_in_flight {max_in_flight} is not allowed: give 1 or more.")
        self.max_in_flight = max_in_flight
        self._slots = threading.BoundedSemaphore(max_in_flight)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tailor-commit")
        self._futures: list[tuple[str, Future[T]]] = []
        self._lock = threading.Lock()
        self._closed = False

    def submit(self, what: str, job: Callable[[], T]) -> Future[T]:
        """Queue ``job`` (a commit of ``what``); first raise any earlier failure, then wait for room."""
        if self._closed:
            raise TailorError("this store is closed; open it again to commit.")
        self.raise_failures()
        if not self._slots.acquire(blocking=False):
            # info, not a warning: waiting for the previous commit is how a bounded queue works, and a
            # run whose saves come faster than its commits would print it at every save
            log.info(
                "tailorstore: %d commit(s) already in flight; waiting for one to finish before committing %s",
                self.max_in_flight,
                what,
            )
            self._slots.acquire()
        try:
            future = self._pool.submit(job)
        except BaseException:
            self._slots.release()
            raise
        future.add_done_callback(lambda _f: self._slots.release())
        with self._lock:
            self._futures.append((what, future))
        return future

    def raise_failures(self) -> None:
        """Raise the first failure among finished commits (each failure is raised once)."""
        with self._lock:
            done = [(w, f) for w, f in self._futures if f.done()]
            self._futures = [(w, f) for w, f in self._futures if not f.done()]
        failed = [(w, f.exception()) for w, f in done if not f.cancelled() and f.exception() is not None]
        if not failed:
            return
        for what, exc in failed[1:]:
            log.error("tailorstore: the background commit of %s also failed: %s", what, exc)
        what, exc = failed[0]
        more = f" ({len(failed) - 1} more failed; see the log)" if len(failed) > 1 else ""
        cause = exc.parts if isinstance(exc, TailorError) else (str(exc),)
        error = BackgroundCommitError(f"the background commit of {what} failed: ", *cause, more)
        if isinstance(exc, TailorError):
            error.category = exc.category  # a damaged store stays one when the commit ran in the background
        raise error from exc

    def in_flight(self) -> int:
        with self._lock:
            return sum(not f.done() for _, f in self._futures)

    def flush(self) -> None:
        """Wait for every commit in flight, then raise the first failure."""
        with self._lock:
            pending = [f for _, f in self._futures]
        for future in pending:
            try:
                future.result()
            except BaseException:  # raised below, with the others, by raise_failures
                pass
        self.raise_failures()

    def close(self) -> None:
        try:
            self.flush()
        finally:
            self._closed = True
            self._pool.shutdown(wait=True)
