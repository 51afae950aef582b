"""Files held in memory that a commit reads as one checkpoint folder: what the DCP writer
(``integrations/dcp/writer.py``) serializes a rank's items into, so that no raw file is written.

Each file is an anonymous memory file (``memfd_create``): it has a descriptor and an identity
like any file, so the commit reads it through :class:`tailorstore.formats.source.InputFile`
exactly as it reads a folder on disk (one descriptor, private copies, the identity checked after
the last read), and the step it records is the one a commit of the same files on disk records.
No other process can reach the memory, and it is freed when the folder is closed. Where the
system has no ``memfd_create`` (not Linux), an unnamed temporary file stands in.

A tensor's bytes are not copied into the file: when ``torch.save`` hands the writer a tensor's
own memory (:meth:`LendingWriter.lend`), the writer leaves a hole of its size and lends the range
(``formats/source.py``), and the commit copies it from the tensor, checked against the xxh3-128
the tensor's memory hashed to as ``torch.save`` wrote it. (Checking the zip's own CRC-32 instead
cost a sixth of a rank's save: zlib's CRC-32 is several times slower than xxh3.) The bytes the
step stores are the same; what is gone is a copy of the whole save into fresh memory, and that
memory, a third of the save's time to fill and free (docs/PERFORMANCE.md, "Saving inside
training"). The tensors stay referenced until the folder is closed.
"""

from __future__ import annotations

import io
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from tailorstore.core.piece_slab import private_copy_buffer
from tailorstore.formats import source
from tailorstore.formats.layout import DCP_FOLDER, CheckpointLayout

FILE_MODE = 0o644  # what a save's file gets under the usual umask, and what a checkout writes back
MEMORY_ROOT = Path("<memory>")  # the root a memory folder's paths are relative to; never opened


class MemoryFile:
    """One file in anonymous memory, written once through :meth:`writer`, then read by path."""

    def __init__(self, name: str) -> None:
        memfd = getattr(os, "memfd_create", None)
        if memfd is not None:
            self.fd = memfd(name, getattr(os, "MFD_CLOEXEC", 0))
            os.fchmod(self.fd, FILE_MODE)  # a memory file starts at 0o777, which a checkout would apply
        else:  # pragma: no cover - not Linux
            with tempfile.TemporaryFile(prefix="tailor-") as spare:
                self.fd = os.dup(spare.fileno())
        self.lent: list[source.LentBytes] = []
        source.lend(self.fd, self.lent)

    def writer(self) -> LendingWriter:
        """A binary stream at the file's start; the caller closes it."""
        return LendingWriter(self.fd, self.lent)

    @property
    def size(self) -> int:
        return os.fstat(self.fd).st_size

    @property
    def path(self) -> Path:
        """A path that opens this very file in this process."""
        return Path(f"/proc/self/fd/{self.fd}")

    def close(self) -> None:
        if self.fd >= 0:
            source.withdraw(self.fd)
            os.close(self.fd)
            self.fd = -1
            self.lent.clear()  # the tensors it kept alive, for whatever still holds the list


_DESCRIPTOR = b"PK\x07\x08"  # a zip data descriptor: signature, CRC-32, then the sizes
_DESCRIPTOR_SIZES = (16, 24)  # with 4-byte sizes, and with zip64's 8-byte ones
_BUFFER = 256 << 10  # small writes (zip headers, pickles) gathered before they reach the file


