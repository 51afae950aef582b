"""Naming and protecting manifests: ``tailor tag``/``untag``, ``tailor pin``/``unpin``, ``tailor rm``.

Tags and pins are what retention never drops. ``rm`` drops one manifest at once; the blobs
it alone used stay until ``tailor gc``, like git's unreachable objects. The tag and pin
objects in the backend are the truth (every host reads them); each change writes them
first and the index second, so an interrupted change is undone at the next open.

Call order of each change (docs/FORMAT.md section 8, I2): take the store lock shared (gc takes
it exclusive from its plan to its last deletion, so no change lands between them: attack
finding 6, a pin set while gc had planned to drop the step); bring the index up to date under
it; resolve the step; check the fence (a holder that stalled past its lease writes nothing);
write the ref objects; update the index; release.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Protocol

from tailorstore.core.errors import (
    LOCK_TIMEOUT,
    Call,
    LeaseLostError,
    LockTimeoutError,
    StepExistsError,
    StoreError,
    TailorError,
)
from tailorstore.core.failpoints import failpoint, operation
from tailorstore.core.progress import Progress
from tailorstore.core.records import ManifestRecord, RunRecord
from tailorstore.core.step_rules import check_tag
from tailorstore.store.backends.roles import Editor
from tailorstore.store.lease import LeaseHandle
from tailorstore.store.lock import LockHandle, fence_for_follow_up
from tailorstore.store.manifests.drop_marks import mark_dropping, mark_unless_claimed, settle_ref, take_back_marks
from tailorstore.store.manifests.keys import versions_of
from tailorstore.store.manifests.objects import step_changed, unpublish
from tailorstore.store.manifests.refs import RefSource, RefWrite, drop_tag, put_pin, put_tag, write_pin
from tailorstore.store.repo import Repository, StoreWriter

log = logging.getLogger("tailorstore")


class RefEdits(RefSource, Protocol):
    """The index as tags, pins and removals change it (and write the refs it then holds)."""

    def tagged(self, tag: str) -> ManifestRecord | None: ...

    def created_runs(self) -> dict[str, RunRecord]: ...

    def add_tag(self, manifest: int, tag: str) -> None: ...

    def drop_tag(self, tag: str) -> None: ...

    def set_pinned(self, manifest: int, pinned: bool) -> None: ...

    def delete_manifests(self, manifests: Iterable[int]) -> None: ...


@contextmanager
def changing_a_step(
    repo: StoreWriter, what: str, lock_timeout: float, progress: Progress | None = None
) -> Iterator[LockHandle | LeaseHandle]:
    """The store lock, shared, with the index brought up to date under it: how a change of one
    step's refs or record begins (the module's call order; curate/adding_metrics.py too)."""
    repo.refuse_writes()
    with operation(what), repo.lock(exclusive=False, timeout=lock_timeout, progress=progress) as lock:
        repo.refresh(lock)
        yield lock


def tag(
    repo: Repository,
    selector: str,
    name: str,
    *,
    force: bool = False,
    lock_timeout: float = LOCK_TIMEOUT,
    progress: Progress | None = None,
) -> int:
    check_tag(name)
    objects = repo.objects(Editor)
    with changing_a_step(repo, "tag", lock_timeout, progress) as lock:
        manifest = repo.resolve(selector)
        with repo.transaction(RefEdits) as edit:
            holder = edit.tagged(name)
            if holder and holder.id != manifest and not force:
                raise StepExistsError(
                    f"tag {name!r} already names another manifest; pass ", Call(force=True), " to move it"
                )
            key = repo.manifest(manifest).object_key or ""
            edit.add_tag(manifest, name)  # takes the tag from any other holder; the step's other tags stay
            lock.check("tagging")
            # one object, whatever the step holds already (a step holds any number of tags), swapped
            # for exactly what was read: a tag another host set meanwhile is refused without --force,
            # and a failure after the put takes back this write alone (FORMAT.md 8.1, I2, I3)
            write = put_tag(objects, name, key, force=force, fence=lambda: lock.check("tagging"))
            _settle(repo, objects, manifest, write, lock, "tagging", lock_timeout)
    return manifest


def _settle(
    repo: StoreWriter, objects: Editor, manifest: int, write: RefWrite, lock: LockHandle | LeaseHandle, what: str,
    lock_timeout: float,
) -> None:  # fmt: skip
    """After a ref's object is written: the drop marks read, the ref following the step to its
    current version, or every write taken back and the change failed when a gc or ``rm`` is
    dropping the step (FORMAT 8.1: each side writes, then reads the other's, so one of them always
    backs off; ``drop_marks.settle_ref``). Each request is fenced; a lease that lapsed meanwhile
    (this process stalled after its write) makes it settle again under a new lease, from the
    store as it is then: sent unfenced, a follow-up raced a gc that held the store alone."""
    failpoint("ref-written")
    record = repo.manifest(manifest)
    if not record.object_key:
        return
    writes = [write]
    try:
        _settle_under_a_lease(repo, objects, writes, record, lock, what, lock_timeout)
    except TailorError as exc:
        left = [w.key for w in writes if w.holds_now(objects)]
        if not left:
            raise
        why = {LeaseLostError: "its lease lapsed", LockTimeoutError: "no new lease came in time"}.get(
            type(exc), "a request failed"
        )
        raise LeaseLostError(
            f"{what} stopped after its write ({why}), and what it wrote stays: {', '.join(left)} (step "
            f"{record.step}). See ",
            Call("log"),
            "; run it again to finish it, or undo it.",
        ) from exc


_SETTLE_LEASES = 3  # new leases a settle takes, each after the one before lapsed too


def _settle_under_a_lease(
    repo: StoreWriter, objects: Editor, writes: list[RefWrite], record: ManifestRecord,
    lock: LockHandle | LeaseHandle, what: str, lock_timeout: float,
) -> None:  # fmt: skip
    """``settle_ref`` under the change's lease, or, should it lapse, under a new one each time."""
    key, step = str(record.object_key), record.step
    try:
        settle_ref(objects, writes, key, step, fence=lambda: lock.check(what))
        return
    except LeaseLostError as exc:
        lapsed = exc
    for _ in range(_SETTLE_LEASES):
        try:
            with fence_for_follow_up(repo, lock, what, wait=lock_timeout) as check:
                settle_ref(objects, writes, key, step, fence=check)
            return
        except LeaseLostError as exc:
            lapsed = exc
    raise lapsed


