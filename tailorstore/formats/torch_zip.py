"""Where a torch zip checkpoint keeps each tensor's bytes, and mending its CRCs.

``torch.save`` writes a zip archive of stored (uncompressed) records: the pickle, a few
small records and one ``data/KEY`` record per storage, each holding the storage's raw
bytes. Knowing the file offset of every tensor lets a commit keep the file's other bytes
verbatim (its *container*) and checkout write the file back byte for byte, tensors
straight from the store into place, without unpickling or pickling anything.

A composite or merged checkpoint puts other steps' tensor bytes into one step's container;
the zip's CRC-32 fields then describe the old bytes, so :func:`mend_crcs` recomputes them.
"""

from __future__ import annotations

import io
import os
import struct
import zipfile
import zlib
from pathlib import Path
from typing import Any

from tailorstore.core.atom_types import TensorEntry
from tailorstore.core.errors import BadCheckpointError

_LOCAL = struct.Struct("<IHHHHHIIIHH")  # local file header, 30 bytes
_LOCAL_SIG = 0x04034B50
_CENTRAL_SIG = 0x02014B50
_DESCRIPTOR_SIG = 0x08074B50
_CRC_BLOCK = 8 << 20


class Window(io.RawIOBase):
    """``length`` bytes of an open file from ``base`` on, as a file of their own: a DCP ``.distcp``
    file is torch.save zips back to back, and ``zipfile`` reads one of them through this."""

    def __init__(self, fd: int, base: int = 0, length: int | None = None) -> None:
        super().__init__()
        self.fd, self.base = fd, base
        self.length = os.fstat(fd).st_size - base if length is None else length
        self.at = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self.fd

    def tell(self) -> int:
        return self.at

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        start = {os.SEEK_SET: 0, os.SEEK_CUR: self.at, os.SEEK_END: self.length}[whence]
        self.at = max(0, start + offset)
        return self.at

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        want = max(0, min(len(view), self.length - self.at))
        data = os.pread(self.fd, want, self.base + self.at) if want else b""
        view[: len(data)] = data
        self.at += len(data)
        return len(data)

    def pread(self, size: int, offset: int) -> bytes:
        """Bytes at ``offset`` within the window, never past its end."""
        size = max(0, min(size, self.length - offset))
        return os.pread(self.fd, size, self.base + offset) if size else b""


class BytesWindow(Window):
    """A torch.save zip held in memory (an object item read back from the store), read as
    :class:`Window` reads one from a file."""

    def __init__(self, data: bytes) -> None:
        io.RawIOBase.__init__(self)
        self.fd, self.base, self.length, self.at = -1, 0, len(data), 0
        self.data = memoryview(data)

    def fileno(self) -> int:
        raise OSError("an in-memory zip has no descriptor")

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        got = self.data[self.at : self.at + len(view)]
        view[: len(got)] = got
        self.at += len(got)
        return len(got)

    def pread(self, size: int, offset: int) -> bytes:
        return bytes(self.data[offset : offset + max(0, size)]) if offset >= 0 else b""


def _data_offset(f: Window, info: zipfile.ZipInfo, where: str) -> int:
    """The offset of a record's bytes: after its local header, whose name and extra lengths
    may differ from the central directory's (torch pads the extra field to align data)."""
    header = f.pread(_LOCAL.size, info.header_offset)
    if len(header) != _LOCAL.size or _LOCAL.unpack(header)[0] != _LOCAL_SIG:
        raise BadCheckpointError(f"{where}: zip record {info.filename} has no local header; the file is damaged")
    fields = _LOCAL.unpack(header)
    return info.header_offset + _LOCAL.size + fields[9] + fields[10]


def record_offsets(path: Path | int, base: int = 0, length: int | None = None) -> dict[str, tuple[int, int]]:
    """Record name -> (offset of its bytes, size), for every record of a stored torch zip (a path,
    or a file descriptor open for reading); with ``base`` and ``length``, of the zip that fills
    that range of the file, offsets counted from ``base``."""
    fd = path if isinstance(path, int) else os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        with Window(fd, base, length) as f:
            return window_records(f, str(path))
    finally:
        if not isinstance(path, int):
            os.close(fd)


