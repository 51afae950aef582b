"""``tailor verify``: check that the store can hand back every manifest it holds.

Like ``restic check`` and ``git fsck``. The default pass reads the index and stats the blob
files: every blob a manifest needs has an index row and a file of the recorded size, atoms
tile their tensors, derived weights have their masters. ``--deep`` also decodes every blob
and re-hashes it. Every problem names the step, the layer and the file it affects.
Leftover temp files and orphan blobs are reported as notes: they block nothing and the
next ``tailor gc`` removes them.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

from . import codec
from .atom_reader import decode_atom
from .atoms import MASTER
from .errors import CorruptStoreError
from .paths import check_relative
from .store.records import AtomRecord, BlobRecord
from .store.repo import Repository


@dataclass
class VerifyReport:
    manifests: int = 0
    blobs_checked: int = 0
    bytes_rehashed: int = 0
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def _users(store: Repository, manifest_ids: list[int]) -> dict[str, list[str]]:
    """blob -> where it is used, as 'step S, layer L, file F' (for messages)."""
    users: dict[str, list[str]] = defaultdict(list)
    for digest, where in store.index.blob_uses(manifest_ids):
        users[digest].append(where)
    return users


def _place(where: list[str]) -> str:
    return "; ".join(where[:3]) + (f" and {len(where) - 3} more" if len(where) > 3 else "")


def verify(
    store: Repository, selector: str | None = None, *, deep: bool = False, progress: Callable[[int], None] | None = None
) -> VerifyReport:
    report = VerifyReport()
    report.problems.extend(store.index.integrity_problems())
    if selector is None:
        ids = [m.id for m in store.index.manifests()]
    else:
        ids = [store.resolve(selector)]
    report.manifests = len(ids)
    users = _users(store, ids) if ids else {}
    for manifest in ids:
        _check_structure(store, manifest, report)
    rows = {digest: store.blob(digest) for digest in sorted(users)}
    for digest, row in rows.items():
        if row is None:
            report.problems.append(f"blob {digest}: no row in the index (used by {_place(users[digest])})")
    held = store.holdings()  # every object's size from a listing, not a request per blob
    # in pack order, so that on an object store a deep check reads each pack a span at a time
    found = sorted((r for r in rows.values() if r is not None), key=lambda r: (r.pack or "", r.pack_offset or 0))
    with store.reading(found if deep else ()):
        for row in found:
            _check_blob(store, row, held.stored_bytes(row), _place(users[row.hash]), deep, report)
            if progress:
                progress(row.raw_size)
    if deep:
        rebuilt: set[tuple] = set()
        for manifest in ids:
            _check_derived(store, manifest, report, rebuilt)
    indexed = store.index.blob_hashes()
    orphans = [n for n in held.blobs if n not in indexed]
    if orphans:
        report.notes.append(f"{len(orphans)} orphan blob file(s) no manifest uses; `tailor gc` removes them")
    known_packs = set(store.index.packs())
    stray = [n for n in held.packs if n not in known_packs]
    if stray:
        report.notes.append(f"{len(stray)} pack(s) the index does not know; `tailor gc` removes them")
    temps = store.backend.leftovers()
    if temps:
        report.notes.append(f"{len(temps)} temp file(s) of interrupted commits; `tailor gc` removes them")
    return report


def _check_blob(
    store: Repository, row: BlobRecord, size: int | None, place: str, deep: bool, report: VerifyReport
) -> None:
    """``size``: how many of the blob's stored bytes its object holds, None when it is missing."""
    report.blobs_checked += 1
    if size is None:
        report.problems.append(f"blob {row.hash}: file missing (used by {place})")
        return
    if size != row.stored_size:
        report.problems.append(
            f"blob {row.hash}: file has {size} bytes, the index says {row.stored_size}; truncated (used by {place})"
        )
        return
    if deep:
        buf = bytearray(row.raw_size)
        try:
            with store.open_row(row, place) as f:
                codec.decode_into(row.codec, f, memoryview(buf), f"blob {row.hash}")
        except CorruptStoreError as exc:
            report.problems.append(f"{exc} (used by {place})")
            return
        report.bytes_rehashed += row.raw_size
        if codec.content_hash(buf) != row.hash:
            report.problems.append(f"blob {row.hash}: content does not match its hash; damaged (used by {place})")


def _check_derived(store: Repository, manifest: int, report: VerifyReport, done: set[tuple]) -> None:
    """Rebuild every derived weight from its masters and check its hash, as checkout does.

    A master atom pointed at another step's (intact) blob passes the blob checks, but its
    weight would no longer rebuild. The same weight over the same master blobs is rebuilt once.
    """
    step = store.manifest(manifest).step
    masters: dict[str, list[AtomRecord]] = defaultdict(list)
    for a in store.index.atoms(manifest, kind=MASTER):
        masters[a.param].append(a)
    for atom in sorted(store.index.atoms(manifest, derived=True), key=lambda a: a.param):
        key = (atom.blob, atom.dtype, tuple(m.blob for m in sorted(masters[atom.param], key=lambda m: m.start)))
        if key in done:
            continue
        done.add(key)
        try:
            decode_atom(store, manifest, atom, f"step {step}, layer {atom.layer}, file {atom.path}")
        except CorruptStoreError as exc:
            report.problems.append(str(exc))
        report.bytes_rehashed += atom.nbytes


def _check_structure(store: Repository, manifest: int, report: VerifyReport) -> None:
    step = store.manifest(manifest).step
    for f in store.index.files(manifest):
        try:
            check_relative(f.path)
        except Exception as exc:  # UnsafePathError; reported, not raised
            report.problems.append(f"step {step}, file {f.path!r}: {exc}")
    cursor: dict[tuple[str, int], int] = {}
    atoms = store.index.atoms(manifest)
    for a in atoms:
        key = (a.path, a.slot)
        if cursor.get(key, 0) != a.offset:
            report.problems.append(
                f"step {step}, layer {a.layer}, file {a.path}: atoms of tensor slot {a.slot} leave a gap "
                f"or overlap at element {a.offset}"
            )
        cursor[key] = a.offset + a.numel
    with_master = {a.param for a in atoms if a.kind == MASTER}
    reported: set[tuple[str, str, str]] = set()
    for a in atoms:
        if a.derived is not None and a.param not in with_master and (a.param, a.layer, a.path) not in reported:
            reported.add((a.param, a.layer, a.path))
            report.problems.append(
                f"step {step}, layer {a.layer}, file {a.path}: derived weight {a.param} "
                "has no FP32 master to be rebuilt from"
            )
