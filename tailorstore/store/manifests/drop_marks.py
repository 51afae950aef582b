"""gc's drop marks against ref changes: each side writes, then reads the other's (FORMAT.md 8.1).

A gc that drops manifests and a host that tags or pins one may meet however either stalls: a
lock or lease checked before a request may be late by the time the request lands, so no check
decides. Each side writes its intent first and then reads the other's, as in Dekker's mutual
exclusion. The order on each side:

- gc (and ``rm``, and :func:`objects.retire`): :func:`mark_dropping` puts each manifest's drop
  marker create-only, then :func:`claimed` reads the pins and tags; a manifest a ref names is
  kept and its marker taken back (:func:`mark_unless_claimed`), and a drop that stops before its
  deleting request takes back the markers it made (:func:`take_back_marks`);
- a ref change writes its tag or pin object, then asks :func:`being_dropped`; a marked manifest
  makes it undo its write and fail.

So of a drop and a ref change racing, at least one sees the other.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable

from tailorstore.core.errors import ObjectExistsError
from tailorstore.store.backends.base import Backend
from tailorstore.store.manifests.keys import current_of, listed_manifest_keys, versions_of
from tailorstore.store.manifests.refs import listed_tags, pinned_keys


def drop_marker(key: str) -> str:
    """The object that says a manifest is being dropped (for a commit manifest, the same object
    that reserves its version once it is gone: ``keys.removed_marker``)."""
    return key.removesuffix(".json.zst") + ".removed"


def mark_dropping(
    backend: Backend, keys: Iterable[str], *, fence: Callable[[], None] | None = None, why: bytes = b""
) -> list[str]:
    """gc, before it deletes anything of these manifests: their drop markers, each put create-only
    (holding ``why``: :data:`SUPERSEDED` for versions a newer one replaced); the markers this call
    created (one already there was another gc's, and stays)."""
    created = []
    for key in keys:
        try:
            backend.put(drop_marker(key), why, create_only=True, fence=fence)
            created.append(drop_marker(key))
        except ObjectExistsError:
            continue
    return created


def claimed(backend: Backend, keys: Iterable[str]) -> list[str]:
    """gc, after :func:`mark_dropping`: those of ``keys`` that a pin or a tag names now. A ref
    written before the marker is seen here; one written after sees the marker and backs off. A
    ref claims the version it names (what a revision retiring that version asks about) and, as it
    counts for the step, the step's current version too (``keys.current_of``): a ref left on an
    older listed version claims the step from a gc."""
    wanted = set(keys)
    current = current_of(listed_manifest_keys(backend))
    named = [*listed_tags(backend, log_damaged=False).values(), *pinned_keys(backend, current)]
    # the version a ref names (a revision retiring it asks about that one), and the step's current one
    found = {key for target in named for key in (target, current.get(target, target))}
    return sorted(found & wanted)


def mark_unless_claimed(
    backend: Backend, keys: list[str], *, fence: Callable[[], None] | None = None
) -> tuple[list[str], list[str]]:
    """Mark these manifests as dropping, then read their refs: (the ones a ref names, after taking
    back the markers this call made so that nothing changed; the markers this call made)."""
    mine = mark_dropping(backend, keys, fence=fence)
    taken = claimed(backend, keys)
    if taken:
        backend.delete_many(mine)
        return taken, []
    return [], mine


def take_back_marks(backend: Backend, keys: Iterable[str], mine: list[str]) -> None:
    """A drop that stopped before its deleting request went out (its fence failed): take back the
    markers it made of manifests still there, so that the steps can be pinned again. Best effort: a
    marker left behind only makes pins of its step fail until a gc finishes the drop."""
    for key in keys:
        marker = drop_marker(key)
        if marker in mine:
            with contextlib.suppress(Exception):
                if backend.exists(key):
                    backend.delete(marker)


def being_dropped(backend: Backend, key: str) -> bool:
    """A ref change, after writing its object: whether a gc has marked the manifest (it then undoes
    its write and fails, so that no ref it reports set names a step a gc goes on to drop)."""
    if backend.exists(drop_marker(key)):
        return True
    _, newer = versions_of(backend, key)  # a ref on an older version counts for the newest: its marks too
    return any(backend.exists(drop_marker(k)) for k in newer)
