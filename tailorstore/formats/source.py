"""Reading one input file so that what is stored is exactly what was there, or nothing.

A checkpoint can change under a commit: a training job re-saves into the same folder, a
sync tool replaces a file by rename, a disk fills and a file is cut short. Three rules keep
such a commit from recording a step that restores wrong data:

* every read of a file goes through one descriptor, opened once per pass, so a rename
  cannot mix the bytes of two files (torch opens ``/proc/self/fd/N``, the same inode). It is
  opened beneath the folder given to commit (``core/local_files``: relative to the folder's
  descriptor, no link followed out of it) and checked to be a regular file once opened, so a
  link to ``../.ssh/id_rsa``, swapped in between any check and the open, or a FIFO, is refused
  (:func:`refused`) rather than read or waited on;
* every byte that is hashed is first copied out of the file into private memory, and the
  same copy is compressed, so a blob's name always describes its bytes (nothing reads a
  memory map of the input, which a truncation would also turn into SIGBUS);
* the file's identity (device, inode, size, mtime, ctime) is taken when it is first opened
  and compared after its last read, through the descriptor and through the path. Any
  difference refuses the commit with :class:`InputChangedError`, before the manifest.

A memory file of the DCP writer (``formats/memory_folder.py``) may *lend* byte ranges: a
tensor's bytes that ``torch.save`` would have copied into the file stay in the tensor, and the
file holds a hole there. Reading such a range copies it from the tensor instead, and that copy
must hash (xxh3-128) to what the tensor's memory hashed to when ``torch.save`` handed it to the
writer, so a tensor changed between the save and the commit's copy refuses the commit as a
changed file does. A lent range is read whole (it is one tensor item's data record), never in
part, so every copy of it is checked.
"""

from __future__ import annotations

import bisect
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import xxhash

from tailorstore.core.errors import BadCheckpointError, InputChangedError, StoreError
from tailorstore.core.local_files import LeadsOutside, NotRegularFile, Where, open_input, path_of, stat_input
from tailorstore.core.piece_slab import private_copy_buffer
from tailorstore.formats.torch_zip import record_offsets

CHUNK = 4 << 20  # bytes per read when a file is streamed


@dataclass(frozen=True)
class Identity:
    dev: int
    ino: int
    size: int
    mtime_ns: int
    ctime_ns: int

    @classmethod
    def of(cls, st: os.stat_result) -> Identity:
        return cls(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)

    def differs(self, other: Identity) -> str:
        """What changed, in words, or '' when nothing did."""
        if (self.dev, self.ino) != (other.dev, other.ino):
            return "it was replaced by another file"
        if self.size != other.size:
            return f"its size went from {self.size} to {other.size} bytes"
        if (self.mtime_ns, self.ctime_ns) != (other.mtime_ns, other.ctime_ns):
            return "it was written to"
        return ""


@dataclass
class LentBytes:
    """Bytes ``[offset, offset + len(data))`` of a memory file that live outside it, in memory
    its writer keeps alive (``owner``), with their xxh3-128 digest as ``torch.save`` wrote them."""

    offset: int
    data: memoryview
    digest: bytes
    owner: object

    @property
    def end(self) -> int:
        return self.offset + len(self.data)


# Lent ranges by the (device, inode) of the memory file holding the holes: an anonymous memory
# file's inode lives on the kernel's own mount, so no file on any disk can share its key.
_LENT: dict[tuple[int, int], list[LentBytes]] = {}


def lend(fd: int, ranges: list[LentBytes]) -> None:
    """Say that the memory file open on ``fd`` leaves ``ranges`` (filled in as it is written, in
    file order) to be read from memory."""
    st = os.fstat(fd)
    _LENT[(st.st_dev, st.st_ino)] = ranges


def withdraw(fd: int) -> None:
    st = os.fstat(fd)
    _LENT.pop((st.st_dev, st.st_ino), None)


def refused(exc: OSError, path: Path | str) -> BadCheckpointError:
    """The one line that refuses an input entry the open found to be no file of the checkpoint."""
    if isinstance(exc, LeadsOutside):
        return BadCheckpointError(
            f"{path}: a symbolic link that leads outside the checkpoint ({exc.top}). tailorstore does not "
            "commit files from outside the checkpoint; copy the file in, or remove the link."
        )
    if isinstance(exc, NotRegularFile):
        return BadCheckpointError(
            f"{path}: {exc.kind}, not a regular file; a checkpoint holds files and folders only. "
            "Remove it from the checkpoint (or replace it with the file it stands for)."
        )
    if isinstance(exc, FileNotFoundError):
        return BadCheckpointError(
            f"{path}: names nothing (a symbolic link to a missing file?). Remove it from the checkpoint."
        )
    return BadCheckpointError(
        f"{path}: cannot be read ({exc.strerror or exc}). Fix its permissions or remove it from the checkpoint."
    )


def changed(path: Path | str, why: str) -> InputChangedError:
    return InputChangedError(
        f"{path}: changed while it was being committed ({why}). The commit was not recorded and the store is "
        "as it was; commit again once the save has finished and nothing else writes to the checkpoint."
    )


