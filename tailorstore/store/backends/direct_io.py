"""Big writes and reads around the page cache (``O_DIRECT``), with a buffered fallback.

A checkpoint store moves gigabytes that nobody reads again soon: blobs at commit, output files at
checkout. Sent through the page cache, every byte first needs a page the kernel must find, and on
the machines we measured (VMs whose free memory the host has taken back) that is several times
slower than ``O_DIRECT`` writes from a reused, aligned buffer, which are *durable* as well
(docs/PERFORMANCE.md, "Through the page cache or around it"). ``O_DIRECT`` wants the file offset,
the length and the memory address aligned; these classes stage bytes through a per-thread,
page-aligned buffer (a copy at memory speed) so that callers need not care. Where the file system
refuses ``O_DIRECT`` (tmpfs, some network file systems) they write buffered.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor

ALIGN = 4096
BLOCK = 4 << 20  # bytes per direct write or read
MARK_SPAN = 512  # bytes after a told position whose pages a RewritableWriter keeps (a zip header)
_local = threading.local()
PREFETCH_THREADS = 4  # one read in flight per open reader; the conversions keep at most 3 or 4 open
_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _prefetch_pool() -> ThreadPoolExecutor:
    """The threads that read the next block of open readers (preadv releases the GIL)."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(PREFETCH_THREADS, thread_name_prefix="tailor-prefetch")
        return _pool


def _forget_pool() -> None:
    """A forked child has none of the pool's threads: work handed to that pool would never run."""
    global _pool, _pool_lock
    _pool, _pool_lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_pool)


def _staging(name: str) -> memoryview:
    """A page-aligned buffer of BLOCK bytes, one per thread and purpose, touched once, reused."""
    buf = getattr(_local, name, None)
    if buf is None:
        buf = memoryview(mmap.mmap(-1, BLOCK))
        setattr(_local, name, buf)
    return buf


def _take(name: str) -> memoryview:
    """The thread's buffer for ``name``, or a fresh one while an open file of this thread holds it."""
    busy: set[str] = getattr(_local, "busy", set())
    _local.busy = busy
    if name in busy:
        return memoryview(mmap.mmap(-1, BLOCK))
    busy.add(name)
    return _staging(name)


def _give(name: str, buf: memoryview | None) -> None:
    if buf is not None and buf is getattr(_local, name, None):
        _local.busy.discard(name)


def _down(n: int) -> int:
    return n - n % ALIGN


def _up(n: int) -> int:
    return _down(n + ALIGN - 1)


def _open_direct(path: os.PathLike | str, flags: int, mode: int = 0o600) -> int | None:
    direct = getattr(os, "O_DIRECT", 0)
    if not direct:
        return None
    try:
        return os.open(path, flags | direct, mode)
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            return None
        raise


def _write_all(fd: int, data: memoryview) -> None:
    while data:
        data = data[os.write(fd, data) :]


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while data:
        n = os.pwrite(fd, data, offset)
        data, offset = data[n:], offset + n


def _drop_direct(fd: int) -> None:
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~getattr(os, "O_DIRECT", 0))


