"""Manifests as immutable objects in the backend, so the SQLite index is only a cache.

A manifest counts as committed once its object exists: the object is written create-only
after every blob it names is durable, inside the index transaction that records it (a
failed put rolls the transaction back; a failed index commit deletes the object). Each
object holds everything the index knows about that manifest: its row, its files, atoms
and layers, and the rows of every blob it references. Layers name their source manifest
by object key, not by the local id, which differs from host to host.

Keys (docs/FORMAT.md):

- ``manifests/<run>/step-<step:020d>-v<n>.json.zst``: a commit; ``--force`` writes v(n+1)
  and then deletes v(n); a reader takes the highest version of a step;
- ``manifests/<run>/merge-<token>.json.zst``: a merge;
- ``refs/tags/<tag>``: the object key a tag names (mutable; tag bytes outside
  ``[A-Za-z0-9._-]`` are written ``=XX``);
- ``refs/pins/<manifest object name>``: present while the manifest is pinned;
- ``refs/runs/<run>``: a run created by name, with its base (create-only JSON);
- ``refs/retention/<run>``: the retention a run carries, which ``gc`` without rules applies (mutable JSON).

:func:`sync` brings the index up to date with the backend (new manifests of other hosts,
manifests another host's gc dropped, tags and pins); :func:`rebuild` recreates it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace
from typing import Any, Protocol

import zstandard

from tailorstore.core import metrics
from tailorstore.core.errors import (
    Call,
    CorruptStoreError,
    ObjectExistsError,
    StepChangedError,
    StepExistsError,
    StoreError,
)
from tailorstore.core.failpoints import failpoint
from tailorstore.core.run_names import RUN_NAME
from tailorstore.store.backends.base import Backend, check_key
from tailorstore.store.codec import decompress_bounded
from tailorstore.store.index._index import Index
from tailorstore.store.index.records import (
    ATOM_COLUMNS,
    COMMIT,
    DOC_BLOB_COLUMNS,
    FILE_COLUMNS,
    MAIN_RUN,
    MANIFEST_DOC_FIELDS,
    THIN_ARCHIVE,
    AtomRecord,
    BlobRecord,
    FileRecord,
    LayerRecord,
    ManifestRecord,
    RecordError,
    RunRecord,
    check_rows,
    from_table,
    record,
    to_table,
)
from tailorstore.store.lock import Fence
from tailorstore.store.packs.pack import pack_names
from tailorstore.store.packs.pack_sync import packs_agree, reconcile_packs


class RefSource(Protocol):
    """What writing a manifest's refs reads of the index: the manifests, and each one's record.
    Operations hand their role view (it names these two), or the index itself."""

    def manifest(self, manifest: int) -> ManifestRecord | None: ...

    def manifests(self, run: str | None = None) -> list[ManifestRecord]: ...


log = logging.getLogger("tailorstore")

MANIFEST_PREFIX = "manifests/"
TAG_PREFIX = "refs/tags/"
PIN_PREFIX = "refs/pins/"
RUN_PREFIX = "refs/runs/"
RETENTION_PREFIX = "refs/retention/"
DOC_VERSION = 2  # 2 adds the manifest's run; version 1 objects are all of run 'main'
THINNED_DOC_VERSION = 3  # a thinned manifest: a reader that does not know tiers must not check it out
# an archived manifest: a reader that does not know archive chains must refuse it, or its gc would
# take the chains' links for dead (FORMAT.md 7.2.1)
ARCHIVED_DOC_VERSION = 4
READABLE_DOC_VERSIONS = (1, 2, 3, 4)
_COMMIT_KEY = re.compile(r"manifests/([A-Za-z0-9._-]+)/step-(\d{20})-v(\d+)\.json\.zst")
_TAG_KEY = re.compile(r"refs/tags/(?:[A-Za-z0-9._-]|=[0-9A-F]{2})+")  # what tag_key writes
# A removed commit manifest leaves this empty object behind, so that its version is never taken again
# (a cache that still holds the removed manifest's rows under that key would take a new manifest
# under the same key for the old one, and gc would delete the new one's blobs as unreferenced).
_REMOVED_KEY = re.compile(r"manifests/([A-Za-z0-9._-]+)/step-(\d{20})-v(\d+)\.removed")
_MERGE_KEY = re.compile(r"manifests/([A-Za-z0-9._-]+)/merge-[0-9a-f]+\.json\.zst")
# Columns of the tables inside a manifest object, in their order there (docs/FORMAT.md 3.1).
_LAYER_COLUMNS = ("layer", "source_step", "raw_bytes", "stored", "change")


def tag_key(tag: str) -> str:
    escaped = "".join(
        chr(b) if chr(b).isascii() and (chr(b).isalnum() or chr(b) in "._-") else f"={b:02X}" for b in tag.encode()
    )
    return check_key(TAG_PREFIX + escaped)


def tag_of_key(key: str) -> str:
    escaped = key[len(TAG_PREFIX) :]
    return re.sub(rb"=([0-9A-F]{2})", lambda m: bytes([int(m.group(1), 16)]), escaped.encode()).decode()


def pin_key(object_key: str) -> str:
    """``refs/pins/<name>`` for run main's manifests (as pins always were, so older readers see them),
    ``refs/pins/<run>/<name>`` for another run's. A pin named by the key's last segment alone was
    shared by every run's step of that number: committing step 8 in a branch deleted main's pin of
    step 8 (section 8, I2)."""
    run, name = run_of_key(object_key), object_key.rsplit("/", 1)[-1]
    return PIN_PREFIX + name if run == MAIN_RUN else check_key(f"{PIN_PREFIX}{run}/{name}")


def _pinned_by(pin: str, by_name: dict[str, list[str]]) -> list[str]:
    """The manifest keys a pin object pins (the reading rule of FORMAT.md 3.3): a run's own form pins
    that run's manifest; the plain form pins main's manifest of that name, or, where main has none,
    the other runs' (a branch's pin written before pins named their run)."""
    rest = pin[len(PIN_PREFIX) :]
    if "/" in rest:
        run, _, name = rest.partition("/")
        return [k for k in by_name.get(name, []) if run_of_key(k) == run]
    keys = by_name.get(rest, [])
    mains = [k for k in keys if run_of_key(k) == MAIN_RUN]
    return mains or keys


def listed_manifest_keys(backend: Backend) -> list[str]:
    """Every manifest object the backend lists (versions and merges; not the removal markers)."""
    return [k for k in backend.list(MANIFEST_PREFIX) if is_manifest_key(k)]


def is_manifest_key(key: str) -> bool:
    return bool(_COMMIT_KEY.fullmatch(key) or _MERGE_KEY.fullmatch(key))


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


def key_version(key: str) -> int:
    """The version in a commit manifest's key (0 for a merge's)."""
    match = _COMMIT_KEY.fullmatch(key)
    return int(match.group(3)) if match else 0


def step_versions(backend: Backend, run: str, step: int) -> tuple[dict[int, str], set[int]]:
    """One listing of a commit step's objects: its versions (version -> key) and the versions
    whose removal marker is there (removed, or being removed or dropped)."""
    versions: dict[int, str] = {}
    removed: set[int] = set()
    for key in backend.list(f"{MANIFEST_PREFIX}{run}/"):  # a backend lists by folder
        if (m := _COMMIT_KEY.fullmatch(key)) and int(m.group(2)) == step:
            versions[int(m.group(3))] = key
        elif (m := _REMOVED_KEY.fullmatch(key)) and int(m.group(2)) == step:
            removed.add(int(m.group(3)))
    return versions, removed


def versions_of(backend: Backend, key: str) -> tuple[list[str], list[str]]:
    """The other listed versions of a commit manifest's step: (older than ``key``, newer)."""
    match = _COMMIT_KEY.fullmatch(key)
    if match is None:
        return [], []
    versions, _ = step_versions(backend, match.group(1), int(match.group(2)))
    own = int(match.group(3))
    return [k for v, k in sorted(versions.items()) if v < own], [k for v, k in sorted(versions.items()) if v > own]


