"""The one way to read an atom back: decode its blob, or rebuild a derived weight from its
FP32 master, and check the hash either way.

Checkout, verify, diff, the adaptive policy and export all read atoms through here, so no
reader can skip the hash check or rebuild a weight differently from the others.
"""

from __future__ import annotations

from . import codec
from .atoms import MASTER
from .errors import CorruptStoreError
from .rounding import ROUND_FROM_MASTER, round_into
from .store.records import AtomRecord, BlobRecord
from .store.repo import Repository


def blob_of(store: Repository, digest: str, where: str) -> BlobRecord:
    """The blob's row, or a damaged-store error naming where it was needed."""
    row = store.blob(digest)
    if row is None:
        raise CorruptStoreError(f"{where}: blob {digest} has no row in the index; run `tailor verify`.")
    return row


def decode_stored_atom(store: Repository, row: BlobRecord, dest: memoryview, where: str) -> None:
    """Fill ``dest`` with a stored (not derived) atom's blob, its row already looked up; hash-checked.

    Touches no SQL, so a reader thread can run it while the caller's thread holds the index.
    """
    if row.raw_size != len(dest):
        raise CorruptStoreError(f"{where}: blob {row.hash} holds {row.raw_size} bytes, the atom needs {len(dest)}")
    store.read_blob_into(row, dest, where)


def decode_atom_into(store: Repository, manifest: int, atom: AtomRecord, dest: memoryview, where: str) -> None:
    """Fill ``dest`` with one atom's bytes, from its blob or rebuilt from its master; hash-checked."""
    if atom.derived is None:
        decode_stored_atom(store, blob_of(store, atom.blob, where), dest, where)
        return
    if atom.derived != ROUND_FROM_MASTER:
        raise CorruptStoreError(f"{where}: unknown derivation {atom.derived!r}; upgrade tailorstore")
    pieces = store.index.atoms(manifest, param=atom.param, kind=MASTER, derived=False)
    unique = {(p.start, p.numel): p for p in pieces}
    master = memoryview(bytearray(4 * atom.numel))
    cursor = 0
    for (start, numel), piece in sorted(unique.items()):
        if start != cursor:
            break
        decode_atom_into(store, manifest, piece, master[4 * start : 4 * (start + numel)], where)
        cursor += numel
    if cursor != atom.numel:
        raise CorruptStoreError(f"{where}: the FP32 master of {atom.param} is incomplete; cannot rebuild its weight")
    if len(dest) != 2 * atom.numel:
        raise CorruptStoreError(f"{where}: {atom.numel} {atom.dtype} elements cannot fill {len(dest)} bytes")
    round_into(master, atom.dtype, dest)
    if codec.content_hash(dest) != atom.blob:
        raise CorruptStoreError(f"{where}: the weight rebuilt from the master of {atom.param} does not match its hash")


def decode_atom(store: Repository, manifest: int, atom: AtomRecord, where: str) -> memoryview:
    """One atom's raw bytes (``atom.nbytes`` of them), checked."""
    out = memoryview(bytearray(atom.nbytes))
    decode_atom_into(store, manifest, atom, out, where)
    return out


def rebuilt_weight(store: Repository, manifest: int, param: str, where: str) -> memoryview:
    """The bytes of a derived weight, rebuilt from its masters and checked."""
    derived = store.index.atoms(manifest, param=param, derived=True)
    if not derived:
        raise CorruptStoreError(f"{where}: {param} has no derived weight to rebuild")
    return decode_atom(store, manifest, derived[0], f"{where}, {param}")
