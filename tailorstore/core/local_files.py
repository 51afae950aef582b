"""The one way tailorstore opens a local file that someone else may write to.

A checkpoint folder, a training's save folder and a shared staging folder are written by other
processes, and on a shared machine by other users. Opening such a file by its path is two
mistakes at once: every component of the path is looked up again (a link planted or swapped in
between a check and the open redirects it anywhere), and the open itself can block (a FIFO
nobody writes) or read a device without end. So every read of an input and every write into a
save, staging or output folder goes through this module, under four rules:

* **beneath**: a file is named relative to a folder it must not leave (:class:`Beneath`). The
  folder is opened once, as the user named it, and each component below it is opened relative
  to the descriptor of the one before (``openat``), with ``O_NOFOLLOW``. A symbolic link is
  followed only where its owner allows it (an input checkpoint's links to its own files), and
  then resolved by this module, component by component, never above the folder: a link that
  leads outside is refused (:class:`LeadsOutside`), however it was swapped in;
* **checked after opening**: what was opened is what is checked (``fstat`` of the descriptor),
  so no second look-up can disagree with the first. A FIFO or a device is opened with
  ``O_NONBLOCK`` (the open returns at once) and then refused (:class:`NotRegularFile`);
* **bounded**: a small control file (a head, a target record) is read to a limit and refused
  above it (:class:`TooLarge`);
* **new files are new**: a temp file is created with ``O_CREAT | O_EXCL | O_NOFOLLOW`` under an
  unpredictable name (``secrets.token_hex``) in the folder's descriptor and renamed into place
  there, so nothing planted under a guessed name is written through; an output file is created
  exclusively in a folder of ours.

The errors are :class:`OSError`\\ s, so a caller that treats an unreadable file as one (a warning,
no head) keeps doing so; the input path turns them into one-line refusals.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import secrets
import stat
from collections import deque
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

CLOEXEC = getattr(os, "O_CLOEXEC", 0)
READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | CLOEXEC  # a FIFO opens at once, and is refused
DIRECTORY = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | CLOEXEC
CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | CLOEXEC
MAX_LINKS = 40  # as the kernel's own limit on links followed in one look-up


class NotRegularFile(OSError):
    """What a name led to is no regular file: a FIFO, a device, a socket, a directory, or a link
    where none is allowed."""

    def __init__(self, path: Path | str, kind: str) -> None:
        super().__init__(f"{path}: {kind}, not a regular file")
        self.path, self.kind = Path(path), kind


class LeadsOutside(OSError):
    """A symbolic link that leads outside the folder a file must stay beneath."""

    def __init__(self, path: Path | str, top: Path | str) -> None:
        super().__init__(f"{path}: a symbolic link that leads outside {top}")
        self.path, self.top = Path(path), Path(top)


class TooLarge(OSError):
    """A control file over the bound it is read to."""

    def __init__(self, path: Path | str, limit: int) -> None:
        super().__init__(f"{path}: more than {limit} bytes")
        self.path, self.limit = Path(path), limit


@dataclass(frozen=True)
class Beneath:
    """A file named by ``rel`` (a relative POSIX path) below ``top``, which it must not leave.
    ``links``: whether links below ``top`` are followed (resolved beneath it) or refused."""

    top: Path
    rel: str
    links: bool = True

    @property
    def path(self) -> Path:
        """The path a user knows the file by (for messages; never opened as such)."""
        return self.top / self.rel

    def sibling(self, name: str) -> Beneath:
        parent = PurePosixPath(self.rel).parent
        return Beneath(self.top, (parent / name).as_posix(), self.links)


Where = Path | Beneath


def kind_of(mode: int) -> str:
    """What a file's mode says it is, in words."""
    if stat.S_ISREG(mode):
        return "a regular file"
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISLNK(mode):
        return "a symbolic link"
    if stat.S_ISFIFO(mode):
        return "a named pipe"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "a device"


def path_of(where: Where) -> Path:
    return where.path if isinstance(where, Beneath) else Path(where)


def open_dir(path: Path | str) -> int:
    """A descriptor of the directory ``path``, as the user named it (links in it followed)."""
    return os.open(path, os.O_RDONLY | os.O_DIRECTORY | CLOEXEC)


def open_input(where: Where) -> int:
    """A read-only descriptor of a regular file, checked after it was opened.

    A :class:`Beneath` is resolved below its folder, links only as it allows; a plain path is
    one the user named (``/proc/self/fd/N`` of a memory file among them): its links are
    followed, but what it opened must still be a regular file."""
    if isinstance(where, Beneath):
        top = open_dir(where.top)
        try:
            return _open_beneath(top, where)
        finally:
            os.close(top)
    fd = os.open(where, os.O_RDONLY | os.O_NONBLOCK | CLOEXEC)
    return _regular(fd, Path(where))