class SequentialWriter:
    """Append-only writes to a new file; the way blobs are written.

    ``direct=False`` writes through the page cache: for small files, where one direct
    write's latency costs more than a few pages.
    """

    def __init__(self, path: os.PathLike | str, mode: int = 0o444, direct: bool = True) -> None:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
        fd = _open_direct(path, flags, mode) if direct else None
        self.direct = fd is not None
        self.fd = fd if fd is not None else os.open(path, flags, mode)
        self.size = 0
        self._fill = 0
        self._written = 0  # bytes written out of the staging buffer so far
        self._buf = self._held = _take("write") if self.direct else None

    def write(self, data: bytes | bytearray | memoryview) -> None:
        view = memoryview(data).cast("B")
        self.size += len(view)
        if self._buf is None:
            _write_all(self.fd, view)
            return
        while view:
            if self._buf is None:  # a flush found O_DIRECT refused: the rest through the page cache
                _write_all(self.fd, view)
                return
            n = min(len(view), BLOCK - self._fill)
            self._buf[self._fill : self._fill + n] = view[:n]
            self._fill += n
            view = view[n:]
            if self._fill == BLOCK:
                self._flush(BLOCK)

    def _flush(self, length: int) -> None:
        assert self._buf is not None
        try:
            _write_all(self.fd, self._buf[:length])
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            _drop_direct(self.fd)  # the file system takes O_DIRECT at open but not at write
            self._buf = None
            _write_all(self.fd, self._held[: self._fill])
        self._written += length
        self._fill = 0

    def close(self, durable: bool = False) -> None:
        """Write the tail and close; ``durable``: fsync first, after the last byte is written
        (an fsync before the tail would leave the tail and the file's size to chance)."""
        try:
            self._write_tail()
            if durable:
                os.fsync(self.fd)
        finally:
            os.close(self.fd)
            _give("write", self._held if self.direct else None)

    def __enter__(self) -> SequentialWriter:
        return self

    def __exit__(self, kind: type[BaseException] | None, *exc: object) -> None:
        if kind is None:
            self.close()
            return
        os.close(self.fd)  # failed: the file is being discarded, and the error is what matters
        _give("write", self._held if self.direct else None)

    def _write_tail(self) -> None:
        """The whole pages left in the staging buffer go direct; the last partial page goes
        through the page cache (the file's end is a new page there, nothing to read first).
        Padding it and cutting the file back instead cost an ``ftruncate`` per file, which
        waited for the journal, a tenth of a universal checkpoint's time over its hundreds of
        files (docs/PERFORMANCE.md, "Through the page cache or around it")."""
        if self._buf is None or not self._fill:
            return
        fill, whole = self._fill, _down(self._fill)
        if whole:
            self._fill = whole
            self._flush(whole)
        if fill > whole:
            _drop_direct(self.fd)  # from here the file is written through the page cache
            self._buf = None
            _write_all(self.fd, self._held[whole:fill])
        self._fill = 0


class RewritableWriter(SequentialWriter):
    """A new file written front to back like :class:`SequentialWriter`, whose writer may also go
    back and overwrite bytes it has written: a file object for :mod:`zipfile`, which rewrites
    each record's local header once the record's CRC is known (torch files are zips).

    Overwritten bytes still in the staging buffer are changed there. For bytes already written
    out, the writer keeps a copy of the pages around every position :meth:`tell` reported (where
    zipfile puts a header, to come back to it): an overwrite there changes the copy, and the
    changed pages go out direct, whole, at :meth:`close`. Any other overwrite of bytes written out
    is kept aside and written through the page cache at close, after the last direct write (a
    direct write never meets a dirty page of the same file); that costs the kernel a read of the
    page from disk first, which the kept pages avoid.
    """

    def __init__(self, path: os.PathLike | str, mode: int = 0o644, direct: bool = True) -> None:
        super().__init__(path, mode, direct)
        self.pos = 0
        self._later: list[tuple[int, bytes]] = []  # (offset, bytes) to write at close
        self._marks: list[int] = []  # positions told and still in the staging buffer
        self._kept: dict[int, bytearray] = {}  # file offset of a page written out -> its bytes
        self._changed: set[int] = set()  # kept pages overwritten since

    def tell(self) -> int:
        if self._buf is not None and self.pos == self.size and self.pos not in self._marks[-1:]:
            self._marks.append(self.pos)  # zipfile and torch_save_writer both ask before each record
        return self.pos

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        target = {os.SEEK_SET: offset, os.SEEK_CUR: self.pos + offset, os.SEEK_END: self.size + offset}[whence]
        if not 0 <= target <= self.size:
            raise OSError(errno.EINVAL, f"cannot seek to {target} in a file of {self.size} bytes being written")
        self.pos = target
        return target

    def write(self, data: bytes | bytearray | memoryview) -> int:  # type: ignore[override]
        view = memoryview(data).cast("B")
        count = len(view)
        if self.pos < self.size:
            head = view[: self.size - self.pos]
            self._overwrite(head, self.pos)
            self.pos += len(head)
            view = view[len(head) :]
        if view:
            super().write(view)
            self.pos = self.size
        return count

    def _flush(self, length: int) -> None:
        """Before a block goes out, copy the pages of it that lie within :data:`MARK_SPAN` bytes
        after a told position (a zip header's bytes, to be rewritten)."""
        start = self._written
        end = start + length
        for mark in self._marks:
            first, last = max(_down(mark), start), min(_up(mark + MARK_SPAN), end)
            for page in range(first, last, ALIGN):
                if page not in self._kept:
                    self._kept[page] = bytearray(self._buf[page - start : page - start + ALIGN])
        self._marks = [m for m in self._marks if m + MARK_SPAN > end]
        super()._flush(length)
        if self._buf is None:  # O_DIRECT refused on the way: every overwrite goes to the page cache now
            self._write_kept()
            self._kept.clear()
            self._marks.clear()

    def _overwrite(self, view: memoryview, at: int) -> None:
        if self._buf is None:  # buffered (no O_DIRECT here): the page cache takes any offset
            _pwrite_all(self.fd, view, at)
            return
        written_out = self._written  # bytes before this offset have left the staging buffer
        if at < written_out:
            split = min(len(view), written_out - at)
            if not self._in_kept(view[:split], at):
                self._later.append((at, bytes(view[:split])))
            view, at = view[split:], at + split
        if view:
            self._buf[at - written_out : at - written_out + len(view)] = view

    def _in_kept(self, view: memoryview, at: int) -> bool:
        """Overwrite the kept copies of written-out pages, if every page ``view`` touches is kept."""
        pages = range(_down(at), _up(at + len(view)), ALIGN)
        if not all(page in self._kept for page in pages):
            return False
        for page in pages:
            lo, hi = max(at, page), min(at + len(view), page + ALIGN)
            self._kept[page][lo - page : hi - page] = view[lo - at : hi - at]
            self._changed.add(page)
        return True

    def flush(self) -> None:
        """Nothing to do: whole blocks go out as they fill, the rest at :meth:`close`."""

    def _write_kept(self) -> None:
        """Write the changed kept pages: whole and direct, or through the page cache once the
        file system has refused O_DIRECT."""
        page_buf = _staging("page") if self._buf is not None else None
        for page in sorted(self._changed):
            if page_buf is None:
                _pwrite_all(self.fd, memoryview(self._kept[page]), page)
            else:
                page_buf[:ALIGN] = self._kept[page]
                _pwrite_all(self.fd, page_buf[:ALIGN], page)
        self._changed.clear()

    def _write_tail(self) -> None:
        self._write_kept()
        super()._write_tail()
        if self._later:
            _drop_direct(self.fd)
            for at, data in self._later:
                _pwrite_all(self.fd, memoryview(data), at)