def step_changed(step: int, run: str) -> StepChangedError:
    where = "" if run == MAIN_RUN else f" of run {run!r}"
    return StepChangedError(
        f"step {step}{where} was removed or replaced by another host while this ran; nothing was changed. See ",
        Call("log"),
        ", and run it again if the step is still there.",
    )


def check_revised(backend: Backend, key: str, expected: str) -> None:
    """A revision, right after its create-only put of ``key``: the version it was read from
    (``expected``) must still be there, unmarked, and the newest but its own. A removal marks a
    step's versions before it deletes them and then lists the step's newer versions (``rm``), so
    of a removal and a revision racing, at least one sees the other and fails (write, then read
    the other side: FORMAT.md 8.1, I7)."""
    match = _COMMIT_KEY.fullmatch(key)
    assert match is not None
    versions, removed = step_versions(backend, match.group(1), int(match.group(2)))
    before = key_version(expected)
    others = [v for v in versions if v != key_version(key)]
    if before not in versions or before in removed or max(others, default=0) != before:
        raise step_changed(int(match.group(2)), match.group(1))


def removed_marker(key: str) -> str | None:
    """The object that reserves a removed commit manifest's version (none for a merge: its key is random)."""
    return key.removesuffix(".json.zst") + ".removed" if _COMMIT_KEY.fullmatch(key) else None