def stat_input(where: Where) -> os.stat_result:
    """The status of the regular file ``where`` names now, by the same rules as :func:`open_input`."""
    fd = open_input(where)
    try:
        return os.fstat(fd)
    finally:
        os.close(fd)


def read_small(where: Where, limit: int) -> bytes:
    """The whole of a small control file, at most ``limit`` bytes (else :class:`TooLarge`)."""
    fd = open_input(where)
    try:
        chunks: list[bytes] = []
        got = 0
        while got <= limit:
            piece = os.read(fd, limit + 1 - got)
            if not piece:
                break
            chunks.append(piece)
            got += len(piece)
    finally:
        os.close(fd)
    if got > limit:
        raise TooLarge(path_of(where), limit)
    return b"".join(chunks)


def write_atomic(folder: Path, name: str, data: bytes, *, mode: int = 0o644, durable: bool = False) -> None:
    """Replace ``folder/name`` with ``data`` at once: readers see the old file or the new one.

    The temp file is created exclusively, without following links, under a name nobody can
    guess, in the folder's own descriptor, and renamed there; the rename replaces whatever
    entry ``name`` is (a planted link included) and writes through none."""
    if "/" in name or name in ("", ".", ".."):
        raise ValueError(f"{name!r} is not a file name")
    dfd = open_dir(folder)
    tmp = f".{name}.{secrets.token_hex(8)}.tmp"
    try:
        fd = os.open(tmp, CREATE, mode, dir_fd=dfd)
        try:
            _write_all(fd, memoryview(data))
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
        if durable:
            os.fsync(dfd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dfd)
        raise
    finally:
        os.close(dfd)


def create_new(path: Path, mode: int = 0o644) -> int:
    """A write descriptor of a new file at ``path`` (its folder as named): never an existing entry,
    never through a link."""
    dfd = open_dir(path.parent)
    try:
        return os.open(path.name, CREATE, mode, dir_fd=dfd)
    finally:
        os.close(dfd)


def write_new(path: Path, data: bytes, mode: int = 0o644) -> None:
    """A new file at ``path`` holding ``data`` (:func:`create_new`)."""
    fd = create_new(path, mode)
    try:
        _write_all(fd, memoryview(data))
    finally:
        os.close(fd)


def _write_all(fd: int, data: memoryview) -> None:
    while data:
        data = data[os.write(fd, data) :]


def _regular(fd: int, path: Path) -> int:
    """``fd`` when it is a regular file (made blocking again), else closed and refused."""
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise NotRegularFile(path, kind_of(mode))
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _open_beneath(top: int, where: Beneath) -> int:
    """Resolve ``where.rel`` below the directory ``top`` one component at a time, each opened
    relative to the last with ``O_NOFOLLOW``; a link's target is spliced into the components
    still to walk, so it is resolved by the same rules, and ``..`` never climbs above ``top``."""
    pending = deque(PurePosixPath(where.rel).parts)
    if not pending or PurePosixPath(where.rel).is_absolute():
        raise ValueError(f"{where.rel!r} is no relative path")
    folders: list[int] = []  # descriptors opened below top, innermost last
    top_real: str | None = None
    links = 0
    try:
        while pending:
            name = pending.popleft()
            if name in ("", "."):
                continue
            if name == "..":
                if not folders:
                    raise LeadsOutside(where.path, where.top)
                os.close(folders.pop())
                continue
            at = folders[-1] if folders else top
            last = not pending
            try:
                fd = os.open(name, READ if last else DIRECTORY | os.O_NONBLOCK, dir_fd=at)
            except OSError as exc:
                if exc.errno not in (errno.ELOOP, errno.ENOTDIR, errno.EMLINK):
                    raise
                mode = os.stat(name, dir_fd=at, follow_symlinks=False).st_mode
                if not stat.S_ISLNK(mode):
                    raise
                if not where.links:
                    raise NotRegularFile(where.path, "a symbolic link") from None
                links += 1
                if links > MAX_LINKS:
                    raise OSError(errno.ELOOP, "too many levels of symbolic links", str(where.path)) from None
                target = os.readlink(name, dir_fd=at)
                if target.startswith("/"):
                    top_real = top_real or os.path.realpath(where.top)
                    inside = os.path.normpath(target)
                    if inside != top_real and not inside.startswith(top_real.rstrip("/") + "/"):
                        raise LeadsOutside(where.path, where.top) from None
                    while folders:
                        os.close(folders.pop())
                    target = os.path.relpath(inside, top_real)
                pending.extendleft(reversed(PurePosixPath(target).parts))
                continue
            if last:
                return _regular(fd, where.path)
            folders.append(fd)
        raise NotRegularFile(where.path, "a directory")  # the path ended on a folder ("a/..", a link to ".")
    finally:
        for fd in folders:
            os.close(fd)