class PlacedWriter:
    """Writes at any offset of a new file of known size; the way checkout writes files.

    The aligned interior of each write goes direct; the partial blocks at its two ends go
    through the page cache. Two writes that share a block therefore meet in the page cache,
    never in a direct write, so they may come from different threads in any order.
    """

    def __init__(self, path: os.PathLike | str, size: int) -> None:
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        self.size = size
        os.ftruncate(self.fd, size)
        self.direct_fd = _open_direct(path, os.O_RDWR)

    def pwrite(self, data: memoryview, offset: int) -> None:
        end = offset + len(data)
        first, last = _up(offset), _down(end)
        if self.direct_fd is None or last - first < ALIGN:
            _pwrite_all(self.fd, data, offset)
            return
        _pwrite_all(self.fd, data[: first - offset], offset)
        _pwrite_all(self.fd, data[last - offset :], last)
        buf = _staging("place")
        at = first
        while at < last:
            n = min(BLOCK, last - at)
            buf[:n] = data[at - offset : at - offset + n]
            try:
                _pwrite_all(self.direct_fd, buf[:n], at)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                os.close(self.direct_fd)
                self.direct_fd = None
                _pwrite_all(self.fd, data[at - offset : last - offset], at)
                return
            at += n

    def pread_into(self, dest: memoryview, offset: int) -> None:
        """Read back bytes written earlier (the direct read sees the page-cache edges too)."""
        if self.direct_fd is None:
            if os.preadv(self.fd, [dest], offset) != len(dest):
                raise OSError(errno.EIO, "short read")
            return
        buf = _staging("readback")
        done = 0
        while done < len(dest):
            at = offset + done
            start = _down(at)
            n = min(BLOCK, _up(offset + len(dest)) - start)
            got = os.preadv(self.direct_fd, [buf[:n]], start)
            take = min(len(dest) - done, got - (at - start))
            if take <= 0:
                raise OSError(errno.EIO, "short read")
            dest[done : done + take] = buf[at - start : at - start + take]
            done += take

    def close(self) -> None:
        if self.direct_fd is not None:
            os.close(self.direct_fd)
        os.close(self.fd)


