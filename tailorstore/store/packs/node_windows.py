"""What the ranks of one node read of a remote store, fetched once for all of them.

Why: on a resume every rank of a node reads the step's blobs, and many blobs are the same for
several ranks (DeepSpeed's replicated model states, HSDP's replicas, a tensor every rank loads
whole). Each rank fetching its own copy multiplied a node's traffic from the object store by its
ranks (a 2-rank ZeRO-2 resume fetched 1.68x the step's stored bytes). Here every read of an
object's bytes is cut into aligned *windows* (:data:`WINDOW` bytes of the object), and each window
is fetched by the first rank that needs it and kept in the node's cache folder (the index cache's
folder, which the node's ranks share); the others read the kept copy. Windows are the unit because
two ranks plan different spans of one pack (each its own wanted blobs), but they need the same
windows of it.

The call order of one window: read the kept copy if there is one (its trailer, the xxh3-128 of its
bytes, checked: a damaged copy is deleted and fetched again); else take the window's ``flock``
(another rank of the node may be fetching it: wait for it), look again, fetch it, keep it
(temp file, then rename: a reader sees the whole window or none), release. A rank that dies while
fetching releases its lock with its process, so a waiting rank fetches the window itself: nothing
waits on a dead rank. Keeping a copy is never a read's failure (a full disk keeps nothing). Packs
never change once written, so a kept window is never stale; each decoded blob is hash-checked as
any read is. :func:`prune` deletes windows older than :data:`KEEP_SECONDS` when a node starts
sharing reads.
"""

from __future__ import annotations

import contextlib
import fcntl
import io
import logging
import os
import re
import stat
import time
from collections.abc import Iterator
from pathlib import Path

import xxhash

from tailorstore.core.errors import Call, CorruptStoreError
from tailorstore.core.failpoints import failpoint
from tailorstore.core.local_files import Beneath, read_small, write_atomic
from tailorstore.store.backends.base import Backend

log = logging.getLogger("tailorstore")

WINDOW = 4 << 20  # bytes of an object a window holds (the last one of an object may be shorter)
KEEP_SECONDS = 6 * 3600.0  # a kept window older than this goes at the next start of sharing
_DIGEST = 16  # bytes of the trailer: xxh3-128 of the window's bytes
_SAFE = re.compile(r"[^A-Za-z0-9._-]")