def _step_exists(record: ManifestRecord) -> StepExistsError:
    where = "the store" if record.run == MAIN_RUN else f"run {record.run!r}"
    return StepExistsError(
        f"step {record.step} is already in {where}: another host committed it first. Nothing was replaced; "
        "commit under another step, or pass ",
        Call(force=True),
        " to replace it.",
    )


def run_of_key(key: str) -> str:
    """The run a manifest object belongs to, from its key."""
    return key[len(MANIFEST_PREFIX) :].split("/", 1)[0]


def _doc_version(tier: str | None) -> int:
    if tier is None:
        return DOC_VERSION
    return ARCHIVED_DOC_VERSION if tier == THIN_ARCHIVE else THINNED_DOC_VERSION


def document(index: Index, manifest: int) -> dict[str, Any]:
    """Everything the index holds about one manifest, as a self-contained JSON document."""
    record = index.manifest(manifest)
    assert record is not None
    layers = index.layers(manifest)
    layers.sort(key=lambda x: x.layer)
    source_keys = index.object_keys({x.source for x in layers if x.source != manifest})
    layer_rows = to_table(layers, _LAYER_COLUMNS)["rows"]
    return {
        "tailorstore_manifest": _doc_version(record.tier),
        "manifest": dict(zip(MANIFEST_DOC_FIELDS, to_table([record], MANIFEST_DOC_FIELDS)["rows"][0], strict=True)),
        "files": to_table(index.files(manifest), FILE_COLUMNS),
        "atoms": to_table(index.atoms(manifest), ATOM_COLUMNS),
        "layers": {
            "columns": (*_LAYER_COLUMNS, "source"),
            "rows": [
                [*row, None if x.source == manifest else source_keys.get(x.source)]  # gone: its own (FORMAT.md 7)
                for x, row in zip(layers, layer_rows, strict=True)
            ],
        },
        "blobs": to_table(index.referenced_blobs(manifest), DOC_BLOB_COLUMNS),
    }


def encode(doc: dict[str, Any]) -> bytes:
    return zstandard.ZstdCompressor(level=3).compress(json.dumps(doc, separators=(",", ":")).encode())


@dataclass(frozen=True)
class ManifestDocument:
    """A manifest object read back, every row a checked record (``records.record``): a damaged
    object is refused as a whole, naming itself, before any of it reaches the index."""

    manifest: ManifestRecord  # without tag, pin or local id: the refs and the index hold those
    files: list[FileRecord]
    atoms: list[AtomRecord]
    blobs: list[BlobRecord]
    layers: list[tuple[LayerRecord, str | None]]  # each with the object key of its source (None: itself)


def decode(data: bytes, key: str) -> ManifestDocument:
    try:
        doc = json.loads(decompress_bounded(data, 1 << 31))
    except (zstandard.ZstdError, ValueError, RecursionError) as exc:
        raise CorruptStoreError(f"manifest object {key} is damaged ({exc}); restore it from a backup") from None
    if not isinstance(doc, dict) or doc.get("tailorstore_manifest") not in READABLE_DOC_VERSIONS:
        raise CorruptStoreError(f"manifest object {key} is not a manifest this tailorstore reads; upgrade tailorstore")
    try:
        typed = _typed_document(doc, key)
    except RecordError as exc:
        raise CorruptStoreError(
            f"manifest object {key} is damaged ({exc}); restore it from a backup, or delete it "
            "(its step is then gone) and run ",
            Call("rebuild_index"),
        ) from None
    _check_named(typed, key)
    return typed


