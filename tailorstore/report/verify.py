"""Verifying: check that the store can hand back every manifest it holds.

Like ``restic check`` and ``git fsck``. The default pass reads the index and stats the blob
files: every blob a manifest needs has an index row and a file of the recorded size, atoms
tile their tensors, derived weights have their masters. ``--deep`` also decodes every blob
and re-hashes it. Every problem names the step, the layer and the file it affects.
Leftover temp files and orphan blobs are reported as notes: they block nothing and the
next ``tailor gc`` removes them.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Protocol

from tailorstore.access.atom_reader import stream_rebuilt
from tailorstore.access.contents import Contents
from tailorstore.core.atom_types import MASTER
from tailorstore.core.errors import CorruptStoreError
from tailorstore.core.object_keys import blob_key
from tailorstore.core.paths import check_relative
from tailorstore.core.progress import Progress, Silent
from tailorstore.core.records import AtomRecord, BlobRecord, BlobUse, ManifestRecord
from tailorstore.core.threads import decode_threads
from tailorstore.store import archive_codec, codec
from tailorstore.store.backends.roles import Leftovers
from tailorstore.store.repo import BlobReader, Repository, StepReader, StoreWriter


class VerifyView(Protocol):
    """The index as verify checks it against the backend."""

    def manifests(self, run: str | None = None) -> list[ManifestRecord]: ...

    files = Contents.files  # as the read path declares them
    atoms = Contents.atoms

    def blob_hashes(self, *, loose_only: bool = False) -> set[str]: ...

    def blob_uses(self, manifests: list[int]) -> list[BlobUse]: ...

    def packs(self) -> dict[str, int]: ...

    def integrity_problems(self) -> list[str]: ...


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


def _users(index: VerifyView, manifest_ids: list[int]) -> dict[str, list[str]]:
    """blob -> where it is used, as 'step S, layer L, file F' (for messages)."""
    users: dict[str, list[str]] = defaultdict(list)
    for digest, where in index.blob_uses(manifest_ids):
        users[digest].append(where)
    return users


def _place(where: list[str]) -> str:
    return "; ".join(where[:3]) + (f" and {len(where) - 3} more" if len(where) > 3 else "")


def verify(
    repo: Repository, selector: str | None = None, *, deep: bool = False, progress: Progress | None = None
) -> VerifyReport:
    """Check every manifest's blobs (``deep``: decoded and re-hashed) and the index's rows. ``progress``
    (the convention of every long operation, core/progress.py) advances by each blob's raw bytes."""
    progress = progress or Silent()
    try:
        return _verify(repo, selector, deep, progress)
    finally:
        progress.close()


def _verify(repo: StoreWriter, selector: str | None, deep: bool, progress: Progress) -> VerifyReport:
    report = VerifyReport()
    report.problems.extend(repo.view(VerifyView).integrity_problems())
    if selector is None:
        ids = [m.id for m in repo.view(VerifyView).manifests()]
    else:
        ids = [repo.resolve(selector)]
    report.manifests = len(ids)
    users = _users(repo.view(VerifyView), ids) if ids else {}
    for manifest in ids:
        _check_structure(repo, manifest, report)
    rows = {digest: repo.blob(digest) for digest in sorted(users)}
    for digest, row in rows.items():
        if row is None:
            report.problems.append(f"blob {digest}: no row in the index (used by {_place(users[digest])})")
    held = repo.holdings()  # every object's size from a listing, not a request per blob
    # in pack order, so that on an object store a deep check reads each pack a span at a time
    found = sorted((r for r in rows.values() if r is not None), key=lambda r: (r.pack or "", r.pack_offset or 0))
    progress.start(
        f"verifying {len(found)} blob(s)" + (", re-hashing them" if deep else ""), sum(r.raw_size for r in found)
    )
    with repo.reading(found if deep else ()), _checkers(decode_threads() if deep else 1) as pool:
        checks = pool.map(lambda r: _check_blob(repo, r, held.stored_bytes(r), _place(users[r.hash]), deep), found)
        for row, (problem, rehashed) in zip(found, checks, strict=True):
            report.blobs_checked += 1
            report.bytes_rehashed += rehashed
            if problem:
                report.problems.append(problem)
            progress.advance(row.raw_size)
    if deep:
        rebuilt: set[tuple] = set()
        jobs = [job for manifest in ids for job in _derived_jobs(repo, manifest, rebuilt)]
        masters = [r for blob in sorted({m for _, _, _, ms in jobs for m in ms}) if (r := repo.blob(blob))]
        with repo.reading(masters), _checkers(decode_threads()) as pool:
            checks = pool.map(lambda job: _rebuild(repo, *job[:3]), jobs)
            for (_, atom, _, _), problem in zip(jobs, checks, strict=True):
                report.bytes_rehashed += atom.nbytes
                if problem:
                    report.problems.append(problem)
    indexed = repo.view(VerifyView).blob_hashes()
    orphans = [n for n in held.blobs if n not in indexed]
    if orphans:
        report.notes.append(f"{len(orphans)} orphan blob file(s) no manifest uses; gc removes them")
    known_packs = set(repo.view(VerifyView).packs())
    stray = [n for n in held.packs if n not in known_packs]
    if stray:
        report.notes.append(f"{len(stray)} pack(s) the index does not know; gc removes them")
    temps = repo.objects(Leftovers).leftovers()
    if temps:
        report.notes.append(f"{len(temps)} temp file(s) of interrupted commits; gc removes them")
    return report


