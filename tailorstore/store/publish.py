"""Recording a manifest: the one way every operation makes a step (or a merge) visible.

Commit, finalize, merge and averaging each end the same way, and used to write it four times,
with two of the copies forgetting the last rule below (a merge or finalize reported as failed
came back at the next open). Here, once:

1. inside one index transaction, the caller inserts the manifest's rows;
2. still inside it, the manifest object is published create-only, after the lease is checked
   (store/lease.py, fencing): this put is the commit point;
3. ``COMMIT``. Should it fail after the put (a full disk under SQLite, a damaged index), the
   object is deleted again, so nothing the caller reports as failed reappears when the next
   open syncs manifest objects into an index (docs/FORMAT.md, section 8);
4. a full disk at any of these steps is said as such (``writer.disk_full``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from tailorstore.store import manifest_objects
from tailorstore.store.catalogue import CatalogueEdit
from tailorstore.store.lock import Fence
from tailorstore.store.posix import is_out_of_space
from tailorstore.store.repo import Repository
from tailorstore.store.writer import disk_full


@dataclass(frozen=True)
class Recorded:
    manifest: int  # this index's row id
    key: str  # the manifest object's key: its name on every host


def record_manifest(
    store: Repository, rows: Callable[[CatalogueEdit], int], *, fence: Fence | None, replacing: bool = False
) -> Recorded:
    """Insert the rows ``rows`` writes (returning the new manifest's id) and publish the manifest,
    as one step that either happens whole or leaves the store as it was. ``replacing`` takes the
    next version of a step that exists (``force``); otherwise an existing step is refused."""
    published: str | None = None
    try:
        with store._index.transaction() as index:
            manifest = rows(index)
            published = manifest_objects.publish(store.backend, index, manifest, fence=fence, replacing=replacing)
    except OSError as exc:
        _take_back(store, published)
        if is_out_of_space(exc):
            raise disk_full(store.location) from None
        raise
    except BaseException:
        _take_back(store, published)
        raise
    return Recorded(manifest, published)


def _take_back(store: Repository, published: str | None) -> None:
    if published is not None:  # the object went up but the index refused it
        manifest_objects.unpublish(store.backend, [published])