def _check_named(doc: ManifestDocument, key: str) -> None:
    """A commit's manifest object holds the step its name says (its run is checked with the rows). The
    name is what every host lists and orders by (versions, refs); an object copied or renamed under
    another step's name (by anyone with access to the bucket) would otherwise be recorded as a step
    it is not."""
    named = _COMMIT_KEY.search(key)
    if named is not None and doc.manifest.step != int(named.group(2)):
        raise CorruptStoreError(
            f"manifest object {key} holds step {doc.manifest.step} of run {doc.manifest.run!r}, where its name "
            f"says step {int(named.group(2))} of run {named.group(1)!r}: it was copied or changed behind the "
            "store's back. Restore it from a backup, or delete it (its step is then gone) and run ",
            Call("rebuild_index"),
        )


@dataclass(frozen=True)
class LayerRow:
    """A layer as a manifest object writes it: its source named by object key (None: the manifest itself)."""

    layer: str
    source_step: int
    raw_bytes: int
    stored: bool
    change: float | None
    source: str | None = None


def _typed_document(doc: dict[str, Any], key: str) -> ManifestDocument:
    m = doc.get("manifest")
    if not isinstance(m, dict):
        raise RecordError("it holds no manifest row")
    m = {**m, "run": m.get("run", run_of_key(key)), "tier": m.get("tier")}  # version 1 objects have neither
    m["metrics"] = m.get("metrics")  # objects written before metrics have none
    manifest = record(ManifestRecord, {c: m[c] for c in MANIFEST_DOC_FIELDS if c in m})
    try:
        metrics.decode(manifest.metrics)
    except metrics.MetricError as exc:
        raise RecordError(f"metrics: {exc}") from None
    if not 0 <= manifest.step < 1 << 63:  # what the index (SQLite) and every selector can hold
        raise RecordError(f"step {manifest.step}")
    for name in ("raw_bytes", "new_bytes", "world_size", "zero_stage"):
        value = getattr(manifest, name)
        if value is not None and not 0 <= value < 1 << 62:
            raise RecordError(f"{name} {value}")
    if manifest.run != run_of_key(key):  # FORMAT.md: a reader MUST refuse it
        raise RecordError(f"it says run {manifest.run!r}, but its key is of run {run_of_key(key)!r}")
    files = from_table(doc.get("files"), FileRecord)
    atoms = from_table(doc.get("atoms"), AtomRecord)
    blobs = from_table(doc.get("blobs"), BlobRecord)
    check_rows(files, atoms, blobs)
    layers = [
        (LayerRecord(row.layer, 0, row.source_step, row.raw_bytes, row.stored, row.change), row.source)
        for row in from_table(doc.get("layers"), LayerRow)
    ]  # each source's local id is set at import
    return ManifestDocument(manifest, files, atoms, blobs, layers)


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
    caller writes its refs (:func:`write_refs`) only after this returns.

    Refs come after the object, never before (attack finding 4): two hosts that publish one step
    choose the same key, so a loser that had written refs first and took them back would delete
    the winner's tag and pin, which name that same key. Now a loser has written nothing to take
    back, and gets :class:`StepExistsError`. A crash between the object and its refs leaves a
    step whose older version's refs still count for it (:func:`current_of`). ``fence`` (the
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


def carry_refs(backend: Backend, index: RefSource, superseded: list[str]) -> None:
    """Before gc deletes superseded versions: their steps' refs, written for the current versions
    (which the index has from :func:`current_of`), so a pin or tag left on an old version outlives it."""
    if not superseded:
        return
    current = current_of(k for k in backend.list(MANIFEST_PREFIX) if is_manifest_key(k))
    heirs = {current[k] for k in superseded if k in current}
    ids = [m.id for m in index.manifests() if m.object_key in heirs]
    write_refs(backend, index, ids)


# -- gc's drops against ref changes: each side writes, then reads the other's (FORMAT 8.1) ------------


def drop_marker(key: str) -> str:
    """The object that says a manifest is being dropped (for a commit manifest, the same object
    that reserves its version once it is gone: :func:`removed_marker`)."""
    return key.removesuffix(".json.zst") + ".removed"