class InputFile:
    """One input file, open on one descriptor, with the identity it must keep. ``where`` is a
    file beneath the folder given to commit (:class:`Beneath`), or a path the caller named
    itself (a memory file's ``/proc/self/fd/N``, a file a test hands in)."""

    def __init__(self, where: Where, expected: Identity | None = None) -> None:
        self.where = where
        self.path = path_of(where)
        try:
            self.fd = open_input(where)
        except FileNotFoundError:  # listed, and checked by detect, a moment ago
            raise changed(self.path, "it was removed or renamed") from None
        except OSError as exc:
            raise refused(exc, self.path) from None
        st = os.fstat(self.fd)
        self.identity = Identity.of(st)
        self.mode = st.st_mode & 0o777
        if expected is not None and (why := expected.differs(self.identity)):
            os.close(self.fd)
            raise changed(self.path, why)
        self.expected = expected or self.identity
        self._lent = _LENT.get((st.st_dev, st.st_ino), [])
        self._lent_starts = [lent.offset for lent in self._lent]

    @property
    def size(self) -> int:
        return self.expected.size

    @property
    def by_descriptor(self) -> str:
        """A path that opens this very inode (Linux), for libraries that take only paths."""
        proc = f"/proc/self/fd/{self.fd}"
        return proc if os.path.exists(proc) else str(self.path)

    def zip_records(self) -> dict[str, tuple[int, int]]:
        """The file's zip records (name -> offset, size), read through this descriptor."""
        return record_offsets(self.fd)

    def window(self, base: int, length: int) -> InputWindow:
        """``length`` bytes from ``base`` on, read as a file of their own (one item of a DCP file)."""
        if base < 0 or length < 0 or base + length > self.size:
            raise BadCheckpointError(f"{self.path}: a range of {length} bytes at {base} lies outside the file")
        return InputWindow(self, base, length)

    def read(self, offset: int, length: int) -> memoryview:
        """``length`` bytes at ``offset``, copied into private memory."""
        view = private_copy_buffer(length) if length else memoryview(b"")
        self._fill(view, offset)
        return view

    def _fill(self, view: memoryview, offset: int) -> None:
        if not self._lent:
            self._read_file(view, offset)
            return
        end = offset + len(view)
        at = offset  # the file's bytes up to here are filled
        for i in range(max(bisect.bisect_right(self._lent_starts, offset) - 1, 0), len(self._lent)):
            lent = self._lent[i]
            if lent.offset >= end:
                break
            if lent.end <= offset:
                continue
            if lent.offset < offset or lent.end > end:
                raise StoreError(f"{self.path}: bytes lent by a tensor were read in part; they are read whole")
            self._read_file(view[at - offset : lent.offset - offset], at)  # the file's own bytes before it
            copy = view[lent.offset - offset : lent.end - offset]
            copy[:] = lent.data
            if xxhash.xxh3_128_digest(copy) != lent.digest:  # on the copy that is hashed and stored
                raise changed(self.path, "a tensor saved into it changed before the commit copied it")
            at = lent.end
        self._read_file(view[at - offset :], at)

    def _read_file(self, view: memoryview, offset: int) -> None:
        done = 0
        while done < len(view):
            n = os.preadv(self.fd, [view[done:]], offset + done)
            if n == 0:
                raise changed(self.path, f"it ends at byte {offset + done}, short of the {self.size} it had")
            done += n

    def chunks(self, offset: int, length: int) -> Iterator[memoryview]:
        """The range in CHUNK pieces through one reused buffer: use each before asking for the next."""
        buf = memoryview(np.empty(min(CHUNK, max(length, 1)), dtype=np.uint8)).cast("B")
        at = offset
        while at < offset + length:
            piece = buf[: min(len(buf), offset + length - at)]
            self._fill(piece, at)
            at += len(piece)
            yield piece

    def hash(self, offset: int, length: int) -> str:
        h = xxhash.xxh3_128()
        for piece in self.chunks(offset, length):
            h.update(piece)
        return h.hexdigest()

    def verified_chunks(self, offset: int, length: int, digest: str) -> Iterator[memoryview]:
        """Like :meth:`chunks`, and at the end the bytes handed out must hash to ``digest``.

        Each chunk is hashed and then used by the caller (compressed), so the name of the
        blob and its stored bytes come from the same copy.
        """
        h = xxhash.xxh3_128()
        for piece in self.chunks(offset, length):
            h.update(piece)
            yield piece
        if h.hexdigest() != digest:
            raise changed(self.path, "its bytes differ between two reads")

    def check(self) -> None:
        """Refuse if the file changed since it was first opened (through the descriptor and the path)."""
        now = Identity.of(os.fstat(self.fd))
        why = self.expected.differs(now)
        if not why:
            why = _differs_now(self.where, self.expected)
        if why:
            raise changed(self.path, why)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> InputFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class InputWindow:
    """A range of an :class:`InputFile`, read as a file of its own: offsets count from its start."""

    def __init__(self, parent: InputFile, base: int, length: int) -> None:
        self.parent, self.base, self.length = parent, base, length

    @property
    def size(self) -> int:
        return self.length

    def zip_records(self) -> dict[str, tuple[int, int]]:
        return record_offsets(self.parent.fd, self.base, self.length)

    def read(self, offset: int, length: int) -> memoryview:
        if offset < 0 or length < 0 or offset + length > self.length:
            raise BadCheckpointError(f"{self.parent.path}: a read past the end of the item at byte {self.base}")
        return self.parent.read(self.base + offset, length)


def check_unchanged(where: Where, expected: Identity) -> None:
    """The last look before a manifest is recorded: the name still opens the same, unchanged file
    (looked up by the rules of the first open, so a link swapped in since is refused too)."""
    if why := _differs_now(where, expected):
        raise changed(path_of(where), why)


def _differs_now(where: Where, expected: Identity) -> str:
    try:
        return expected.differs(Identity.of(stat_input(where)))
    except FileNotFoundError:
        return "it was removed or renamed"
    except LeadsOutside:
        return "it was replaced by a link leading outside the checkpoint"
    except NotRegularFile as exc:
        return f"it was replaced by {exc.kind}"
