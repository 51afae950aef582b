"""Naming and protecting manifests: ``tailor tag``/``untag``, ``tailor pin``/``unpin``, ``tailor rm``.

Tags and pins are what retention never drops. ``rm`` drops one manifest at once; the blobs
it alone used stay until ``tailor gc``, like git's unreachable objects. The tag and pin
objects in the backend are the truth (every host reads them); each change writes them
first and the index second, so an interrupted change is undone at the next open.
"""

from __future__ import annotations

from tailorstore.core.errors import Call, StepExistsError, StoreError
from tailorstore.store import manifest_objects
from tailorstore.store.repo import Repository

TAG_BYTES = 72  # escaped (=XX a byte outside [A-Za-z0-9._-]), with a temp file's suffix: under 255 bytes


def check_tag(tag: str) -> str:
    """A tag names an object key (``refs/tags/<tag>``) and a line of ``tailor log``: no separators,
    no control characters, not a path's ``.`` or ``..``, and not a number (``step=N`` is one)."""
    if (
        not tag
        or tag.isdigit()
        or tag in (".", "..")
        or tag != tag.strip()
        or any(c in "=/\\" or ord(c) < 32 or ord(c) == 127 or 0xD800 <= ord(c) < 0xE000 for c in tag)
        or len(tag.encode()) > TAG_BYTES  # after the surrogates (undecodable bytes of argv) are out
    ):
        raise StoreError(
            f"tag {tag!r} is not allowed: use up to {TAG_BYTES} bytes of letters, digits, '-', '_' or '.' "
            "(not only digits, not . or ..)."
        )
    return tag


def tag(store: Repository, selector: str, name: str, *, force: bool = False) -> int:
    check_tag(name)
    manifest = store.resolve(selector)
    with store.transaction() as index:
        holder = index.tagged(name)
        if holder and holder.id != manifest and not force:
            raise StepExistsError(
                f"tag {name!r} already names another manifest; pass ", Call(force=True), " to move it"
            )
        old = store.manifest(manifest).tag
        index.set_tag(manifest, name)  # takes the tag from any other holder
        if old and old != name:
            manifest_objects.drop_tag(store.backend, old)
        manifest_objects.write_refs(store.backend, index, [manifest])
    return manifest


def untag(store: Repository, name: str) -> int:
    """Remove a tag; the manifest stays (and becomes droppable by gc unless it is pinned)."""
    holder = store.catalogue.tagged(name)
    if holder is None:
        raise StoreError(f"nothing is tagged {name!r}; ", Call("log"), " shows the tags.")
    with store.transaction() as index:
        manifest_objects.drop_tag(store.backend, name)
        index.set_tag(holder.id, None)
    return holder.id


def pin(store: Repository, selector: str, pinned: bool = True) -> int:
    manifest = store.resolve(selector)
    with store.transaction() as index:
        index.set_pinned(manifest, pinned)
        manifest_objects.write_refs(store.backend, index, [manifest])
    return manifest


def remove(store: Repository, selector: str, *, force: bool = False) -> int:
    manifest = store.resolve(selector)
    record = store.manifest(manifest)
    if (record.pinned or record.tag) and not force:
        what = "pinned" if record.pinned else f"tagged {record.tag!r}"
        undo = Call("unpin", f"step={record.step}") if record.pinned else Call("untag", str(record.tag))
        raise StoreError(f"step {record.step} is {what}; ", undo, " first, or pass ", Call(force=True))
    heirs = [r.name for r in store.catalogue.created_runs().values() if r.base and r.base == record.object_key]
    if heirs and not force:
        raise StoreError(
            f"step {record.step} is the base of run(s) {', '.join(heirs)}; pass ",
            Call(force=True),
            " to remove it anyway",
        )
    with store.transaction() as index:
        if record.tag:  # the objects (manifest, tag, pin) go before the index rows
            manifest_objects.drop_tag(store.backend, record.tag)
        manifest_objects.unpublish(store.backend, [record.object_key])
        index.delete_manifests([manifest])
    return manifest