class DirectReader:
    """A sequential reader of a file or of a byte range of it (a blob inside a pack), the way
    blobs are read: ``read`` and ``readinto``. Direct reads start at the aligned offset
    below ``start`` and skip the bytes before it.

    Once a whole block has been read, the next is read on a pool thread into a second buffer
    while the caller decodes this one, so a blob streams at the slower of the disk and the
    decoder rather than at their sum (docs/PERFORMANCE.md, "Through the page cache or around
    it")."""

    def __init__(self, path: os.PathLike | str, start: int = 0, length: int | None = None) -> None:
        fd = _open_direct(path, os.O_RDONLY)
        self._direct = fd is not None
        self.fd = fd if fd is not None else os.open(path, os.O_RDONLY)
        self._buf = _take("read")
        self._spare: memoryview | None = None  # the second buffer, taken at the first read ahead
        self._next: Future[int] | None = None  # the read of the block after the current one
        self._start = self._end = 0  # unread bytes are self._buf[start:end]
        self._eof = False
        self._offset = _down(start)  # file offset of the next refill
        self._skip = start - self._offset
        self._left = None if length is None else length  # bytes still to hand out

    def _want(self) -> int:
        # Never past the aligned end of the range: a small blob inside a large pack reads its own
        # blocks, not a whole BLOCK (which made the small atoms of a checkout 9 times dearer).
        return BLOCK if self._left is None else min(BLOCK, _up(self._skip + self._left))

    def _read_block(self, buf: memoryview, want: int, offset: int) -> int:
        try:
            return os.preadv(self.fd, [buf[:want]], offset)
        except OSError as exc:
            if exc.errno != errno.EINVAL or not self._direct:
                raise
            _drop_direct(self.fd)
            self._direct = False
            return os.preadv(self.fd, [buf[:want]], offset)

    def _refill(self) -> None:
        n = self._take_prefetched()
        if n is None:
            n = self._read_block(self._buf, self._want(), self._offset)
        self._offset += n
        start, end = min(self._skip, n), n
        self._skip -= start
        if self._left is not None:
            end = min(end, start + self._left)
            self._left -= end - start
        self._start, self._end = start, end
        self._eof = n == 0 or self._left == 0
        if not self._eof and n == BLOCK:  # a short read is the range's (or the file's) end
            self._read_ahead()

    def _read_ahead(self) -> None:
        if self._spare is None:
            self._spare = _take("read-next")
        self._next = _prefetch_pool().submit(self._read_block, self._spare, self._want(), self._offset)

    def _take_prefetched(self) -> int | None:
        """The length of the block read ahead, now in ``_buf`` (errors of that read raise here,
        where a read of the caller's own would have); None when none was started."""
        if self._next is None:
            return None
        n, self._next = self._next.result(), None
        self._buf, self._spare = self._spare, self._buf
        return n

    def readinto(self, dest: memoryview | bytearray) -> int:
        dest = memoryview(dest).cast("B")
        done = 0
        while done < len(dest):
            if self._start == self._end:
                if self._eof:
                    break
                self._refill()
                continue
            n = min(len(dest) - done, self._end - self._start)
            dest[done : done + n] = self._buf[self._start : self._start + n]
            self._start += n
            done += n
        return done

    def read(self, size: int = -1) -> bytes:
        if size < 0:
            parts = []
            while True:
                chunk = self.read(BLOCK)
                if not chunk:
                    return b"".join(parts)
                parts.append(chunk)
        out = bytearray(size)
        n = self.readinto(out)
        return bytes(out[:n])

    def readable(self) -> bool:
        return True

    def close(self) -> None:
        if self._next is not None:  # its read writes into our buffer: wait before giving the buffer back
            self._next.exception()
            self._next = None
        os.close(self.fd)
        for buf in (self._buf, self._spare):
            _give("read", buf)
            _give("read-next", buf)

    def __enter__(self) -> DirectReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
