"""Bringing the index's pack rows and blob locations in line with the packs the backend holds.

The packs' trailers are the truth about where a blob is, but a listing of ``packs/`` is only a
moment. A gc on this host or another may be repacking: its new pack is written, the index is
pointed at it, and only then is the old pack deleted. A process that lists in that window sees
both packs, or the old one and not the new. Taking the old pack's trailer as the truth then
points live blobs at a pack about to vanish, and drops the row of the new pack that really
holds them; the next gc finds the new pack with no rows and deletes the only copy. (Measured
here: a training run committing every few seconds while ``tailor gc --thin`` ran beside it lost
16 blobs this way, through the unlocked sync that opens each background commit's store.)

Three rules keep a listing from doing harm:

- **Locked** (the caller holds the store lock, shared or exclusive, so no gc is between its
  steps): reconcile fully. Rows of packs that are gone are dropped, every entry of a pack the
  index does not know is taken, and rows that still name a gone pack are placed again from the
  trailers of the packs that hold them. gc plans only after such a sync.
- **Unlocked** (opening a store to read): no pack row is dropped and no blob is moved away from
  a pack that is listed. Rows naming a pack that is not listed (another host's gc moved them)
  are placed again, into a listed pack whose trailer holds them, and a listed pack that rows
  name (a manifest imported from another host) gets its ``packs`` row. A listed pack that a gc
  is about to delete never wins over the one the index names, since the index names a pack that
  still exists.
- **Never moved from a place that stands**: a pack the index does not know gives rows only to
  blobs the index has no standing place for, so a planted pack whose trailer lies cannot take
  over another pack's blobs (:func:`_unplaced`).
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor

from tailorstore.core.errors import CorruptStoreError
from tailorstore.core.object_keys import blob_key, pack_key
from tailorstore.core.records import BlobRecord
from tailorstore.store.backends.base import Backend
from tailorstore.store.index._index import Index
from tailorstore.store.packs.pack import PackEntry, read_trailer

TRAILER_READERS = 16  # trailers read at once: requests that wait on the network

log = logging.getLogger("tailorstore")


def packs_agree(index: Index, listed: set[str], *, locked: bool) -> bool:
    """Whether the index's packs agree with ``listed`` as far as a sync of this kind would change."""
    named = index.packs_named_by_blobs()
    known = set(index.packs())
    return named <= listed and (known == listed if locked else named <= known)


def _unplaced(backend: Backend, index: Index, digest: str, listed: set[str]) -> bool:
    """Whether a pack's trailer may say where this blob is: only when the index has no place for
    it that still stands. A trailer is input from whoever could write the bucket, and a pack's
    name is the hash of its bytes only if someone reads them all, so a pack planted under any name
    with a trailer naming another pack's blobs must not move their rows (gc would then delete the
    real pack as empty). A blob in a listed pack, or whose loose object exists, stays where it is.
    A row that says loose where no loose object is came from a manifest object that lied (attack
    finding 3: imported first, its rows kept the real pack from placing them); the trailer wins."""
    row = index.blob(digest)
    if row is None:
        return True
    if row.pack is None:  # one HEAD, only for a blob a new pack holds and a row calls loose: never, in use
        return not backend.exists(blob_key(digest))
    return row.pack not in listed


def reconcile_packs(
    backend: Backend, index: Index, listed: set[str], *, locked: bool, skip_damaged: bool = False
) -> None:
    """Inside the caller's index transaction: the rules of the module docstring. With
    ``skip_damaged``, a pack whose trailer cannot be read gives no rows (a warning names it)."""
    trailers: dict[str, tuple[int, list[PackEntry]] | None] = {}
    fetched: dict[str, tuple[int, list[PackEntry]] | BaseException] = {}

    def fetch(name: str) -> tuple[int, list[PackEntry]] | BaseException:
        try:
            return read_trailer(backend, name)
        except (FileNotFoundError, CorruptStoreError) as exc:
            return exc

    def trailer(name: str) -> tuple[int, list[PackEntry]] | None:
        if name not in trailers:
            read = fetched.pop(name) if name in fetched else fetch(name)
            if isinstance(read, FileNotFoundError):  # deleted since the listing: treated as never listed
                trailers[name] = None
            elif isinstance(read, CorruptStoreError):
                if not skip_damaged:
                    raise read
                log.warning("tailorstore: %s; its blobs are left out of the index", read)
                trailers[name] = None
            else:
                trailers[name] = read
        return trailers[name]

    def place(name: str, size: int, entries: list[PackEntry]) -> None:
        index.add_packs([(name, size)])
        index.upsert_blobs(
            BlobRecord(e.hash, e.raw_size, e.stored_size, e.codec, name, e.offset, time.time()) for e in entries
        )

    if locked:
        known = set(index.packs())
        index.delete_packs(known - listed)
        new = sorted(listed - known)
        if len(new) > 1:  # each trailer is a round trip: many hosts' new packs are read at once
            with ThreadPoolExecutor(min(TRAILER_READERS, len(new)), thread_name_prefix="tailor-packs") as pool:
                fetched.update(zip(new, pool.map(fetch, new), strict=True))
        for name in new:
            if (read := trailer(name)) is not None:
                place(name, read[0], [e for e in read[1] if _unplaced(backend, index, e.hash, listed)])
    lost = {b.hash for b in index.blobs_packed_outside(listed)}
    for name in sorted(listed):
        if not lost:
            break
        if (read := trailer(name)) is None:
            continue
        found = [e for e in read[1] if e.hash in lost]
        if found:
            place(name, read[0], found)
            lost -= {e.hash for e in found}
    # What no listed pack holds stays as it is: the blob is missing, and verify says where it was used.
    for name in sorted((index.packs_named_by_blobs() & listed) - set(index.packs())):
        try:  # a pack never changes (its name is its hash), so the row a manifest gave is right
            index.add_packs([(name, backend.size(pack_key(name)))])
        except FileNotFoundError:
            continue
