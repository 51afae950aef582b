"""gc's drop marks against ref changes: each side writes, then reads the other's (FORMAT.md 8.1).

A gc that drops manifests and a host that tags or pins one may meet however either stalls: a
lock or lease checked before a request may be late by the time the request lands, so no check
decides. Each side writes its intent first and then reads the other's, as in Dekker's mutual
exclusion. The order on each side:

- gc (and ``rm``, and :func:`objects.retire`): :func:`mark_dropping` puts each manifest's drop
  marker create-only, then :func:`claimed` reads the pins and tags; a manifest a ref names is
  kept and its marker taken back (:func:`mark_unless_claimed`), and a drop that stops before its
  deleting request takes back the markers it made (:func:`take_back_marks`);
- a ref change writes its tag or pin object, then :func:`settle_ref` reads the marks: a step
  replaced meanwhile (a newer version, the old one marked superseded or retired) takes the ref
  on its newest version, and a marked newest version makes it undo its writes and fail (a
  publisher asks :func:`being_dropped`).

So of a drop and a ref change racing, at least one sees the other.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable

from tailorstore.core.errors import Call, LeaseLostError, LockTimeoutError, ObjectExistsError
from tailorstore.store.backends.base import Backend
from tailorstore.store.manifests.keys import (
    MANIFEST_PREFIX,
    SUPERSEDED,
    TAG_PREFIX,
    current_of,
    drop_marker,
    is_manifest_key,
    listed_manifest_keys,
    pin_key,
    versions_of,
)
from tailorstore.store.manifests.refs import (
    PIN_TOMBSTONE,
    RefWrite,
    listed_tags,
    named,
    pinned_keys,
    put_pin,
    read_ref,
    renamed,
    standing_version,
)


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


def mark_superseded(backend: Backend, keys: Iterable[str], *, fence: Callable[[], None] | None = None) -> None:
    """gc, alone under its exclusive lock, before it carries the refs of versions a newer one
    replaced and deletes them: each one's marker says :data:`SUPERSEDED`, written over any marker
    there (a killed gc's empty one, left create-only, made a publisher stalled meanwhile take the
    deleted version for removed and delete the step's only version with its own)."""
    for key in keys:
        backend.put(drop_marker(key), SUPERSEDED, fence=fence)


def claimed(backend: Backend, keys: Iterable[str], *, exact: bool = False) -> list[str]:
    """gc, after :func:`mark_dropping`: those of ``keys`` that a pin or a tag names now. A ref
    written before the marker is seen here; one written after sees the marker and backs off. A
    ref claims the version it names (what a revision retiring that version asks about) and, as it
    counts for the step, the step's current version too (``keys.current_of``): a ref left on an
    older listed version claims the step from a gc. ``exact``: only the version it names (a failed
    revision taking its new version back asks whether another host's ref names that one; the
    step's refs on the version it replaced stay with that version)."""
    wanted = set(keys)
    current = current_of(listed_manifest_keys(backend))
    named = [*listed_tags(backend, log_damaged=False).values(), *pinned_keys(backend, current)]
    # the version a ref names (a revision retiring it asks about that one), and the step's current one
    found = {key for target in named for key in (target, target if exact else current.get(target, target))}
    return sorted(found & wanted)


def mark_unless_claimed(
    backend: Backend, keys: list[str], *, fence: Callable[[], None] | None = None, exact: bool = False
) -> tuple[list[str], list[str]]:
    """Mark these manifests as dropping, then read their refs: (the ones a ref names, after taking
    back the markers this call made so that nothing changed; the markers this call made)."""
    mine = mark_dropping(backend, keys, fence=fence)
    taken = claimed(backend, keys, exact=exact)
    if taken:
        try:  # fenced: a marker's name is also its version's reservation, which a late delete could take
            backend.delete_many(mine, fence=fence)
        except LeaseLostError:
            pass  # left to the next gc (clear_stale_marks), which holds the store alone
        return taken, []
    return [], mine


def take_back_marks(
    backend: Backend, keys: Iterable[str], mine: list[str], *, fence: Callable[[], None] | None = None
) -> None:
    """A drop that stopped before its deleting request went out: take back the markers it made of
    manifests still there, so that the steps can be pinned again, only while ``fence`` holds. A drop
    stopped by its fence sends nothing more (a delete past its lease could take another gc's marker
    of the same name): the markers stay, and the next gc clears them (:func:`clear_stale_marks`)."""
    if fence is not None:
        try:
            fence()
        except LeaseLostError:
            return
    for key in keys:
        marker = drop_marker(key)
        if marker in mine:
            with contextlib.suppress(Exception):
                if backend.exists(key):
                    backend.delete(marker)


def clear_stale_marks(backend: Backend, dropping: set[str], *, fence: Callable[[], None] | None = None) -> int:
    """gc, alone under its exclusive lock, before it marks anything: delete the drop markers of
    listed versions it does not drop. Every other writer of markers (``rm``, a retirement, a
    publisher taking its version back, another gc) holds the lock, so such a marker is one a
    killed or stalled holder left behind, which would refuse every pin, tag and metric of a step
    kept for good. A holder past its lease writes nothing more (its fence). A marker of a version
    that is gone stays: it reserves the version number (``keys.removed_marker``). Returns how many
    it deleted."""
    listed = set(backend.list(MANIFEST_PREFIX))
    stale = [
        marker
        for key in listed
        if is_manifest_key(key) and key not in dropping and (marker := drop_marker(key)) in listed
    ]
    backend.delete_many(stale, fence=fence)
    return len(stale)


def being_dropped(backend: Backend, key: str) -> bool:
    """A ref change, after writing its object: whether a gc has marked the manifest (it then undoes
    its write and fails, so that no ref it reports set names a step a gc goes on to drop)."""
    if backend.exists(drop_marker(key)):
        return True
    _, newer = versions_of(backend, key)  # a ref on an older version counts for the newest: its marks too
    return any(backend.exists(drop_marker(k)) for k in newer)


_FOLLOWS = 5  # versions a ref change follows a step through before it says the step keeps changing


def settle_ref(
    backend: Backend, writes: list[RefWrite], key: str, step: int, *, fence: Callable[[], None] | None = None
) -> None:
    """A tag's or pin's change, after writing its object (``writes[0]``) for manifest ``key`` (of
    ``step``): the ref follows the step to its standing version (:func:`standing_version`), written
    there if gc's carry has not moved it already, and that version's marks are read again after each
    such write (write, then read: of a drop and this change, one sees the other). Every write made is
    appended to ``writes``. A step being dropped or gone makes it take them all back and fail: so no
    ref it reports set names a step a gc or ``rm`` goes on to drop, and a ref written on a version a
    gc superseded meanwhile is neither lost with that version nor left moved by a change reported
    failed. A failed request takes them back too; a lease lost is raised with the writes left as
    they are (store/lock.py, fence_for_follow_up: the caller settles again under a new lease, ``writes`` and all)."""
    write = writes[0]
    try:
        for _ in range(_FOLLOWS):
            target = standing_version(backend, key)
            if target is None:
                break
            if target == key:
                return
            if (moved := _follow(backend, write, target, fence)) is not None:
                writes.append(moved)
            key = target
    except LeaseLostError:
        raise
    except BaseException:
        take_back_all(backend, writes, fence)
        raise
    take_back_all(backend, writes, fence)
    raise LockTimeoutError(
        f"step {step} is being dropped by a gc or rm, or kept being replaced meanwhile; nothing was changed. See ",
        Call("log"),
        ": a step still there takes it when run again. A gc or rm killed half-way leaves its mark on a step "
        "it kept; the next ",
        Call("gc"),
        " clears it.",
    )


def take_back_all(backend: Backend, writes: list[RefWrite], fence: Callable[[], None] | None) -> None:
    """A failed change's ref writes, each taken back exactly, the last first, fenced."""
    for done in reversed(writes):
        done.take_back(backend, fence=fence)


def _follow(backend: Backend, write: RefWrite, target: str, fence: Callable[[], None] | None) -> RefWrite | None:
    """``write``'s ref, made to name ``target``: a tag object still holding this write is swapped to
    name it, its token kept; a pin is written at ``target``'s pin key unless a carry put this write
    there already. Returns a new write to take back, if one was made."""
    if write.key.startswith(TAG_PREFIX):
        for _ in range(_FOLLOWS):
            try:
                data, version = read_ref(backend, write.key)
            except FileNotFoundError:
                return None
            if not write.holds(data) or named(data) == target:
                return None  # another host's write replaced this one since, or a carry moved it
            if backend.put_if(write.key, renamed(data, target), version, fence=fence):
                return None
        raise LockTimeoutError(f"{write.key} could not follow its step: other hosts kept changing it.")
    try:
        data, _ = read_ref(backend, pin_key(target))
        if write.holds(data):  # carried there by a gc: this write's own, to take back as such
            return RefWrite(pin_key(target), data, None, PIN_TOMBSTONE)
    except FileNotFoundError:
        pass
    return put_pin(backend, target, fence=fence)
