"""Putting and deleting manifest objects: a manifest counts as committed once its object exists.

The object is written create-only after every blob it names is durable, inside the index
transaction that records it (a failed put rolls the transaction back; a failed index commit
deletes the object: store/publish.py). The order of one publication, as store/publish.py
calls it:

1. :func:`publish`: the key (:func:`new_key`: version 1 of a new step, the next version for a
   replacement, refused when the version a revision was read from is no longer the newest),
   the fence, the create-only put;
2. for a revision, :func:`check_revised` right after its put (write, then read the other side);
3. on a leased store, gc's notices read (store/gc_notices.py); then the refs
   (store/manifests/refs.py), only after the object;
4. once the index transaction committed, :func:`unpublish` of the versions it replaced, or
   :func:`retire` of those a ref may still name.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable

from tailorstore.core.errors import Call, ObjectExistsError, StepChangedError, StepExistsError
from tailorstore.core.failpoints import failpoint
from tailorstore.core.records import COMMIT, MAIN_RUN, ManifestRecord
from tailorstore.store.backends.base import Backend
from tailorstore.store.index._index import Index
from tailorstore.store.lock import Fence
from tailorstore.store.manifests.document import document, encode
from tailorstore.store.manifests.drop_marks import mark_unless_claimed
from tailorstore.store.manifests.keys import (
    COMMIT_KEY,
    MANIFEST_PREFIX,
    key_version,
    pin_key,
    removed_marker,
    step_versions,
)


def publish(
    backend: Backend,
    index: Index,
    manifest: int,
    *,
    fence: Fence | None,
    replacing: bool = False,
    expected: str | None = None,
) -> str:
    """Write the manifest's object, create-only, from inside the transaction that records it; the
    caller writes its refs (``refs.write_refs``) only after this returns.

    Refs come after the object, never before (I2, docs/FORMAT.md 8.1): two hosts that publish one step
    choose the same key, so a loser that had written refs first and took them back would delete
    the winner's tag and pin, which name that same key. So a loser has written nothing to take
    back, and gets :class:`StepExistsError`. A crash between the object and its refs leaves a
    step whose older version's refs still count for it (``keys.current_of``). ``fence`` (the
    store lock the caller holds) is checked just before the object is written: a process that
    stalled past its lease publishes nothing (store/lease.py). ``expected``: a revision's version
    it was read from, which must still be the step's newest (:func:`new_key`, :func:`check_revised`).
    """
    key = new_key(backend, index, manifest, replacing=replacing, expected=expected)
    index.set_object_key(manifest, key)
    failpoint("before-publish")
    check = (lambda: fence.check("recording the manifest")) if fence is not None else None
    try:
        # the fence is checked inside the put, after the request's failpoint: a stall before the
        # request is one the fence sees (the same rule as gc's deletions)
        backend.put(key, encode(document(index, manifest)), create_only=True, fence=check)
    except ObjectExistsError:
        record = index.manifest(manifest)
        assert record is not None
        if expected is not None:  # another host's revision or replacement took the next version first
            raise step_changed(record.step, record.run) from None
        if replacing:
            raise StepExistsError(
                f"step {record.step} was replaced by another host at the same moment; nothing was replaced. See ",
                Call("log"),
                ", and run it again to replace that.",
            ) from None
        raise _step_exists(record) from None
    return key


def new_key(
    backend: Backend, index: Index, manifest: int, *, replacing: bool = False, expected: str | None = None
) -> str:
    """The key a manifest's object gets: by step and version for a commit, random for a merge.

    A commit that replaces nothing takes version 1 of its step and is refused when any version
    exists already, whoever wrote it: the local index may not have seen another host's commit
    yet. A replacement (``force``, thinning) takes the next version. A revision (``expected``: the
    version it was read from) is refused when that is no longer the step's newest version or was
    removed (:func:`check_revised`)."""
    record = index.manifest(manifest)
    assert record is not None
    run = record.run
    if record.origin != COMMIT:
        return f"{MANIFEST_PREFIX}{run}/merge-{os.urandom(8).hex()}.json.zst"
    versions, removed = step_versions(backend, run, record.step)
    if versions and not replacing:
        raise _step_exists(record)
    latest = max([*versions, *removed], default=0)
    if expected is not None and (latest != key_version(expected) or latest not in versions or latest in removed):
        raise step_changed(record.step, record.run)
    return f"{MANIFEST_PREFIX}{run}/step-{record.step:020d}-v{latest + 1}.json.zst"


def check_revised(backend: Backend, key: str, expected: str) -> None:
    """A revision, right after its create-only put of ``key``: the version it was read from
    (``expected``) must still be there, unmarked, and the newest but its own. A removal marks a
    step's versions before it deletes them and then lists the step's newer versions (``rm``), so
    of a removal and a revision racing, at least one sees the other and fails (write, then read
    the other side: FORMAT.md 8.1, I7)."""
    match = COMMIT_KEY.fullmatch(key)
    assert match is not None
    versions, removed = step_versions(backend, match.group(1), int(match.group(2)))
    before = key_version(expected)
    others = [v for v in versions if v != key_version(key)]
    if before not in versions or before in removed or max(others, default=0) != before:
        raise step_changed(int(match.group(2)), match.group(1))


def step_changed(step: int, run: str) -> StepChangedError:
    where = "" if run == MAIN_RUN else f" of run {run!r}"
    return StepChangedError(
        f"step {step}{where} was removed or replaced by another host while this ran; nothing was changed. See ",
        Call("log"),
        ", and run it again if the step is still there.",
    )


def _step_exists(record: ManifestRecord) -> StepExistsError:
    where = "the store" if record.run == MAIN_RUN else f"run {record.run!r}"
    return StepExistsError(
        f"step {record.step} is already in {where}: another host committed it first. Nothing was replaced; "
        "commit under another step, or pass ",
        Call(force=True),
        " to replace it.",
    )


def unpublish(backend: Backend, keys: Iterable[str | None], *, fence: Callable[[], None] | None = None) -> None:
    """Delete manifest objects (and their pins) that are no longer wanted, in as few requests as
    the backend allows (a gc may drop hundreds). Should the request fail half-way, a pin left
    without its manifest pins nothing (pins are read only for manifests that exist), and a
    manifest left without its pin is one the next gc finds unkept again. Each commit manifest's
    version is reserved first (``keys.removed_marker``), so no later manifest takes its key."""
    wanted = [k for k in keys if k]
    for key in wanted:  # put again where a drop marked it: one cleared since (a stale mark) reserves nothing
        if (marker := removed_marker(key)) is not None:
            backend.put(marker, b"", fence=fence)
    backend.delete_many([k for key in wanted for k in (key, pin_key(key))], fence=fence)


def retire(backend: Backend, keys: Iterable[str]) -> list[str]:
    """After a revision or a ``--force`` that wrote no refs of its own: delete the versions it
    replaced, unless a ref names one. Their refs count for the new version while they are listed
    (``keys.current_of``), so a ref another host set or moved meanwhile is never written over; one
    kept is carried over and deleted by the next gc, under its exclusive lock. Each is marked before
    its refs are read, as gc's drops are: a pin or tag written after the read sees the marker and
    backs off. Returns the keys kept."""
    kept = []
    for key in keys:
        taken, _ = mark_unless_claimed(backend, [key])
        if taken:
            kept.append(key)
        else:  # the marker stays: it reserves the version (removed_marker)
            backend.delete_many([key, pin_key(key)])
    return kept
