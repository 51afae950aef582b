"""What a backend holds, from one listing: the size of every loose blob and every pack.

``verify`` and ``gc`` look at every object of the store. Asked one object at a time, each size
is a HEAD request on an object store (thousands for a store of a few hundred saves, each a
round trip); the listing carries the sizes, at one request per 1,000 keys. On a local disk it
costs what the listing for orphans already cost, plus a stat per file.
"""

from __future__ import annotations

from dataclasses import dataclass

from tailorstore.core.object_keys import BLOB_PREFIX, PACK_PREFIX, blob_name, pack_name
from tailorstore.core.records import BlobRecord
from tailorstore.store.backends.base import Backend

LIST_PAGE = 1000  # keys in one page of an S3 listing


def stored_part(row: BlobRecord, object_size: int) -> int:
    """How many of the blob's stored bytes an object of ``object_size`` bytes holds: all of
    ``stored_size`` when intact, fewer when the object (a pack) was cut short."""
    if row.pack is None:
        return object_size
    return max(0, min(row.stored_size, object_size - (row.pack_offset or 0)))


@dataclass(frozen=True)
class Holdings:
    blobs: dict[str, int]  # loose blob name -> bytes of its object
    packs: dict[str, int]  # pack name -> bytes of its object

    @classmethod
    def of(cls, backend: Backend) -> Holdings:
        """One listing of ``blobs/`` and one of ``packs/``; foreign keys there are left out."""
        blobs = {name: size for key, size in backend.sizes(BLOB_PREFIX) if (name := blob_name(key))}
        packs = {name: size for key, size in backend.sizes(PACK_PREFIX) if (name := pack_name(key))}
        return cls(blobs, packs)

    def stored_bytes(self, row: BlobRecord) -> int | None:
        """:func:`stored_part` of the row's object, or None when the listing did not hold it."""
        size = self.blobs.get(row.hash) if row.pack is None else self.packs.get(row.pack)
        return None if size is None else stored_part(row, size)
