"""Naming and protecting manifests: ``tailor tag``/``untag``, ``tailor pin``/``unpin``, ``tailor rm``.

Tags and pins are what retention never drops. ``rm`` drops one manifest at once; the blobs
it alone used stay until ``tailor gc``, like git's unreachable objects. The tag and pin
objects in the backend are the truth (every host reads them); each change writes them
first and the index second, so an interrupted change is undone at the next open.
"""

from __future__ import annotations

import sqlite3

from .errors import StepExistsError, StoreError
from .store import manifest_objects
from .store.repo import Repository


def check_tag(tag: str) -> str:
    if not tag or tag.isdigit() or any(c in tag for c in "=/\\\x00") or tag != tag.strip():
        raise StoreError(f"tag {tag!r} is not allowed: use letters, digits, '-', '_' or '.', not only digits.")
    return tag


def tag(store: Repository, selector: str, name: str, *, force: bool = False) -> int:
    check_tag(name)
    manifest = store.resolve(selector)
    with store.transaction() as conn:
        holder = conn.execute("SELECT id FROM manifests WHERE tag=?", (name,)).fetchone()
        if holder and holder["id"] != manifest:
            if not force:
                raise StepExistsError(f"tag {name!r} already names another manifest; pass --force to move it")
            conn.execute("UPDATE manifests SET tag=NULL WHERE id=?", (holder["id"],))
        old = conn.execute("SELECT tag FROM manifests WHERE id=?", (manifest,)).fetchone()["tag"]
        conn.execute("UPDATE manifests SET tag=? WHERE id=?", (name, manifest))
        if old and old != name:
            manifest_objects.drop_tag(store.backend, old)
        manifest_objects.write_refs(store.backend, conn, [manifest])
    return manifest


def untag(store: Repository, name: str) -> int:
    """Remove a tag; the manifest stays (and becomes droppable by gc unless it is pinned)."""
    row = store.conn.execute("SELECT id FROM manifests WHERE tag=?", (name,)).fetchone()
    if row is None:
        raise StoreError(f"nothing is tagged {name!r}; `tailor log` shows the tags.")
    with store.transaction() as conn:
        manifest_objects.drop_tag(store.backend, name)
        conn.execute("UPDATE manifests SET tag=NULL WHERE id=?", (row["id"],))
    return int(row["id"])


def pin(store: Repository, selector: str, pinned: bool = True) -> int:
    manifest = store.resolve(selector)
    with store.transaction() as conn:
        conn.execute("UPDATE manifests SET pinned=? WHERE id=?", (int(pinned), manifest))
        manifest_objects.write_refs(store.backend, conn, [manifest])
    return manifest


def remove(store: Repository, selector: str, *, force: bool = False) -> int:
    manifest = store.resolve(selector)
    row = store.manifest(manifest)
    if (row["pinned"] or row["tag"]) and not force:
        what = "pinned" if row["pinned"] else f"tagged {row['tag']!r}"
        hint = "`tailor unpin`" if row["pinned"] else f"`tailor untag {row['tag']}`"
        raise StoreError(f"step {row['step']} is {what}; {hint} first, or pass --force")
    with store.transaction() as conn:
        _unpublish(store, conn, [manifest])
        conn.execute("DELETE FROM manifests WHERE id=?", (manifest,))
    return manifest


def _unpublish(store: Repository, conn: sqlite3.Connection, manifests: list[int]) -> None:
    """Delete the objects (manifest, tag, pin) of manifests about to leave the index."""
    for m in manifests:
        row = conn.execute("SELECT tag, object_key FROM manifests WHERE id=?", (m,)).fetchone()
        if row["tag"]:
            manifest_objects.drop_tag(store.backend, row["tag"])
        manifest_objects.unpublish(store.backend, [row["object_key"]])
