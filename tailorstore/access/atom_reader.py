"""The one way to read an atom back: decode its blob, or rebuild a derived weight from its
FP32 master, and check the hash either way.

Checkout, verify, diff, the adaptive policy and export all read atoms through here, so no
reader can skip the hash check or rebuild a weight differently from the others.
"""

from __future__ import annotations

from collections.abc import Iterator

import xxhash

from tailorstore.access.contents import Contents
from tailorstore.core.atom_types import MASTER
from tailorstore.core.errors import Call, CorruptStoreError
from tailorstore.core.records import AtomRecord, BlobRecord
from tailorstore.core.rounding import ROUND_FROM_MASTER, rounded_chunks
from tailorstore.core.thread_buffers import thread_buffer
from tailorstore.store import codec
from tailorstore.store.repo import BlobReader, StepReader, damaged_blob


def blob_of(repo: BlobReader, digest: str, where: str) -> BlobRecord:
    """The blob's row, or a damaged-store error naming where it was needed."""
    row = repo.blob(digest)
    if row is None:
        raise CorruptStoreError(f"{where}: blob {digest} has no row in the index; run ", Call("verify"), ".")
    return row


def decode_stored_atom(repo: BlobReader, row: BlobRecord, dest: memoryview, where: str) -> None:
    """Fill ``dest`` with a stored (not derived) atom's blob, its row already looked up; hash-checked.

    Touches no SQL, so a reader thread can run it while the caller's thread holds the index.
    """
    if row.raw_size != len(dest):
        raise CorruptStoreError(f"{where}: blob {row.hash} holds {row.raw_size} bytes, the atom needs {len(dest)}")
    repo.read_blob_into(row, dest, where)


def _chunk_space(nbytes: int) -> memoryview:
    """This thread's reused decode buffer (one chunk): streaming never allocates per chunk."""
    return memoryview(thread_buffer("atom-chunk", nbytes, codec.GROUP_CHUNK))


def stream_blob(repo: BlobReader, row: BlobRecord, lo: int, hi: int, where: str) -> Iterator[memoryview]:
    """Bytes ``[lo, hi)`` of a stored blob, decoded chunk by chunk into one reused buffer.

    The whole blob is decoded and hashed even when only part of it is wanted, and the check
    comes after the last chunk: a caller writes what it yields into a staged output that an
    error discards (checkout, export, universal, reshard), so memory stays at one chunk and no
    unchecked byte is ever published. Each yielded view is valid until the next one.
    """
    if not 0 <= lo <= hi <= row.raw_size:
        raise CorruptStoreError(f"{where}: bytes [{lo}, {hi}) lie outside blob {row.hash} of {row.raw_size} bytes")
    hasher = xxhash.xxh3_128()
    pos = 0
    for piece in repo.decoded_pieces(row, row.raw_size, _chunk_space, where):
        hasher.update(piece)
        a, b = max(lo - pos, 0), min(hi - pos, len(piece))
        if a < b:
            yield piece[a:b]
        pos += len(piece)
    if hasher.hexdigest() != row.hash:
        raise damaged_blob(where, row.hash)


def stream_atom(
    repo: StepReader, manifest: int, atom: AtomRecord, lo: int, hi: int, where: str, row: BlobRecord | None = None
) -> Iterator[memoryview]:
    """Bytes ``[lo, hi)`` of one atom, checked: a stored atom's blob (:func:`stream_blob`), or a
    derived weight rounded from its master as the master streams by (:func:`stream_rebuilt`)."""
    if atom.derived is None:
        yield from stream_blob(repo, row or blob_of(repo, atom.blob, where), lo, hi, where)
        return
    pos = 0
    for piece in stream_rebuilt(repo, manifest, atom, where):
        a, b = max(lo - pos, 0), min(hi - pos, len(piece))
        if a < b:
            yield piece[a:b]
        pos += len(piece)


def stream_rebuilt(repo: StepReader, manifest: int, atom: AtomRecord, where: str) -> Iterator[memoryview]:
    """A derived weight's bytes in order, each master chunk rounded as it is decoded; the
    weight's own hash is checked after the last chunk (so, as with :func:`stream_blob`, what
    is yielded goes into staged output). Memory stays at a chunk whatever the tensor's size."""
    if atom.derived != ROUND_FROM_MASTER:
        raise CorruptStoreError(f"{where}: unknown derivation {atom.derived!r}; upgrade tailorstore")
    if atom.start != 0:
        raise CorruptStoreError(f"{where}: the derived weight of {atom.param} does not start at its first element")
    pieces = repo.view(Contents).atoms(manifest, param=atom.param, kind=MASTER, derived=False)
    unique = sorted({(p.start, p.numel): p for p in pieces}.items())
    hasher = xxhash.xxh3_128()
    cursor = 0
    for (start, numel), piece in unique:
        if start != cursor or start + numel > atom.numel:
            break
        for rounded in rounded_chunks(
            stream_atom(repo, manifest, piece, 0, piece.nbytes, where), atom.dtype, "rebuilt"
        ):
            hasher.update(rounded)
            yield rounded
        cursor += numel
    if cursor != atom.numel:
        raise CorruptStoreError(f"{where}: the FP32 master of {atom.param} is incomplete; cannot rebuild its weight")
    if hasher.hexdigest() != atom.blob:
        raise CorruptStoreError(f"{where}: the weight rebuilt from the master of {atom.param} does not match its hash")


def decode_atom_into(repo: StepReader, manifest: int, atom: AtomRecord, dest: memoryview, where: str) -> None:
    """Fill ``dest`` with one atom's bytes, from its blob or rebuilt from its master; hash-checked."""
    if atom.derived is None:
        decode_stored_atom(repo, blob_of(repo, atom.blob, where), dest, where)
        return
    if len(dest) != 2 * atom.numel:
        raise CorruptStoreError(f"{where}: {atom.numel} {atom.dtype} elements cannot fill {len(dest)} bytes")
    pos = 0
    for piece in stream_rebuilt(repo, manifest, atom, where):
        dest[pos : pos + len(piece)] = piece
        pos += len(piece)


def decode_atom(repo: StepReader, manifest: int, atom: AtomRecord, where: str) -> memoryview:
    """One atom's raw bytes (``atom.nbytes`` of them), checked."""
    out = memoryview(bytearray(atom.nbytes))
    decode_atom_into(repo, manifest, atom, out, where)
    return out