def mark_dropping(backend: Backend, keys: Iterable[str], *, fence: Callable[[], None] | None = None) -> list[str]:
    """gc, before it deletes anything of these manifests: their drop markers, each put create-only;
    the markers this call created (one already there was another gc's, and stays)."""
    created = []
    for key in keys:
        try:
            backend.put(drop_marker(key), b"", create_only=True, fence=fence)
            created.append(drop_marker(key))
        except ObjectExistsError:
            continue
    return created


def claimed(backend: Backend, keys: Iterable[str]) -> list[str]:
    """gc, after :func:`mark_dropping`: those of ``keys`` that a pin or a tag names now. A ref
    written before the marker is seen here; one written after sees the marker and backs off."""
    wanted = set(keys)
    found = {key for key in wanted if backend.exists(pin_key(key))}
    found.update(wanted & _listed_tags(backend, warn=False).keys())
    return sorted(found)


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


def retire(backend: Backend, keys: Iterable[str]) -> list[str]:
    """After a revision or a ``--force`` that wrote no refs of its own: delete the versions it
    replaced, unless a ref names one. Their refs count for the new version while they are listed
    (:func:`current_of`), so a ref another host set or moved meanwhile is never written over; one
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
    return backend.exists(drop_marker(key))


def unpublish(
    backend: Backend, keys: Iterable[str | None], *, fence: Callable[[], None] | None = None, marked: bool = False
) -> None:
    """Delete manifest objects (and their pins) that are no longer wanted, in as few requests as
    the backend allows (a gc may drop hundreds). Should the request fail half-way, a pin left
    without its manifest pins nothing (pins are read only for manifests that exist), and a
    manifest left without its pin is one the next gc finds unkept again. Each commit manifest's
    version is reserved first (:func:`removed_marker`), so no later manifest takes its key."""
    wanted = [k for k in keys if k]
    for key in wanted:
        if not marked and (marker := removed_marker(key)) is not None:  # ``marked``: mark_unless_claimed put it
            backend.put(marker, b"", fence=fence)
    backend.delete_many([k for key in wanted for k in (key, pin_key(key))], fence=fence)


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
        if record.tag:
            written.append(_put_tag(backend, record, fence))
        if record.pinned:
            written.append(_put_pin(backend, record, fence))
        else:
            _hand_over_plain_pin(backend, index, record.object_key)
    return written


def put_tag(backend: Backend, index: RefSource, manifest: int, *, fence: Callable[[], None] | None = None) -> None:
    """The manifest's tag object, as the index says (one request)."""
    record = index.manifest(manifest)
    if record is not None and record.object_key is not None and record.tag:
        _put_tag(backend, record, fence)


def write_pin(backend: Backend, index: RefSource, manifest: int, *, fence: Callable[[], None] | None = None) -> None:
    """The manifest's pin object, put or deleted as the index says; nothing else of its refs."""
    record = index.manifest(manifest)
    if record is None or record.object_key is None:
        return
    if record.pinned:
        _put_pin(backend, record, fence)
    else:
        _unpin(backend, index, record.object_key)


def _put_tag(backend: Backend, record: ManifestRecord, fence: Callable[[], None] | None) -> str:
    key = tag_key(str(record.tag))
    backend.put(key, str(record.object_key).encode(), fence=fence)
    return key


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
    older version counts for the newest (:func:`current_of`; a revision leaves it there), and one
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
        holders = _by_name(m.object_key for m in index.manifests() if m.object_key)
        if key not in _pinned_by(plain, holders) or not backend.exists(plain):
            return
        pin = plain  # main has no manifest of that name: the plain pin was this branch's
    for other in index.manifests():
        if other.pinned and other.object_key and other.object_key != key and other.object_key.endswith("/" + name):
            backend.put(pin_key(other.object_key), b"")
    backend.delete(pin)


def drop_tag(backend: Backend, tag: str, *, fence: Callable[[], None] | None = None) -> None:
    backend.delete_many([tag_key(tag)], fence=fence)


def import_document(index: Index, key: str, doc: ManifestDocument, ids: dict[str, int]) -> int:
    """Insert one manifest object's rows; ``ids`` maps object keys already in the index to local ids."""
    # where a blob is, the packs decide: a known blob keeps its row
    index.add_blobs(doc.blobs)
    manifest = index.insert_manifest(replace(doc.manifest, object_key=key))
    ids[key] = manifest
    index.insert_files(manifest, doc.files)
    index.insert_atoms(manifest, doc.atoms)
    # A source gc dropped since: the layer's atoms are this manifest's own rows anyway (FORMAT.md 7).
    layers = [replace(layer, source=ids.get(source, manifest) if source else manifest) for layer, source in doc.layers]
    index.insert_layers(manifest, layers)
    return manifest