def untag(repo: Repository, name: str, *, lock_timeout: float = LOCK_TIMEOUT, progress: Progress | None = None) -> int:
    """Remove a tag; the manifest stays (and becomes droppable by gc unless it is pinned)."""
    objects = repo.objects(Editor)
    with changing_a_step(repo, "untag", lock_timeout, progress) as lock:
        holder = repo.view(RefEdits).tagged(name)
        if holder is None:
            raise StoreError(f"nothing is tagged {name!r}; ", Call("log"), " shows the tags.")
        with repo.transaction(RefEdits) as edit:
            lock.check("untagging")
            drop_tag(objects, name, holder.object_key or "", fence=lambda: lock.check("untagging"))
            edit.drop_tag(name)
    return holder.id


def pin(
    repo: Repository,
    selector: str,
    pinned: bool = True,
    *,
    lock_timeout: float = LOCK_TIMEOUT,
    progress: Progress | None = None,
) -> int:
    objects = repo.objects(Editor)
    with changing_a_step(repo, "pin" if pinned else "unpin", lock_timeout, progress) as lock:
        manifest = repo.resolve(selector)
        with repo.transaction(RefEdits) as edit:
            edit.set_pinned(manifest, pinned)
            lock.check("pinning")
            # only the pin object: rewriting the step's tag too made a failure after the first put
            # a change reported failed that stayed (the soak, seed 399 for a tag)
            key = repo.manifest(manifest).object_key
            fence = lambda: lock.check("pinning")  # noqa: E731 - again just before each request
            if not pinned or key is None:
                write_pin(objects, edit, manifest, fence=fence)
                return manifest
            # a pin object of this call's own, even where the step is pinned already (another host's
            # pin may be taken back by its own failure), then the drop marks read: a gc or rm that
            # marked the step first makes this take back exactly its write and fail (FORMAT.md 8.1)
            write = put_pin(objects, key, fence=fence)
            _settle(repo, objects, manifest, write, lock, "pinning", lock_timeout)
    return manifest


def remove(
    repo: Repository,
    selector: str,
    *,
    force: bool = False,
    lock_timeout: float = LOCK_TIMEOUT,
    progress: Progress | None = None,
) -> int:
    objects = repo.objects(Editor)
    with changing_a_step(repo, "rm", lock_timeout, progress) as lock:
        manifest = repo.resolve(selector)
        record = repo.manifest(manifest)
        if (record.pinned or record.tags) and not force:
            what = "pinned" if record.pinned else f"tagged {', '.join(map(repr, record.tags))}"
            undo = Call("unpin", f"step={record.step}") if record.pinned else Call("untag", record.tags[0])
            raise StoreError(f"step {record.step} is {what}; ", undo, " first, or pass ", Call(force=True))
        heirs = [r.name for r in repo.view(RefEdits).created_runs().values() if r.base and r.base == record.object_key]
        if heirs and not force:
            raise StoreError(
                f"step {record.step} is the base of run(s) {', '.join(heirs)}; pass ",
                Call(force=True),
                " to remove it anyway",
            )
        with repo.transaction(RefEdits) as edit:
            lock.check("removing a step")
            fence = lambda: lock.check("removing a step")  # noqa: E731 - again just before each request
            keys, mine = _mark_versions(objects, record, force, fence)
            try:  # the manifest (and its pins) first, then its tag, then the index rows: a stop between
                # them leaves a tag naming a removed manifest (which tags nothing), never a step still
                # there that lost its tag, which a gc would drop (I2)
                unpublish(objects, keys, fence=fence)
            except LeaseLostError:  # stopped by its fence before deleting the manifest
                take_back_marks(objects, keys, mine, fence=fence)
                raise
            for name in record.tags:
                drop_tag(objects, name, record.object_key or "", fence=fence)
            edit.delete_manifests([manifest])
    return manifest


def _mark_versions(
    objects: Editor, record: ManifestRecord, force: bool, fence: Callable[[], None]
) -> tuple[list[str], list[str]]:
    """Before ``rm`` deletes anything: mark every version of the step (an older one a revision left
    for its refs counts for the step too), then read what others did meanwhile. Without ``force``,
    a pin or tag set meanwhile by another host wins. Whatever ``force``, a version newer than the
    one this host read (another host's revision or ``--force``) makes it fail, having removed
    nothing: the revision checks the marker after its put (FORMAT.md 8.1, I7), so of the two at
    least one sees the other. Returns (the keys to delete, the markers this call made)."""
    if record.object_key is None:
        return [], []
    older, _ = versions_of(objects, record.object_key)
    keys = [*older, record.object_key]
    if force:
        mine = mark_dropping(objects, keys, fence=fence)
    else:
        taken, mine = mark_unless_claimed(objects, keys, fence=fence)
        if taken:
            raise LockTimeoutError(
                f"step {record.step} was pinned or tagged meanwhile; nothing was removed. See ", Call("log")
            )
    _, newer = versions_of(objects, record.object_key)
    if newer or not objects.exists(record.object_key):
        objects.delete_many(mine)
        raise step_changed(record.step, record.run)
    return keys, mine
