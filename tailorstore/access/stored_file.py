"""A committed file read back as a seekable stream, its atoms decoded where they are read.

A resume needs each rank's files as objects in memory, not as files on disk. Written into a
staging folder and read back, every byte crosses fresh memory twice (the staging pages, then the
tensors); DeepSpeed's own load from its save crosses it once. ``torch.load`` reads a storage
record with one ``readinto`` of the record's whole length straight into the storage it allocated,
so a file object that decodes the record's atoms inside ``readinto`` puts each byte into the
tensor's memory directly: one pass, as the raw load, plus the decoding.

The stream is the file as checkout would write it (placement.py): the container's bytes in the
gaps between the atoms, each atom at its recorded offset. Every atom is read through
:func:`stream_atom`, so its blob is hash-checked (a derived weight rebuilt from its master and
checked) before the read that asked for it returns; a damaged blob fails the load.
"""

from __future__ import annotations

import io
from bisect import bisect_right
from dataclasses import dataclass

from tailorstore.access.atom_reader import stream_atom
from tailorstore.core.errors import CorruptStoreError
from tailorstore.formats.torch_zip import gaps
from tailorstore.store.records import AtomRecord, FileRecord
from tailorstore.store.repo import Repository


@dataclass(frozen=True)
class _Span:
    start: int  # offset in the file
    length: int
    atom: AtomRecord | None  # None: bytes of the container, from ``literal``
    literal: int = 0  # where they start in the container


class StoredFile(io.RawIOBase):
    """One file of a manifest, readable and seekable like the file checkout would write."""

    def __init__(self, store: Repository, manifest: int, row: FileRecord, where: str) -> None:
        super().__init__()
        if row.container is None:
            raise CorruptStoreError(f"{where}: has no container; it cannot be read in place")
        self.store, self.manifest, self.where, self.size = store, manifest, where, row.raw_size
        atoms = sorted(store.catalogue.atoms(manifest, path=row.path), key=lambda a: a.file_offset or 0)
        self.container = store.read_blob(row.container, f"{where} (container)")
        spans = [_Span(a.file_offset or 0, a.nbytes, a) for a in atoms if a.file_offset is not None]
        at = 0
        for offset, length in gaps(row.raw_size, [(s.start, s.length) for s in spans]):
            spans.append(_Span(offset, length, None, at))
            at += length
        if at != len(self.container) or any(s.start + s.length > row.raw_size for s in spans):
            raise CorruptStoreError(f"{where}: the container and the atoms do not tile the file; the index is damaged")
        self.spans = sorted(spans, key=lambda s: s.start)
        self.starts = [s.start for s in self.spans]
        for before, after in zip(self.spans, self.spans[1:], strict=False):
            if before.start + before.length > after.start:
                raise CorruptStoreError(f"{where}: atoms overlap at byte {after.start}; the index is damaged")
        self.pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.size}[whence]
        self.pos = max(0, base + offset)
        return self.pos

    def readinto(self, buffer: memoryview | bytearray) -> int:  # type: ignore[override]
        dest = memoryview(buffer).cast("B")
        want = min(len(dest), max(0, self.size - self.pos))
        done = 0
        while done < want:
            span = self.spans[bisect_right(self.starts, self.pos) - 1]
            lo = self.pos - span.start
            hi = min(span.length, lo + want - done)
            if span.atom is None:
                dest[done : done + hi - lo] = self.container[span.literal + lo : span.literal + hi]
            else:
                filled = done
                for piece in stream_atom(self.store, self.manifest, span.atom, lo, hi, self.where):
                    dest[filled : filled + len(piece)] = piece
                    filled += len(piece)
                if filled != done + hi - lo:
                    raise CorruptStoreError(f"{self.where}: an atom gave {filled - done} bytes, not {hi - lo}")
            done += hi - lo
            self.pos += hi - lo
        return done