class LendingWriter(io.RawIOBase):
    """Writes a memory file, leaving holes where :meth:`lend` says a tensor's own bytes come.

    ``torch.save`` writes a tensor's record as its zip header, its data straight from the
    tensor's memory, then a data descriptor (miniz, as PyTorch's zip writer uses it). A write of
    exactly the lent tensor's bytes, from its very address, becomes a hole, hashed as it is
    handed over, once the descriptor follows it. Anything else (no descriptor next, another
    address) is written into the file as it comes, so the file is always whole."""

    def __init__(self, fd: int, lent: list[source.LentBytes]) -> None:
        super().__init__()
        self._fd, self._lent = fd, lent
        self._at = self._end = 0
        self._buffer: memoryview | None = None  # small writes, gathered: allocated once, at the first
        self._filled = 0  # bytes of it in use
        self._buffer_at = 0  # the file offset of its first byte
        self._expect: Any = None  # the tensor whose bytes torch.save is about to write
        self._awaiting: source.LentBytes | None = None  # lent, if its data descriptor comes next

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._at

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        self._settle()
        self._at = {os.SEEK_SET: 0, os.SEEK_CUR: self._at, os.SEEK_END: self._end}[whence] + offset
        return self._at

    def lend(self, tensor: Any) -> None:
        """The next write of ``tensor``'s whole memory (a contiguous CPU tensor whose storage it
        fills) stays in the tensor."""
        self._expect = tensor if tensor.nbytes else None

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        n = len(view)
        if self._awaiting is not None:
            self._settle(view)
        tensor = self._expect
        if tensor is not None and n == tensor.nbytes and _address(view) == tensor.data_ptr():
            self._flush()
            import torch  # the caller's: a tensor is being saved

            own = memoryview(tensor.detach().reshape(-1).view(torch.uint8).numpy()).cast("B")
            self._awaiting = source.LentBytes(self._at, own, xxhash.xxh3_128_digest(view), tensor)
            self._expect = None
        else:
            self._gather(view)
        self._at += n
        self._end = max(self._end, self._at)
        return n

    def _settle(self, following: memoryview | None = None) -> None:
        """The lent range awaiting its data descriptor: lent if ``following`` is one, else
        written into the file after all."""
        lent, self._awaiting = self._awaiting, None
        if lent is None:
            return
        if following is not None and len(following) in _DESCRIPTOR_SIZES and following[:4] == _DESCRIPTOR:
            self._lent.append(lent)
        else:
            self._put(lent.data, lent.offset)

    def _gather(self, view: memoryview) -> None:
        """``view``, to be written at the current offset: into the buffer, or straight to the file
        when it would not fit an empty one."""
        if self._filled and (self._buffer_at + self._filled != self._at or self._filled + len(view) > _BUFFER):
            self._flush()
        if len(view) > _BUFFER:
            self._put(view, self._at)
            return
        if self._buffer is None:  # reused memory: a buffer allocated each save fragmented the heap
            self._buffer = private_copy_buffer(_BUFFER)
        if not self._filled:
            self._buffer_at = self._at
        self._buffer[self._filled : self._filled + len(view)] = view
        self._filled += len(view)

    def _flush(self) -> None:
        if self._filled and self._buffer is not None:
            self._put(self._buffer[: self._filled], self._buffer_at)
            self._filled = 0

    def _put(self, data: memoryview, offset: int) -> None:
        done = 0
        while done < len(data):
            done += os.pwrite(self._fd, data[done:], offset + done)

    def close(self) -> None:
        if not self.closed:
            self._settle()
            self._flush()
            self._expect = self._buffer = None
            if os.fstat(self._fd).st_size < self._end:  # a hole at the very end
                os.ftruncate(self._fd, self._end)
        super().close()


def _address(view: memoryview) -> int:
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data) if len(view) else 0


@dataclass
class MemoryFolder:
    """Named memory files that a commit reads as the folder ``tag`` (``step-N``), with the DCP
    metadata that cuts its ``.distcp`` files when no ``.metadata`` file is among them."""

    tag: str
    step: int
    kind: str = DCP_FOLDER
    files: dict[str, MemoryFile] = field(default_factory=dict)
    dcp_metadata: Any = None  # formats/dcp.DcpMetadata

    def add(self, name: str) -> MemoryFile:
        self.files[name] = MemoryFile(name)
        return self.files[name]

    def layout(self) -> CheckpointLayout:
        rel = {name: f"{self.tag}/{name}" for name in sorted(self.files)}
        return CheckpointLayout(
            MEMORY_ROOT,
            self.kind,
            self.step,
            self.tag,
            list(rel.values()),
            memory={rel[name]: f.path for name, f in self.files.items()},
            dcp_metadata=self.dcp_metadata,
        )

    def close(self) -> None:
        for f in self.files.values():
            f.close()

    def __enter__(self) -> MemoryFolder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
