"""A save publishes its step or fails within a bound: no request of it may stall for longer.

A stalled object store (a hung multipart part, a gateway that took a request and never answers,
a frozen server) does not fail a request: the connection stays open. The S3 client's own limits
(one try, then its retries) apply to each request alone, and a save makes thousands, in several
threads: each stalled one waits out its own budget, one after another, and the job sees nothing
until its collective watchdog kills it. So a save (a commit, a part, a finalize, the DCP writer's
and DeepSpeed engine's saves, which are commits) runs inside :func:`bounded`, and while one runs:

- a request of this process that makes no progress for :func:`bound_seconds` (``TAILOR_SAVE_SECONDS``,
  default 300; a multipart upload progresses with each part the client takes) is abandoned, and
  the save fails with :class:`StalledRequestError`, naming that request;
- every later request of this process fails at once with the same error, so that the save's other
  threads, its cleanup and its lock's release end in seconds, not each after its own stall.

A stalled save therefore ends within the bound, plus what the threads in flight take to notice
(docs/USAGE.md gives the reasoning for the default). The bound covers this process's requests
to an S3 store while any save runs; nothing outside a save is bounded here.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

from tailorstore.core.environment import SAVE_BOUND_ENV
from tailorstore.core.errors import StalledRequestError

DEFAULT_SECONDS = 300.0  # docs/USAGE.md: past a request's own retry budget (~210 s), within NCCL's 10 min

def bound_seconds() -> float:
    from tailorstore.core.env_seconds import seconds_from_env

    return seconds_from_env(SAVE_BOUND_ENV, DEFAULT_SECONDS, least=1.0, most=86400.0)


class Bound:
    """One save's bound, and the request that broke it (once one has)."""

    def __init__(self, what: str, seconds: float) -> None:
        self.what, self.seconds = what, seconds
        self.began = time.monotonic()
        self.stalled: str | None = None  # "writing KEY on ENDPOINT": the first request that stalled

    def error(self, request: str, *, first: bool) -> StalledRequestError:
        if first:
            return StalledRequestError(
                f"{request} made no progress for {self.seconds:g} s, the bound of a save "
                f"({SAVE_BOUND_ENV}); the {self.what} failed and was not recorded unless a later listing shows "
                "it. Check the server, then save again."
            )
        return StalledRequestError(
            f"the {self.what} failed: {self.stalled} made no progress for {self.seconds:g} s ({SAVE_BOUND_ENV}); "
            "nothing more is sent. Check the server, then save again."
        )


_active: list[Bound] = []
_lock = threading.Lock()


@contextlib.contextmanager
def bounded(what: str) -> Iterator[Bound]:
    """Run a save (``what``: "commit of step 6") under the bound; nested saves keep the outer one."""
    bound = Bound(what, bound_seconds())
    with _lock:
        _active.append(bound)
    try:
        yield bound
    finally:
        with _lock:
            _active.remove(bound)


def current() -> Bound | None:
    """The bound of the oldest save this process runs, or None when none runs."""
    with _lock:
        return _active[0] if _active else None