def _order(keys: list[str], docs: dict[str, ManifestDocument]) -> list[str]:
    """Sources before the manifests that inherit from them (sources are always older)."""
    return sorted(keys, key=lambda k: (docs[k].manifest.created_at, k))


def current_of(keys: Iterable[str]) -> dict[str, str]:
    """Every manifest key listed -> the key readers take for its step: the highest version of a
    commit's step (older ones are left by a --force or a thinning interrupted before it deleted
    them), a merge's own key. A tag or pin object that names an older version counts for the
    current one, so a replacement that crashed before it wrote its refs keeps the step's tag
    and pin (docs/FORMAT.md 8, I2)."""
    best: dict[tuple[str, int], tuple[int, str]] = {}
    slots: dict[str, tuple[str, int]] = {}
    out: dict[str, str] = {}
    for key in keys:
        match = _COMMIT_KEY.fullmatch(key)
        if match is None:
            if _MERGE_KEY.fullmatch(key):
                out[key] = key
            continue
        slot = (match.group(1), int(match.group(2)))
        slots[key] = slot
        version = int(match.group(3))
        if slot not in best or best[slot][0] < version:
            best[slot] = (version, key)
    out.update({key: best[slot][1] for key, slot in slots.items()})
    return out


def _current_versions(keys: Iterable[str]) -> set[str]:
    """Of several versions of one step, the highest (see :func:`current_of`)."""
    return set(current_of(keys).values())


def superseded(backend: Backend) -> list[str]:
    """Manifest objects an interrupted ``--force`` or thinning left behind: older versions of a step
    whose newer version is the one readers take. Only gc, under the exclusive lock, deletes them."""
    keys = [k for k in backend.list(MANIFEST_PREFIX) if is_manifest_key(k)]
    current = _current_versions(keys)
    return sorted(k for k in keys if k not in current)


def _read_if_held(backend: Backend, key: str) -> Any:
    try:
        return decode(backend.get(key), key)
    except FileNotFoundError:
        return None


@dataclass
class _Listing:
    """The backend's manifests, refs and packs beside what the index holds, at one moment."""

    packs: set[str]
    present: set[str]
    indexed: dict[str, int]
    tags: dict[str, str]
    pins: set[str]
    listed_runs: dict[str, RunRecord]
    known_runs: dict[str, RunRecord]
    indexed_refs: dict[int, tuple[str | None, bool]]  # (tag, pinned) as the index has them

    @classmethod
    def take(cls, backend: Backend, index: Index) -> _Listing:
        packs = set(pack_names(backend))
        current = current_of(k for k in backend.list(MANIFEST_PREFIX) if is_manifest_key(k))
        present = set(current.values())
        records = index.manifests()
        known_runs = index.created_runs()
        return cls(
            packs=packs,
            present=present,
            indexed={r.object_key: r.id for r in records if r.object_key is not None},
            tags=_current_refs(_listed_tags(backend), current),
            pins={pin_key(current.get(key, key)) for key in _pinned_keys(backend, current)},
            listed_runs=_listed_runs(backend, known_runs),
            known_runs=known_runs,
            indexed_refs={r.id: (r.tag, r.pinned) for r in records if r.object_key in present},
        )

    @property
    def gone(self) -> list[int]:
        return [mid for key, mid in self.indexed.items() if key not in self.present]

    @property
    def new(self) -> list[str]:
        return sorted(self.present - self.indexed.keys())

    def listed_refs(self) -> dict[int, tuple[str | None, bool]]:
        """(tag, pinned) of each indexed manifest as the backend's ref objects say."""
        return {
            mid: (self.tags.get(key), pin_key(key) in self.pins)
            for key, mid in self.indexed.items()
            if key in self.present
        }

    def agrees(self, index: Index, *, locked: bool) -> bool:
        return (
            not self.gone
            and not self.new
            and self.indexed_refs == self.listed_refs()
            and self.listed_runs == self.known_runs
            and packs_agree(index, self.packs, locked=locked)
        )


