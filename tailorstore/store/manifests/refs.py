"""Tags and pins as objects: writing them as the index says, and reading them back.

A tag object holds the key of the manifest it names; a pin object is empty, and present while
its manifest is pinned (keys: store/manifests/keys.py). Refs are written only after the
manifest object they name exists (store/manifests/objects.py), and a tag or pin left on an
older version of a step counts for the step's current version (:func:`current_refs`,
``keys.current_of``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from typing import Protocol

from tailorstore.core.records import MAIN_RUN, ManifestRecord
from tailorstore.store.backends.base import Backend
from tailorstore.store.manifests.keys import (
    PIN_PREFIX,
    TAG_KEY,
    TAG_PREFIX,
    current_of,
    is_manifest_key,
    keys_by_name,
    listed_manifest_keys,
    odd_key,
    pin_key,
    pinned_by,
    run_of_key,
    same_step,
    tag_key,
    tag_of_key,
    versions_of,
)

log = logging.getLogger("tailorstore")


class RefSource(Protocol):
    """What writing a manifest's refs reads of the index: the manifests, and each one's record.
    Operations hand their role view (it names these two), or the index itself."""

    def manifest(self, manifest: int) -> ManifestRecord | None: ...

    def manifests(self, run: str | None = None) -> list[ManifestRecord]: ...


def write_refs(
    backend: Backend, index: RefSource, manifests: Iterable[int], *, fence: Callable[[], None] | None = None
) -> list[str]:
    """Make the tag and pin objects of these manifests say what the index says; returns the
    keys of the ref objects it wrote. ``fence`` is checked just before each put (after its
    request's failpoint), as before gc's deletions.

    An unpinned record deletes no pin: the index may not know that another host pinned the
    manifest since (ref changes hold the lock shared, side by side). A commit that did so deleted
    that host's reported pin (the soak, seed 269 on S3); only `unpin` deletes one, and a new main
    manifest takes the plain key over from a branch's legacy pin."""
    written = []
    for m in manifests:
        record = index.manifest(m)
        if record is None or record.object_key is None:
            continue
        for tag in record.tags:
            written.append(put_tag(backend, tag, record.object_key, fence=fence))
        if record.pinned:
            written.append(_put_pin(backend, record, fence))
        else:
            _hand_over_plain_pin(backend, index, record.object_key)
    return written


def put_tag(backend: Backend, tag: str, manifest_key: str, *, fence: Callable[[], None] | None = None) -> str:
    """Tag the manifest whose object is ``manifest_key``: one object, one request, whatever tags the
    step holds already (a step holds any number; a tag names one step, so putting it moves it).
    Returns the tag object's key."""
    key = tag_key(tag)
    backend.put(key, manifest_key.encode(), fence=fence)
    return key


def write_pin(backend: Backend, index: RefSource, manifest: int, *, fence: Callable[[], None] | None = None) -> None:
    """The manifest's pin object, put or deleted as the index says; nothing else of its refs."""
    record = index.manifest(manifest)
    if record is None or record.object_key is None:
        return
    if record.pinned:
        _put_pin(backend, record, fence)
    else:
        _unpin(backend, index, record.object_key)


TOMBSTONE = b"dropped\n"
"""What a dropped tag's object holds until gc deletes it: it names no manifest, so it tags nothing."""


def drop_tag(backend: Backend, tag: str, held_by: str, *, fence: Callable[[], None] | None = None) -> bool:
    """Drop ``tag`` from the step whose manifest key is ``held_by``, only while the tag's object still
    names that step (any version of it): another host may have moved the tag to another step since
    this host's index said where it was (``tag --force``), and that move was reported done. The
    object is read with its version and replaced by a tombstone only while it has that version
    (``put_if``: S3 ``If-Match``), never deleted by name; gc deletes tombstones, alone under its
    exclusive lock (docs/FORMAT.md 3.3). Returns whether this call dropped it."""
    key = tag_key(tag)
    for _ in range(3):  # a refused replace means another host wrote it meanwhile: look again
        try:
            data, version = backend.get_versioned(key)
        except FileNotFoundError:
            return False
        target = data[:4096].decode(errors="replace")
        if data == TOMBSTONE or not same_step(target, held_by):
            return False  # untagged already, or the tag now names another step: leave it there
        if backend.put_if(key, TOMBSTONE, version, fence=fence):
            return True
    return False


def tombstones(backend: Backend) -> list[str]:
    """The tag objects that are tombstones (dropped tags), for gc to delete."""
    dropped = TOMBSTONE.decode()
    return [key for key, target in _tag_targets(backend, log_damaged=False, dropped=True) if target == dropped]


def _put_pin(backend: Backend, record: ManifestRecord, fence: Callable[[], None] | None) -> str:
    key = pin_key(str(record.object_key))
    backend.put(key, b"", fence=fence)
    return key


def _hand_over_plain_pin(backend: Backend, index: RefSource, key: str) -> None:
    """A main manifest whose name another run's pinned manifest has, pinned under the plain key by
    a writer before pins named their run: that run gets its own form, and the plain key is main's."""
    if run_of_key(key) != MAIN_RUN:
        return
    name = key.rsplit("/", 1)[-1]
    namesakes = (m for m in index.manifests() if m.pinned and m.object_key not in (None, key))
    if any(str(m.object_key).endswith("/" + name) for m in namesakes) and backend.exists(PIN_PREFIX + name):
        _unpin_one(backend, index, key)


def _unpin(backend: Backend, index: RefSource, key: str) -> None:
    """Delete the pin of ``key``, and then those of the step's other versions: a pin left on an
    older version counts for the newest (``keys.current_of``; a revision leaves it there), and one
    on a newer version than this host's index knows pins the step as well. A plain-form pin may
    also be what pins another run's manifest of the same name (one written before pins named their
    run): those the index holds pinned get a pin of their own first."""
    _unpin_one(backend, index, key)
    older, newer = versions_of(backend, key)
    for other in (*older, *newer):
        backend.delete(pin_key(other))


def _unpin_one(backend: Backend, index: RefSource, key: str) -> None:
    pin = pin_key(key)
    name = key.rsplit("/", 1)[-1]
    if run_of_key(key) != MAIN_RUN:
        backend.delete(pin)
        plain = PIN_PREFIX + name
        # every listed version, not the index's current ones: main's older version of that name,
        # which a revision left holding main's pin, makes the plain pin main's, not this branch's
        holders = keys_by_name(listed_manifest_keys(backend))
        if key not in pinned_by(plain, holders) or not backend.exists(plain):
            return
        pin = plain  # main has no manifest of that name: the plain pin was this branch's
    for other in index.manifests():
        if other.pinned and other.object_key and other.object_key != key and other.object_key.endswith("/" + name):
            backend.put(pin_key(other.object_key), b"")
    backend.delete(pin)


def carry_refs(backend: Backend, index: RefSource, superseded: list[str]) -> None:
    """Before gc deletes superseded versions: their steps' refs, written for the current versions
    (which the index has from ``keys.current_of``), so a pin or tag left on an old version outlives it."""
    if not superseded:
        return
    current = current_of(listed_manifest_keys(backend))
    heirs = {current[k] for k in superseded if k in current}
    ids = [m.id for m in index.manifests() if m.object_key in heirs]
    write_refs(backend, index, ids)


def listed_tags(backend: Backend, *, log_damaged: bool = True) -> dict[str, str]:
    """Tag -> the manifest object key it names, from the tag objects (several tags may name one
    key: a step holds any number). Bytes that are not UTF-8 name no key, and are
    ignored as any tag naming a key that does not exist is (docs/FORMAT.md 3.3), not a decode error
    that stopped every command of the store."""
    out: dict[str, str] = {}
    for key, target in _tag_targets(backend, log_damaged=log_damaged):
        if log_damaged and not is_manifest_key(target) and key not in _WARNED:
            _WARNED.add(key)
            log.warning(
                "tailorstore: tag object %s is damaged: it names no manifest object, so its tag keeps no step "
                "(gc refuses to run until it is set again or removed)",
                key[:200],
            )
        out[tag_of_key(key)] = target
    return out


def _tag_targets(backend: Backend, *, log_damaged: bool, dropped: bool = False) -> Iterator[tuple[str, str]]:
    """(tag object key, what its bytes say) for every tag object of a key tailorstore writes; a
    tombstone (a dropped tag, :data:`TOMBSTONE`) only with ``dropped``: it tags nothing and is no damage."""
    for key in backend.list(TAG_PREFIX):
        if not TAG_KEY.fullmatch(key):
            if log_damaged:
                odd_key(key, "tag")
            continue
        try:  # a key is short: a huge object is damaged whatever it ends with
            data = backend.get(key, 0, 4096)
        except FileNotFoundError:  # untagged while we listed
            continue
        if data != TOMBSTONE or dropped:
            yield key, data.decode(errors="replace")


_WARNED: set[str] = set()  # each damaged tag object is named once a process


def damaged_tags(backend: Backend) -> list[str]:
    """The tags whose objects name no manifest object at all (not a step since removed: bytes that
    are no key). gc refuses to run while there is one: it cannot tell which step that tag keeps
    (docs/FORMAT.md 8.1, I2)."""
    return [tag_of_key(key) for key, target in _tag_targets(backend, log_damaged=False) if not is_manifest_key(target)]


def pinned_keys(backend: Backend, current: dict[str, str]) -> list[str]:
    """The manifest keys the pin objects pin (``keys.pinned_by``)."""
    by_name = keys_by_name(current)
    return [key for pin in backend.list(PIN_PREFIX) for key in pinned_by(pin, by_name)]


def current_refs(tags: dict[str, str], current: dict[str, str]) -> dict[str, tuple[str, ...]]:
    """The current version of each tagged step -> its tags, sorted (:func:`listed_tags` gives
    tag -> the key it names). A tag left on an older version of a step counts for the current one
    (``keys.current_of``). Each tag stands alone: a step holds any number, so a retag is one object
    and two hosts tagging one step at once both keep their tag (when a step held one tag, one of
    two such tags was invisible though both were reported set)."""
    out: dict[str, list[str]] = {}
    for tag, key in sorted(tags.items()):
        out.setdefault(current.get(key, key), []).append(tag)
    return {key: tuple(names) for key, names in out.items()}