def window_records(f: Window, where: str) -> dict[str, tuple[int, int]]:
    """:func:`record_offsets` of the zip that fills a window (of a file, or of bytes in memory)."""
    out: dict[str, tuple[int, int]] = {}
    with zipfile.ZipFile(f) as z:
        for info in z.infolist():
            if info.compress_type != zipfile.ZIP_STORED:
                return {}  # not written by torch.save; no container
            offset = _data_offset(f, info, where)
            if offset + info.file_size > f.length:
                raise zipfile.BadZipFile(f"record {info.filename} reaches past the end of the zip")
            out[info.filename] = (offset, info.file_size)
    return out


def locate_tensors(path: Path, entries: list[TensorEntry]) -> bool:
    """Set ``file_offset`` on every entry of a file loaded with ``torch.load(mmap=True)``.

    torch maps the whole file and makes each storage a slice of that mapping at its record's
    offset, so storage addresses minus the mapping's base are record offsets. The base is
    not exposed; it is found from the lowest storage and then *checked* for every storage
    (offset and size must name a data record). Returns False, leaving the offsets unset,
    when anything does not fit (a non-contiguous tensor, a storage not from the file);
    such a file is checked out by re-pickling its skeleton instead.
    """
    live = [e for e in entries if e.tensor.numel() > 0]
    if not live:
        return True
    if any(not e.tensor.is_contiguous() for e in live):
        return False
    records = record_offsets(path)
    data = {off: size for name, (off, size) in records.items() if "/data/" in name and size > 0}
    if not data:
        return False
    storages = {}
    for e in live:
        storage = e.tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    base = min(storages) - min(data)
    if any(data.get(ptr - base) != nbytes for ptr, nbytes in storages.items()):
        return False
    for e in live:
        start = e.tensor.untyped_storage().data_ptr() - base
        e.file_offset = start + e.tensor.storage_offset() * e.tensor.element_size()
    return True


def gaps(size: int, ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The (offset, length) runs of ``[0, size)`` that no (offset, length) range covers."""
    out: list[tuple[int, int]] = []
    cursor = 0
    for offset, length in sorted(ranges):
        if offset > cursor:
            out.append((cursor, offset - cursor))
        cursor = max(cursor, offset + length)
    if cursor < size:
        out.append((cursor, size - cursor))
    return out


def mend_crcs(fd: int, path: str, records: set[str] | None = None, base: int = 0, length: int | None = None) -> None:
    """Recompute each record's CRC-32 (every record's, or those ``records`` names) from the bytes
    now in the file and write it where zip keeps it: the central directory, and the data
    descriptor (torch sets flag bit 3) or else the local header. ``base`` and ``length`` name
    the zip that fills that range of the file (one item of a DCP ``.distcp`` file)."""
    with Window(fd, base, length) as f, zipfile.ZipFile(f) as z:
        infos = z.infolist()
        central = z.start_dir  # type: ignore[attr-defined]
        for info in infos:
            head = f.pread(46, central)
            if len(head) != 46 or struct.unpack_from("<I", head)[0] != _CENTRAL_SIG:
                raise BadCheckpointError(f"{path}: the zip central directory does not parse")
            entry = central
            n, m, k = struct.unpack_from("<HHH", head, 28)
            central += 46 + n + m + k
            if records is not None and info.filename not in records:
                continue
            data = _data_offset(f, info, path)
            crc = 0
            for at in range(data, data + info.file_size, _CRC_BLOCK):
                crc = zlib.crc32(f.pread(min(_CRC_BLOCK, data + info.file_size - at), at), crc)
            packed = struct.pack("<I", crc)
            if info.flag_bits & 0x08:
                after = data + info.compress_size
                sig = f.pread(4, after)
                os.pwrite(fd, packed, base + after + (4 if struct.unpack("<I", sig)[0] == _DESCRIPTOR_SIG else 0))
            else:
                os.pwrite(fd, packed, base + info.header_offset + 14)
            os.pwrite(fd, packed, base + entry + 16)