def sync(backend: Backend, index: Index, *, locked: bool, rebuilding: bool = False) -> tuple[int, int]:
    """Import the manifests the backend holds and the index lacks, drop those it no longer holds,
    take tags, pins and runs from the backend, and place blobs as the packs say (fully only when
    ``locked``: the caller holds the store lock; store/packs/pack_sync.py says why). Returns (imported,
    dropped). ``rebuilding`` (a new index, built alone) passes over a pack whose trailer is damaged,
    with a warning, rather than building nothing: ``verify`` then names the blobs it held.

    Reads first and writes only when something differs, so opening an unchanged store takes no
    write lock: one LIST of manifests, refs and packs, and one GET per tag. When something
    differs, everything is listed again inside the index's write transaction: a commit, a gc or
    a thinning of this store changes its manifest objects inside its own index transaction, so a
    listing taken inside ours cannot fall between their object and their rows (a listing taken
    before could: a thinned step's new version not listed yet, its rows already naming it, would
    have looked dropped).
    """
    if _Listing.take(backend, index).agrees(index, locked=locked):
        return 0, 0
    with index.transaction():
        seen = _Listing.take(backend, index)
        # Another host's gc may still delete a manifest between the listing and the read: what is
        # gone by then is treated as never listed.
        docs = {k: doc for k in seen.new if (doc := _read_if_held(backend, k)) is not None}
        new = [k for k in seen.new if k in docs]
        gone = seen.gone
        index.delete_manifests(gone)
        ids = {k: v for k, v in seen.indexed.items() if k in seen.present}
        for key in _order(new, docs):
            if not index.has_object(key):
                import_document(index, key, docs[key], ids)
        # after the imports: a manifest's blob rows say where the blob was when it was committed
        reconcile_packs(backend, index, seen.packs, locked=locked, skip_damaged=rebuilding)
        index.set_refs({mid: (seen.tags.get(key), pin_key(key) in seen.pins) for key, mid in ids.items()})
        index.set_runs(seen.listed_runs.values())
    return len(new), len(gone)


def run_key(name: str) -> str:
    return check_key(RUN_PREFIX + name)


def check_run_name(name: str) -> str:
    if not RUN_NAME.fullmatch(name) or name in (".", ".."):
        raise StoreError(f"run name {name!r} is not allowed: use 1 to 100 letters, digits, '-', '_' or '.'.")
    return name


def create_run(backend: Backend, run: RunRecord) -> None:
    """Write a run's object, create-only: two hosts creating one name cannot both win."""
    doc = {"tailorstore_run": 1, "created_at": run.created_at, "base": run.base}
    try:
        backend.put(run_key(run.name), json.dumps(doc).encode(), create_only=True)
    except ObjectExistsError:
        raise StepExistsError(f"run {run.name!r} already exists; ", Call("runs"), " shows the runs.") from None


def _odd_key(key: str, what: str) -> None:
    """A key under refs/ that no tailorstore writes: someone with access to the bucket put it there.
    It names nothing, so it is left alone with a warning, not fatal to every command of the store."""
    log.warning("tailorstore: ignoring %r: no %s object of tailorstore has such a key", key[:200], what)


def _listed_runs(backend: Backend, known: dict[str, RunRecord]) -> dict[str, RunRecord]:
    """The run objects, read only when the index does not know them yet (they never change)."""
    out: dict[str, RunRecord] = {}
    for key in backend.list(RUN_PREFIX):
        name = key[len(RUN_PREFIX) :]
        if not RUN_NAME.fullmatch(name) or name in (".", ".."):
            _odd_key(key, "run")
            continue
        if name in known:
            out[name] = known[name]
            continue
        try:
            doc = json.loads(backend.get(key))
            fields = {"name": check_run_name(name), "created_at": doc["created_at"], "base": doc.get("base")}
            out[name] = record(RunRecord, fields)
        except FileNotFoundError:
            continue
        except (ValueError, KeyError, TypeError, StoreError) as exc:
            raise CorruptStoreError(f"run object {key} is damaged ({exc}); restore it from a backup") from None
    return out


