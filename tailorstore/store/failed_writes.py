"""What a store write that fails leaves behind: nothing that is not recorded.

A commit, an average and a thinning all write blobs before they record anything, so a failed
one must take its blobs back. Not the commit's own module: checkout, export and conversions
refuse thinned steps through :mod:`thinning`, which needs this, and must not import the whole
commit machinery for it. Beside publication, not in packs/: it reads the repository, the parts
and the manifest keys, which the pack format and the blob writer know nothing of.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from tailorstore.core.object_keys import blob_key
from tailorstore.core.progress import Progress
from tailorstore.store import parts
from tailorstore.store.lease import LeaseHandle
from tailorstore.store.lock import LockHandle
from tailorstore.store.manifests.keys import current_of, listed_manifest_keys
from tailorstore.store.packs.pack import pack_key
from tailorstore.store.packs.writer import BlobWriter
from tailorstore.store.repo import Repository


@contextmanager
def cleaned_up_on_failure(
    repo: Repository, writer: BlobWriter, lock: LockHandle | LeaseHandle, progress: Progress
) -> Iterator[None]:
    """A failure leaves no temp files, and, when this commit is alone on the store, no blobs
    that nothing records."""
    try:
        yield
    except BaseException:
        writer.abort()
        if lock.try_exclusive():
            remove_unindexed(repo, writer, lock)
        raise
    finally:
        progress.close()


def remove_unindexed(repo: Repository, writer: BlobWriter, lock: LockHandle | LeaseHandle) -> None:
    """After a failed commit, alone on the store: delete the blobs it wrote that nothing indexes
    (a part of another host may hold the same blob without this index knowing).

    Nothing is deleted while the backend holds a manifest this index has not imported: another
    host's commit that ran while this one was stalled may have found this commit's pack (listed,
    not yet recorded) and named its blobs. Deleting by this host's older view deleted that step's
    blobs (found by the simulation's soak, seed 321 on S3); gc, which syncs first, takes them if
    they are orphans. (Listing, not syncing: the failure being handled may be a full disk under the
    index, which a sync would meet again.)"""
    try:
        known = {m.object_key for m in repo._index.manifests()}
        listed = current_of(listed_manifest_keys(repo.backend))
    except Exception:
        return
    if set(listed.values()) - known:
        return
    held = {h for part in parts.read_parts(repo.backend) for h in part.blob_hashes()}
    loose = [blob_key(d) for d in writer.written() if repo.blob(d) is None and d not in held]
    packed = [pack_key(name) for name in writer.written_packs() if not repo._index.has_pack(name)]
    repo.backend.delete_many([*loose, *packed], fence=lambda: lock.check("taking back a failed commit's blobs"))
