"""Recording a manifest: the one way every operation makes a step (or a merge) visible.

Commit, finalize, merge, averaging, metrics and thinning each end the same way, so it is written
once: a copy of it per operation could forget the last rule below (a merge or finalize reported as
failed would come back at the next open). Each builds its rows as a value (:class:`ManifestRows`
for a new manifest, :class:`Revision` for the next version of one that exists) before anything
is locked for writing, and hands them here. Here, once:

1. inside one index transaction, the manifests the rows were derived from are checked unchanged
   (another process may have replaced or removed one since they were read: ``StepChangedError``);
2. a new commit's step and tag are checked free, or (``replacing``) the step's current version is
   taken over: its tag and pin pass to the new version in the index, and a tag given moves from
   its holder; a revision (:class:`Revision`) is checked to be of the version it was read from;
3. the rows are inserted in one order (packs, blobs, manifest, files, atoms, layers);
4. still inside the transaction, each manifest object is published create-only, after the lease
   is checked (store/lease.py, fencing): this put is the commit point. A host that loses the put
   to another has written nothing, and changes nothing (I2, I3);
5. on a store locked by leases, the blobs the manifest needs are checked against gc's notices and
   are still there (``gc_notices.check_publication``): a gc that deletes them meanwhile either
   sees this object or is seen here, whatever either host's stalls (FORMAT 8.1);
6. only then its tag and pin objects are written, each a conditional swap, fenced, and then the
   drop marks read: a gc that marked the step meanwhile makes the change fail (a crash before
   them: the step's older version's refs still count for it, ``manifests.keys.current_of``). A
   replacement under the shared lock (``--force``, a metric) writes none it carries over, only a tag it gives: the refs
   stay on the version replaced, where they count for the new one, so a ref another host moved or
   removed since this one read it is never written back (FORMAT.md 8.1, I7); a revision, right
   after its put, checks that the version it read is still there and the newest, unmarked
   (``manifests.objects.check_revised``: a removal marks first, then lists);
7. ``COMMIT``. Should anything fail after a put (a ref's write, a full disk under SQLite,
   a damaged index), the objects are deleted again, so nothing the caller reports as failed
   reappears when the next open syncs manifest objects into an index (docs/FORMAT.md,
   section 8), and each ref this publish wrote is taken back exactly (``refs.RefWrite``);
8. after the commit, the objects of the versions replaced are deleted (a crash before: gc drops
   superseded versions); one whose refs stayed in place is retired (``manifests.objects.retire``:
   marked, then deleted unless a ref names it, which gc carries over);
9. a full disk at any of these steps is said as such (``writer.disk_full``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

from tailorstore.core.errors import (
    Call,
    LeaseLostError,
    LockTimeoutError,
    StepChangedError,
    StepExistsError,
    first_line,
    is_out_of_space,
)
from tailorstore.core.failpoints import failpoint
from tailorstore.core.records import (
    COMMIT,
    MAIN_RUN,
    AtomRecord,
    BlobRecord,
    FileRecord,
    LayerRecord,
    ManifestRecord,
)
from tailorstore.store.backends.base import Backend
from tailorstore.store.gc_notices import check_publication
from tailorstore.store.index.catalogue import CatalogueEdit
from tailorstore.store.lock import Fence, fence_for_follow_up
from tailorstore.store.manifests.drop_marks import being_dropped, mark_unless_claimed
from tailorstore.store.manifests.keys import SUPERSEDED, removed_marker, versions_of
from tailorstore.store.manifests.objects import check_revised, publish, retire, unpublish
from tailorstore.store.manifests.refs import RefWrite, hand_over_plain_pin, put_pin, put_tag
from tailorstore.store.packs.writer import disk_full
from tailorstore.store.repo import Repository

log = logging.getLogger("tailorstore")

THIS_MANIFEST = 0
"""A layer's ``source`` in :class:`ManifestRows` for the manifest being recorded (its id is not known
until it is inserted): the layer is stored by this manifest itself."""


@dataclass(frozen=True)
class ManifestRows:
    """A new manifest's rows, as a value. ``blobs`` were written by this operation, so their rows
    win over any known one (a blob repaired or repacked moves); ``reported_blobs`` were written by
    other hosts (a finalize's parts), so a known blob keeps its row, which its pack gave.
    ``derived_from``: the manifests these rows were read from; each must be unchanged when they
    are recorded. ``replacing``: the next version of a committed step that exists (``force``)."""

    record: ManifestRecord
    files: Sequence[FileRecord]
    atoms: Sequence[AtomRecord]
    layers: Sequence[LayerRecord]
    blobs: Sequence[BlobRecord] = ()
    reported_blobs: Sequence[BlobRecord] = ()
    packs: Sequence[tuple[str, int]] = ()
    derived_from: Sequence[ManifestRecord] = ()
    replacing: bool = False


@dataclass(frozen=True)
class Revision:
    """The next version of a manifest that exists (thinning, metrics): its record as it is to be,
    and its file and atom rows where they change (``None``: kept). Its layers never change. The
    version it replaces is ``record.object_key``; if another process replaced it meanwhile, the
    revision is refused rather than applied to what it was not read from."""

    record: ManifestRecord
    files: Sequence[FileRecord] | None = None
    atoms: Sequence[AtomRecord] | None = None
    blobs: Sequence[BlobRecord] = ()
    packs: Sequence[tuple[str, int]] = ()
    exclusive: bool = False  # made under the exclusive lock (thinning): no ref change runs beside it


@dataclass
class _Taken:
    """What one transaction did that a rollback or the commit must follow up."""

    published: list[str] = field(default_factory=list)  # object keys this host put
    superseded: list[str] = field(default_factory=list)  # object keys of the versions replaced
    forced: set[int] = field(default_factory=set)  # manifests whose tags may move from another step (--force)
    revised: list[int] = field(default_factory=list)
    expected: dict[int, str] = field(default_factory=dict)  # a revision's manifest -> the version it read
    # manifests whose refs stay on the versions they replace (a ref on an older version counts for the
    # newest): a change under the shared lock never writes a ref another host may have moved meanwhile
    in_place: dict[int, str | None] = field(default_factory=dict)  # manifest -> the tag it gives itself
    retired: list[str] = field(default_factory=list)  # versions replaced by those: deleted unless a ref names one
    ref_writes: list[RefWrite] = field(default_factory=list)  # each taken back exactly on a failure
    replaced: dict[int, str] = field(default_factory=dict)  # manifest -> the version its publication replaces
    replaces: dict[str, str] = field(default_factory=dict)  # a published key -> the version it replaces


def record_manifest(repo: Repository, *changes: ManifestRows | Revision, fence: Fence | None) -> list[int]:
    """Record ``changes`` (one manifest, or several revised together) and publish them, as one
    step that either happens whole or leaves the store as it was; returns their local ids, in order."""
    taken = _Taken()
    try:
        with repo._index.transaction() as edit:
            ids = [_insert(edit, change, taken) for change in changes]
            for manifest, change in zip(ids, changes, strict=True):
                replacing = isinstance(change, Revision) or change.replacing
                expected = taken.expected.get(manifest)
                key = publish(repo.backend, edit, manifest, fence=fence, replacing=replacing, expected=expected)
                taken.published.append(key)
                if manifest in taken.replaced:
                    taken.replaces[key] = taken.replaced[manifest]
                if expected is not None:
                    check_revised(repo.backend, key, expected)
            failpoint("after-publish")
            if fence is not None and fence.by_time:
                for manifest in ids:
                    needs = edit.referenced_blobs(manifest)
                    check_publication(repo.backend, needs, "recording the manifest", repo.size_lookup(needs))
            _write_refs(repo.backend, edit, ids, taken, fence)
    except OSError as exc:
        _adopted(_take_back(repo, taken, fence), exc)
        if is_out_of_space(exc):
            raise disk_full(repo.location) from None
        raise
    except BaseException as exc:
        _adopted(_take_back(repo, taken, fence), exc)
        raise
    unpublish(repo.backend, taken.superseded)  # after the index names the new versions
    try:  # clean-up after a durable change is never its failure: gc deletes what is left (superseded)
        retire(repo.backend, taken.retired)
    except Exception as exc:  # any backend failure: the change itself is done
        log.warning("tailorstore: the replaced version(s) stay until the next gc: %s", exc)
    return ids


def _write_refs(backend: Backend, edit: CatalogueEdit, ids: list[int], taken: _Taken, fence: Fence | None) -> None:
    """Step 6: the refs of the new manifests, each a conditional swap that can be taken back exactly,
    fenced as the put was; then the drop marks read (FORMAT.md 8.1): a gc that marked the step
    meanwhile (it planned before these refs were there) makes the whole change fail and be taken
    back, so no tag or pin a commit reports set names a step that gc goes on to drop."""
    check = (lambda: fence.check("recording the manifest")) if fence is not None else None
    named: list[str] = []
    for manifest in ids:
        record = edit.manifest(manifest)
        key = record.object_key if record is not None else None
        if record is None or key is None:
            continue
        if manifest in taken.in_place:  # refs carried stay on the version replaced; only a tag given is put
            given = taken.in_place[manifest]
            tags, pinned = ((given,) if given else ()), False
        else:
            tags, pinned = record.tags, record.pinned
        force = manifest in taken.forced
        for tag in tags:
            taken.ref_writes.append(put_tag(backend, tag, key, force=force, fence=check))
        if pinned:
            taken.ref_writes.append(put_pin(backend, key, fence=check))
        elif manifest not in taken.in_place:
            hand_over_plain_pin(backend, edit, key, fence=check)  # a branch's legacy plain pin: its own form now
        if tags or pinned:
            named.append(key)
    for key in named:
        if being_dropped(backend, key):
            raise LockTimeoutError(
                "the step was marked to drop (by a gc) or to retire (by another host's replacement of it) while "
                "it was recorded; nothing was recorded. Run it again."
            )


def _insert(edit: CatalogueEdit, change: ManifestRows | Revision, taken: _Taken) -> int:
    if isinstance(change, Revision):
        return _revise(edit, change, taken)
    for source in change.derived_from:
        _check_unchanged(edit, source)
    record = change.record
    if len(record.tags) > 1:
        raise ValueError("a new manifest gives itself one tag at most")
    given = record.tags[0] if record.tags else None
    replacing_key: str | None = None
    if change.replacing and record.origin == COMMIT:
        if (replaced := edit.commit_at(record.step, record.run)) is not None:  # its tags stay the step's
            record = replace(record, tags=tuple(sorted({*record.tags, *replaced.tags})), pinned=replaced.pinned)
            edit.delete_commit_at(record.step, record.run)
            if replaced.object_key is not None:
                taken.retired.append(replaced.object_key)
                replacing_key = replaced.object_key
        if given is not None:
            edit.drop_tag(given)  # force takes the tag, whether or not the step existed
    refuse_taken(edit, record.step, record.run, given, commit=record.origin == COMMIT)
    in_place = change.replacing and record.origin == COMMIT
    edit.add_packs(change.packs)
    edit.upsert_blobs(change.blobs)
    edit.add_blobs(change.reported_blobs)
    manifest = edit.insert_manifest(record)
    edit.insert_files(manifest, change.files)
    edit.insert_atoms(manifest, change.atoms)
    edit.insert_layers(
        manifest, [replace(x, source=manifest) if x.source == THIS_MANIFEST else x for x in change.layers]
    )
    if in_place:
        taken.in_place[manifest] = given
    if replacing_key is not None:
        taken.replaced[manifest] = replacing_key
    if change.replacing:
        taken.forced.add(manifest)
    return manifest


def _revise(edit: CatalogueEdit, change: Revision, taken: _Taken) -> int:
    record = change.record
    _check_unchanged(edit, record)
    edit.add_packs(change.packs)
    edit.upsert_blobs(change.blobs)
    if change.files is not None or change.atoms is not None:
        files = list(change.files) if change.files is not None else edit.files(record.id)
        atoms = list(change.atoms) if change.atoms is not None else edit.atoms(record.id)
        edit.replace_contents(record.id, files, atoms)
    edit.set_tier(record.id, record.tier)
    edit.set_metrics(record.id, record.metrics)
    if record.object_key is not None:
        if change.exclusive:
            taken.superseded.append(record.object_key)
        else:
            taken.expected[record.id] = record.object_key
            taken.in_place[record.id] = None
            taken.retired.append(record.object_key)
            taken.replaced[record.id] = record.object_key
    taken.revised.append(record.id)
    taken.forced.add(record.id)  # its own tags, on its next version
    return record.id


def _check_unchanged(edit: CatalogueEdit, read: ManifestRecord) -> None:
    """Rows derived from a manifest are recorded only while it is the version they were read from."""
    now = edit.manifest(read.id)
    if now is None or now.object_key != read.object_key:
        raise StepChangedError(
            f"step {read.step} was removed or replaced by another process while it was read; run it again"
        )


class TakenLookup(Protocol):
    """What the rule of taken steps and tags reads: a commit's step in its run, a tag's holder."""

    def commit_at(self, step: int, run: str) -> ManifestRecord | None: ...

    def tagged(self, tag: str) -> ManifestRecord | None: ...


def refuse_taken(index: TakenLookup, step: int, run: str, tag: str | None, *, commit: bool = True) -> None:
    """A commit's step is taken once per run, and a tag names one manifest. The publisher applies
    it in its transaction; a commit applies it early too, before it writes anything."""
    if commit and index.commit_at(step, run) is not None:
        where = "the store" if run == MAIN_RUN else f"run {run!r}"
        raise StepExistsError(
            f"step {step} is already in {where}. Commit under another ",
            Call(step="N"),
            ", or pass ",
            Call(force=True),
            " to replace it.",
        )
    if tag and index.tagged(tag) is not None:
        if commit:
            raise StepExistsError(
                f"tag {tag!r} already names a manifest; choose another tag or pass ", Call(force=True), "."
            )
        raise StepExistsError(f"tag {tag!r} already names a manifest; choose another tag")


def _take_back(repo: Repository, taken: _Taken, fence: Fence | None) -> list[tuple[str, str]]:
    """Only objects this host published are withdrawn, and only then are refs touched: a host that
    lost the put never wrote any (I2: a loser cannot delete the winner's refs). Each ref this
    publish wrote is taken back exactly (``RefWrite.take_back``: only while it holds this write,
    and to what it replaced), never rewritten from the rolled-back index, which may be stale: a
    tag another host moved meanwhile stays where it was moved.

    Then each new version is withdrawn as a drop is (``drop_marks.mark_unless_claimed``: marked,
    then the refs read), unless it stays: another host set a pin or tag naming it since it was
    published (a published object is committed to every other host; deleted with its pin, the step
    lost that reported ref and gc dropped it), or a gc that ran while this host stalled took it for
    the step's current version, carried the step's refs onto it and deleted the version it
    replaced as superseded. One a ref writer meets after the marker backs off (write, then read).

    Every request is fenced, by the change's lease while it holds, else by a new shared one
    (store/lock.py, fence_for_follow_up): sent unfenced after a lapse, a take-back's marker was cleared as stale by
    a gc that held the store alone and adopted the version, and its delete then lost the step.
    Without a lease it sends nothing and everything it published stays. Returns the versions kept,
    each with why."""
    if not taken.published:
        return []
    try:
        with fence_for_follow_up(repo, fence, "taking back a failed change") as check:
            return _withdraw(repo.backend, taken, check)
    except (LeaseLostError, LockTimeoutError) as exc:
        log.warning("tailorstore: a failed change was not taken back: %s", exc)
        return [(key, _NO_LEASE) for key in taken.published]


def _withdraw(backend: Backend, taken: _Taken, fence: Callable[[], None] | None) -> list[tuple[str, str]]:
    for write in reversed(taken.ref_writes):  # first: a ref left naming a new version is then another host's
        write.take_back(backend, fence=fence)
    own_left = any(write.holds_now(backend) for write in taken.ref_writes)
    kept: list[tuple[str, str]] = []
    for key in taken.published:
        if _adopted_by_gc(backend, taken.replaces.get(key)):
            kept.append((key, _BY_GC))
            continue
        try:
            named, mine = mark_unless_claimed(backend, [key], fence=fence, exact=True)
        except LeaseLostError:
            raise
        except Exception as exc:  # unknown: the new version stays, as a ref may name it
            log.warning("tailorstore: could not take back %s: %s", key, exc)
            kept.append((key, _UNKNOWN))
            continue
        if named:
            kept.append((key, _OWN_REFS if own_left else _BY_REF))
            continue
        if versions_of(backend, key)[1]:  # marked, then listed: a revision built on it checks the marker after its put
            kept.append((key, _REVISED))
            backend.delete_many(mine, fence=fence)  # it is an older version now, its marker a retirement's to make
            continue
        unpublish(backend, [key], fence=fence)
    return kept


_BY_GC = "a gc running meanwhile took the new version for the step's own and deleted the version it replaced"
_BY_REF = "another host pinned or tagged the new version meanwhile"
_UNKNOWN = "whether another host names the new version could not be read"
_OWN_REFS = "a tag or pin this change wrote could not be taken back"
_REVISED = "another host revised the new version meanwhile (a newer version is built on it)"
_NO_LEASE = "its lease lapsed and no new one could be had to take it back (nothing is sent without one)"


def _adopted_by_gc(backend: Backend, replaced: str | None) -> bool:
    """Whether a gc took the new version for the step's own: the version it replaced is gone, its
    marker saying superseded (gc writes that over any marker there: a killed gc's empty one stayed,
    and a take-back then deleted the step's only version). An empty marker is a removal's (``rm``, a
    retirement): the step is gone, and the new version goes too."""
    if replaced is None:
        return False
    marker = removed_marker(replaced)
    try:
        if marker is None or backend.exists(replaced):
            return False
        try:
            return backend.get(marker) == SUPERSEDED
        except FileNotFoundError:
            return True  # deleted as superseded without a marker (a gc before the markers)
    except Exception as exc:  # unknown: take the new version back, as before
        log.warning("tailorstore: could not tell whether a gc adopted %s: %s", replaced, first_line(exc))
        return False


def _adopted(kept: list[tuple[str, str]], cause: BaseException) -> None:
    """The change failed, but its new version stays (:func:`_take_back`): say so, whatever the cause."""
    if kept:
        key, why = kept[0]
        raise LeaseLostError(
            f"this change failed after its manifest was published ({cause}), but {why}, so {key} stays: the "
            "step holds what this change wrote. See ",
            Call("log"),
            ".",
        ) from cause