@contextmanager
def _checkers(threads: int) -> Iterator[ThreadPoolExecutor]:
    """A pool whose queued checks are cancelled when one fails outright (an unreachable server):
    the error comes at once, not after every other check has failed in turn."""
    pool = ThreadPoolExecutor(threads, thread_name_prefix="tailor-verify")
    try:
        yield pool
    except BaseException:
        pool.shutdown(wait=True, cancel_futures=True)
        raise
    finally:
        pool.shutdown(wait=True)


def _held_at(row: BlobRecord) -> str:
    """Where a blob's bytes are, for the one who repairs it: its pack and offset, or its own object."""
    if row.pack is not None:
        return f"in pack {row.pack} at byte {row.pack_offset or 0}, {row.stored_size} bytes"
    return f"the object {blob_key(row.hash)}"


def _check_blob(repo: BlobReader, row: BlobRecord, size: int | None, place: str, deep: bool) -> tuple[str | None, int]:
    """(the problem found or None, bytes re-hashed) for one blob; ``size``: how many of its stored
    bytes its object holds, None when it is missing. Run on several threads: touches no report."""
    if size is None:
        return f"blob {row.hash} ({_held_at(row)}): file missing (used by {place})", 0
    if size != row.stored_size:
        truncated = f"file has {size} bytes, the index says {row.stored_size}; truncated"
        return f"blob {row.hash}: {truncated} (used by {place})", 0
    if not deep:
        return None, 0
    try:
        codec.check_raw_size(row.raw_size, row.stored_size, f"blob {row.hash}")
    except CorruptStoreError as exc:
        return f"{exc} (used by {place})", 0
    buf = bytearray(row.raw_size)
    try:
        if archive_codec.is_archive(row.codec):  # its chain is read and checked link by link
            repo.read_blob_into(row, memoryview(buf), f"blob {row.hash}")
            return None, row.raw_size
        with repo.open_row(row, place) as f:
            codec.decode_into(row.codec, f, memoryview(buf), f"blob {row.hash}")
    except CorruptStoreError as exc:
        return f"{exc} (used by {place})", 0
    if codec.content_hash(buf) != row.hash:
        damaged = f"blob {row.hash} ({_held_at(row)}): content does not match its hash; damaged (used by {place})"
        return damaged, row.raw_size
    return None, row.raw_size


def _derived_jobs(repo: StepReader, manifest: int, done: set[tuple]) -> list[tuple[int, AtomRecord, str, tuple]]:
    """The derived weights of a manifest to rebuild from their masters and check, as checkout does:
    (manifest, atom, where, master blobs).

    A master atom pointed at another step's (intact) blob passes the blob checks, but its
    weight would no longer rebuild. The same weight over the same master blobs is rebuilt once.
    """
    step = repo.manifest(manifest).step
    masters: dict[str, list[AtomRecord]] = defaultdict(list)
    for a in repo.view(VerifyView).atoms(manifest, kind=MASTER):
        masters[a.param].append(a)
    jobs = []
    for atom in sorted(repo.view(VerifyView).atoms(manifest, derived=True), key=lambda a: a.param):
        blobs = tuple(m.blob for m in sorted(masters[atom.param], key=lambda m: m.start))
        key = (atom.blob, atom.dtype, blobs)
        if key in done:
            continue
        done.add(key)
        jobs.append((manifest, atom, f"step {step}, layer {atom.layer}, file {atom.path}", blobs))
    return jobs


def _rebuild(repo: StepReader, manifest: int, atom: AtomRecord, where: str) -> str | None:
    """Rebuild one derived weight a chunk at a time (its hash is checked after the last); the problem or None."""
    try:
        for _ in stream_rebuilt(repo, manifest, atom, where):
            pass
    except CorruptStoreError as exc:
        return str(exc)
    return None


def _check_structure(repo: StepReader, manifest: int, report: VerifyReport) -> None:
    step = repo.manifest(manifest).step
    for f in repo.view(VerifyView).files(manifest):
        try:
            check_relative(f.path)
        except Exception as exc:  # UnsafePathError; reported, not raised
            report.problems.append(f"step {step}, file {f.path!r}: {exc}")
    cursor: dict[tuple[str, int], int] = {}
    atoms = repo.view(VerifyView).atoms(manifest)
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