def _current_refs(tags: dict[str, str], current: dict[str, str]) -> dict[str, str]:
    """Tags by the current version of the step each names. Of several tags left on versions of one
    step, the one naming the newest version holds it: a tag is written on the version current when
    it is set, so that one was set last (a step holds one tag). Ranking by "names the current
    version" alone let a tag a later revision had replaced come back once a newer revision left
    neither on the current one, and gc then deleted the version the winner named (seed 150)."""
    out: dict[str, str] = {}
    for key, tag in sorted(tags.items(), key=lambda kv: (_version_of(kv[0]), kv[1])):
        out[current.get(key, key)] = tag
    return out


def _version_of(key: str) -> int:
    match = _COMMIT_KEY.fullmatch(key)
    return int(match.group(3)) if match else 0


def _pinned_keys(backend: Backend, current: dict[str, str]) -> list[str]:
    """The manifest keys the pin objects pin (:func:`_pinned_by`)."""
    by_name = _by_name(current)
    return [key for pin in backend.list(PIN_PREFIX) for key in _pinned_by(pin, by_name)]


def _by_name(keys: Iterable[str]) -> dict[str, list[str]]:
    by_name: dict[str, list[str]] = {}
    for key in keys:
        by_name.setdefault(key.rsplit("/", 1)[-1], []).append(key)
    return by_name


def _listed_tags(backend: Backend, *, warn: bool = True) -> dict[str, str]:
    """Manifest object key -> tag, from the tag objects. Bytes that are not UTF-8 name no key, and are
    ignored as any tag naming a key that does not exist is (docs/FORMAT.md 3.3), not a decode error
    that stopped every command of the store."""
    out: dict[str, str] = {}
    for key, target in _tag_targets(backend, warn=warn):
        if warn and not _names_a_manifest(target) and key not in _WARNED:
            _WARNED.add(key)
            log.warning(
                "tailorstore: tag object %s is damaged: it names no manifest object, so its tag keeps no step "
                "(gc refuses to run until it is set again or removed)",
                key[:200],
            )
        out[target] = tag_of_key(key)
    return out


def _tag_targets(backend: Backend, *, warn: bool) -> Iterator[tuple[str, str]]:
    """(tag object key, what its bytes say) for every tag object of a key tailorstore writes."""
    for key in backend.list(TAG_PREFIX):
        if not _TAG_KEY.fullmatch(key):
            if warn:
                _odd_key(key, "tag")
            continue
        try:  # a key is short: a huge object is damaged whatever it ends with
            yield key, backend.get(key, 0, 4096).decode(errors="replace")
        except FileNotFoundError:  # untagged while we listed
            continue


_WARNED: set[str] = set()  # each damaged tag object is named once a process


def _names_a_manifest(target: str) -> bool:
    return bool(_COMMIT_KEY.fullmatch(target) or _MERGE_KEY.fullmatch(target))


def damaged_tags(backend: Backend) -> list[str]:
    """The tags whose objects name no manifest object at all (not a step since removed: bytes that
    are no key). gc refuses to run while there is one: it cannot tell which step that tag keeps
    (docs/FORMAT.md 8.1, I2)."""
    return [tag_of_key(key) for key, target in _tag_targets(backend, warn=False) if not _names_a_manifest(target)]


def write_retention(backend: Backend, run: str, rules: dict[str, Any] | None) -> None:
    """Set (or with None, clear) the retention rules ``run`` carries."""
    key = check_key(RETENTION_PREFIX + check_run_name(run))
    if rules is None:
        backend.delete(key)
    else:
        backend.put(key, json.dumps({"tailorstore_retention": 1, **rules}).encode())


def read_retentions(backend: Backend) -> dict[str, dict[str, Any]]:
    """Run -> the retention rules it carries (keep_last, keep_every, thin)."""
    out: dict[str, dict[str, Any]] = {}
    for key in backend.list(RETENTION_PREFIX):
        name = key[len(RETENTION_PREFIX) :]
        if not RUN_NAME.fullmatch(name) or name in (".", ".."):
            _odd_key(key, "retention")
            continue
        try:
            doc = json.loads(backend.get(key))
        except FileNotFoundError:
            continue
        except ValueError as exc:
            raise CorruptStoreError(f"retention object {key} is damaged ({exc}); set it again") from None
        if not isinstance(doc, dict) or doc.pop("tailorstore_retention", None) != 1:
            raise CorruptStoreError(f"retention object {key} is not one this tailorstore reads; upgrade tailorstore")
        out[key[len(RETENTION_PREFIX) :]] = doc
    return out
