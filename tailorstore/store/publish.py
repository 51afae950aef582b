"""Recording a manifest: the one way every operation makes a step (or a merge) visible.

Commit, finalize, merge and averaging each end the same way, and used to write it four times,
with two of the copies forgetting the last rule below (a merge or finalize reported as failed
came back at the next open). Here, once:

1. inside one index transaction, the caller inserts the manifest's rows;
2. still inside it, the manifest object is published create-only, after the lease is checked
   (store/lease.py, fencing): this put is the commit point. A host that loses the put to
   another has written nothing, and changes nothing (I3; attack finding 4);
3. on a store locked by leases, the blobs the manifest needs are checked against gc's notices and
   are still there (``gc_notices.check_publication``): a gc that deletes them meanwhile either
   sees this object or is seen here, whatever either host's stalls (FORMAT 8.1);
4. only then its tag and pin objects are written (a crash before them: the step's older
   version's refs still count for it, ``manifest_objects.current_of``);
5. ``COMMIT``. Should anything fail after the put (a ref's write, a full disk under SQLite,
   a damaged index), the object is deleted again, so nothing the caller reports as failed
   reappears when the next open syncs manifest objects into an index (docs/FORMAT.md,
   section 8), and ``restore_refs`` puts back the refs this publish moved, from the index as
   it stands after the rollback;
6. a full disk at any of these steps is said as such (``writer.disk_full``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from tailorstore.core.failpoints import failpoint
from tailorstore.store import manifest_objects
from tailorstore.store.backends.posix import is_out_of_space
from tailorstore.store.gc_notices import check_publication
from tailorstore.store.index.catalogue import CatalogueEdit
from tailorstore.store.lock import Fence
from tailorstore.store.packs.writer import disk_full
from tailorstore.store.repo import Repository


@dataclass(frozen=True)
class Recorded:
    manifest: int  # this index's row id
    key: str  # the manifest object's key: its name on every host


def record_manifest(
    store: Repository,
    rows: Callable[[CatalogueEdit], int],
    *,
    fence: Fence | None,
    replacing: bool = False,
    restore_refs: Callable[[], Iterable[int]] = lambda: (),
) -> Recorded:
    """Insert the rows ``rows`` writes (returning the new manifest's id) and publish the manifest,
    as one step that either happens whole or leaves the store as it was. ``replacing`` takes the
    next version of a step that exists (``force``); otherwise an existing step is refused.
    ``restore_refs`` names the manifests whose refs this one took over (the replaced version, the
    tag's former holder): their refs are written again should this publish be withdrawn."""
    published: str | None = None
    try:
        with store._index.transaction() as index:
            manifest = rows(index)
            published = manifest_objects.publish(store.backend, index, manifest, fence=fence, replacing=replacing)
            failpoint("after-publish")
            if fence is not None and fence.by_time:
                needs = index.referenced_blobs(manifest)
                check_publication(store.backend, needs, "recording the manifest", store.size_lookup(needs))
            manifest_objects.write_refs(store.backend, index, [manifest])
    except OSError as exc:
        _take_back(store, published, restore_refs)
        if is_out_of_space(exc):
            raise disk_full(store.location) from None
        raise
    except BaseException:
        _take_back(store, published, restore_refs)
        raise
    return Recorded(manifest, published)


def _take_back(store: Repository, published: str | None, restore_refs: Callable[[], Iterable[int]]) -> None:
    """Only an object this host published is withdrawn, and only then are refs touched: a host that
    lost the put never wrote any (attack finding 4)."""
    if published is None:
        return
    manifest_objects.unpublish(store.backend, [published])  # the object went up but the index refused it
    manifest_objects.write_refs(store.backend, store.catalogue, list(restore_refs()))