class NodeWindows:
    """Reads of ``backend``'s objects through the windows kept in ``folder``, shared by the node."""

    def __init__(self, backend: Backend, folder: Path, window: int = WINDOW) -> None:
        self._backend = backend
        self._folder = folder
        self._window = window
        self.fetched = 0  # windows this process fetched from the backend
        self.shared = 0  # windows it read from the node's kept copies
        folder.mkdir(parents=True, exist_ok=True)

    def read(self, key: str, start: int, length: int) -> bytes:
        """Bytes ``[start, start + length)`` of object ``key``, from its windows."""
        if length <= 0:
            return b""
        out = bytearray(length)
        end = start + length
        for k in range(start // self._window, (end - 1) // self._window + 1):
            data = self._enough(key, k, min(end, (k + 1) * self._window) - k * self._window)
            base = k * self._window
            lo, hi = max(start, base), base + len(data)
            out[lo - start : min(end, hi) - start] = data[lo - base : min(end, hi) - base]
        return bytes(out)

    def _enough(self, key: str, k: int, wanted: int) -> bytes:
        """Window ``k``, holding at least ``wanted`` bytes. A kept copy shorter than that is not
        trusted (the object ends there only if the store says so): it is fetched again, and an
        object that is shorter than the read is a damaged store, said as one."""
        data = self._window_of(key, k)
        if len(data) < wanted:
            data = self._window_of(key, k, fresh=True)
        if len(data) < wanted:
            raise CorruptStoreError(
                f"{key}: ends at byte {k * self._window + len(data)}, where the index says its blobs go on; "
                "restore it from a backup. To see every step it affects: ",
                Call("verify"),
                ".",
            )
        return data

    def reader(self, key: str, start: int, length: int) -> io.RawIOBase:
        """A reader of those bytes that holds one window at a time (a blob of gigabytes is read
        through, never held whole)."""
        return _WindowReader(self, key, start, start + length)

    def _window_of(self, key: str, k: int, *, fresh: bool = False) -> bytes:
        name = f"{_SAFE.sub('_', key)}.{k}"
        kept = None if fresh else self._kept(name)
        if kept is not None:
            self.shared += 1
            return kept
        with self._locked(name + ".lock"):  # another rank of the node may be fetching it
            kept = None if fresh else self._kept(name)
            if kept is not None:
                self.shared += 1
                return kept
            failpoint("node-window-fetch")
            data = self._backend.get(key, k * self._window, self._window)
            self.fetched += 1
            self._keep(name, data)
            return data

    def _kept(self, name: str) -> bytes | None:
        try:
            held = read_small(Beneath(self._folder, name, links=False), self._window + _DIGEST)
        except FileNotFoundError:
            return None
        except OSError:  # a link, a FIFO or a huge file where a window belongs: not ours, fetch instead
            return None
        data, digest = held[:-_DIGEST], held[-_DIGEST:]
        if len(held) < _DIGEST or xxhash.xxh3_128_digest(data) != digest:
            with contextlib.suppress(OSError):
                os.unlink(self._folder / name)
            return None
        return data

    def _keep(self, name: str, data: bytes) -> None:
        try:
            write_atomic(self._folder, name, data + xxhash.xxh3_128_digest(data))
        except OSError as exc:  # the read has its bytes; the node's other ranks fetch their own
            log.warning("tailorstore: could not keep a window of a read for this node's other ranks: %s", exc)

    @contextlib.contextmanager
    def _locked(self, name: str) -> Iterator[None]:
        try:
            fd = os.open(self._folder / name, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
        except OSError:  # no lock to be had (a planted link, a full folder): fetch without sharing
            yield
            return
        try:
            if stat.S_ISREG(os.fstat(fd).st_mode):
                fcntl.flock(fd, fcntl.LOCK_EX)  # a holder that dies releases it with its process
            yield
        finally:
            os.close(fd)


class _WindowReader(io.RawIOBase):
    def __init__(self, windows: NodeWindows, key: str, start: int, end: int) -> None:
        self._windows, self._key, self._pos, self._end = windows, key, start, end
        self._held: tuple[int, bytes] | None = None  # (window number, its bytes)

    def readable(self) -> bool:
        return True

    def readinto(self, dest: memoryview | bytearray) -> int:  # type: ignore[override]
        if self._pos >= self._end:
            return 0
        size = self._windows._window
        k = self._pos // size
        if self._held is None or self._held[0] != k:
            self._held = (k, self._windows._enough(self._key, k, min(self._end, (k + 1) * size) - k * size))
        data = self._held[1]
        lo = self._pos - k * size
        n = min(len(dest), len(data) - lo, self._end - self._pos)
        memoryview(dest).cast("B")[:n] = memoryview(data)[lo : lo + n]
        self._pos += n
        return n


def prune(folder: Path, keep_seconds: float = KEEP_SECONDS) -> int:
    """Delete the windows (and their lock files) in ``folder`` older than ``keep_seconds``; returns
    how many went. A window being written is a temp file until its rename, and a reader that opened
    one keeps its bytes, so pruning beside other ranks loses no read."""
    gone = 0
    cutoff = time.time() - keep_seconds
    with contextlib.suppress(FileNotFoundError):
        for entry in os.scandir(folder):
            with contextlib.suppress(OSError):
                if entry.is_file(follow_symlinks=False) and entry.stat(follow_symlinks=False).st_mtime < cutoff:
                    os.unlink(entry.path)
                    gone += 1
    return gone
