"""The store lock: many committers at once, or one collector alone.

Commits take the lock shared and gc takes it exclusive, so gc never deletes a blob that a
running commit has written or found in the index but not yet referenced from a manifest.
Readers take no lock: SQLite's WAL gives them a consistent snapshot, and blobs are never
changed in place.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from tailorstore.core.errors import Call, CorruptStoreError, LeaseLostError, LockTimeoutError, StoreError
from tailorstore.core.progress import Progress

if TYPE_CHECKING:
    from tailorstore.store.repo import StoreWriter


class Fence(Protocol):
    """What a publishing or deleting step asks of the lock it runs under (lease.py, fencing).
    ``by_time``: the lock holds only while its holder keeps renewing it (a lease), so a stall can
    outlast it, and publishing and deleting follow gc_notices' write-then-read rule."""

    by_time: bool

    def check(self, what: str) -> None: ...


class LockHandle:
    by_time = False  # the kernel holds a flock for as long as the process lives

    def __init__(self, fd: int) -> None:
        self._fd = fd

    def check(self, what: str) -> None:
        """Fencing, as a lease does it (lease.py): nothing to do, the kernel holds a ``flock`` for
        as long as the process lives, however long it stalls."""

    def check_alone(self, what: str) -> None:
        """As :meth:`check`: an exclusive ``flock`` cannot be shared while it is held."""

    def try_exclusive(self) -> bool:
        """Turn a shared lock exclusive if nobody else holds it; for cleanup that must be alone."""
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            return False


@contextmanager
def store_lock(
    path: Path, *, exclusive: bool, timeout: float, progress: Progress | None = None
) -> Iterator[LockHandle]:
    if not (timeout >= 0 and timeout != float("inf")):  # also refuses NaN, which would wait forever
        raise StoreError(f"lock timeout {timeout!r} is not allowed: give a number of seconds, 0 or more.")
    try:  # never through a link: one planted there made every command create a file outside the store
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
    except IsADirectoryError:
        raise CorruptStoreError(f"{path}: the store's lock file is a directory; move it away and retry.") from None
    except OSError as exc:
        if exc.errno != errno.ELOOP:
            raise
        raise CorruptStoreError(f"{path}: the store's lock file is a link; move it away and retry.") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):  # a FIFO or a device opened without blocking: no lock file
        os.close(fd)
        raise CorruptStoreError(f"{path}: the store's lock file is not a regular file; move it away and retry.")
    mode = fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH
    deadline = time.monotonic() + timeout
    told = False
    try:
        while True:
            try:
                fcntl.flock(fd, mode | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if not told and progress is not None:
                    what = "exclusive" if exclusive else "shared"
                    progress.note(f"waiting for the {what} store lock on {path} (another tailor process holds it)...")
                    told = True
                if time.monotonic() >= deadline:
                    raise LockTimeoutError(
                        f"{path}: could not take the store lock within {timeout:g} s; another tailor process "
                        "(a commit or gc) is still running. Wait for it, or raise ",
                        Call(lock_timeout="SECONDS"),
                        ".",
                    ) from None
                time.sleep(0.05)
        yield LockHandle(fd)
    finally:
        os.close(fd)


# -- a fence for what follows a failure or a stall ------------------------------------------------
# A fence for what follows a failure or a stall: no request goes out on a lease that lapsed.
#
# A change that failed takes back what it wrote, and a ref change settles after its write; both may
# run after the change's lease lapsed (the process stalled), when a gc may hold the store alone. A
# request sent then, unfenced, raced that gc: a take-back's drop marker was cleared as stale and its
# delete then took a step a gc had adopted (FORMAT.md 8.1). So such work runs under the change's own
# lease while it holds, or else under a new shared lease taken for it, every request fenced by it;
# where none can be had, it sends nothing (the caller keeps what it wrote, and says so).

FOLLOW_UP_WAIT = 30.0  # seconds to wait for a new lease: a gc that holds the store alone ends first


@contextmanager
def fence_for_follow_up(
    repo: StoreWriter, fence: Fence | None, what: str, *, wait: float = FOLLOW_UP_WAIT
) -> Iterator[Callable[[], None] | None]:
    """A check to run before each request of the follow-up: the change's own fence while it
    holds, else a new shared lease's (``LockTimeoutError`` when none comes within ``wait``).
    ``None`` for a change that runs unfenced (no lock of its own)."""
    if fence is None:
        yield None
        return
    if _holds(fence, what):
        yield lambda: fence.check(what)
        return
    with repo.lock(exclusive=False, timeout=wait) as again:
        yield lambda: again.check(what)


def _holds(fence: Fence, what: str) -> bool:
    try:
        fence.check(what)
    except LeaseLostError:
        return False
    return True
