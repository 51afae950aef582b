"""Checkout of files that have a container: every byte written straight to its offset.

A file committed with a container (format 2) is its container's bytes with the atoms'
bytes at their recorded offsets. So checkout needs no unpickling, no torch.save and no
tensor in memory: each atom's blob is read around the page cache, decoded chunk by chunk
into a reused per-thread buffer, hashed as it streams, and written into place, on four
threads (decoders and I/O release the GIL; two compute while two wait on the disk). Writes go around the page cache too
(``store/backends/direct_io.py``), so memory stays at a few chunk buffers whatever the file size
and the final fsync has almost nothing left to flush.

Derived weights are rebuilt as their FP32 master streams by: each decoded master chunk is
rounded, written into the weight's file at the matching element and hashed in element
order, so once every file is written each derived weight is checked against its recorded
hash (a weight whose pieces came too far out of order is read back for that). A rebuilt
weight is as checked as a stored one; any mismatch fails the whole checkout.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import xxhash

from tailorstore.access.atom_reader import stream_atom
from tailorstore.access.contents import Contents
from tailorstore.core.atom_types import MASTER
from tailorstore.core.errors import Call, CorruptStoreError
from tailorstore.core.paths import safe_join
from tailorstore.core.records import COMMIT, AtomRecord, BlobRecord, FileRecord, ManifestRecord
from tailorstore.core.rounding import ROUND_FROM_MASTER, round_into
from tailorstore.core.thread_buffers import thread_buffer
from tailorstore.core.threads import decode_threads
from tailorstore.formats.dcp_items import item_windows
from tailorstore.formats.kinds import DCP, TORCH
from tailorstore.formats.torch_zip import gaps, mend_crcs, record_offsets
from tailorstore.store import codec
from tailorstore.store.backends.direct_io import PlacedWriter
from tailorstore.store.backends.posix import start_writeback
from tailorstore.store.repo import BlobReader, StepReader, damaged_blob


@dataclass
class _Target:
    path: str
    out: PlacedWriter
    where: str
    size: int
    kind: str


_EARLY_BUDGET = 64 << 20  # bytes of rounded weight held while waiting for the pieces before them
WEIGHT_ITEMSIZE = 2  # a derived weight is bf16 or fp16


class _Budget:
    """Bytes of rounded weight waiting for their predecessors, across one checkout's weights."""

    def __init__(self, limit: int) -> None:
        self.limit, self.used = limit, 0
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> bool:
        with self._lock:
            if self.used + nbytes > self.limit:
                return False
            self.used += nbytes
            return True

    def give(self, nbytes: int) -> None:
        with self._lock:
            self.used -= nbytes


@dataclass
class _Weight:
    """A derived weight: where it goes, which elements the masters have covered, and its hash so far.

    Rounded pieces are hashed in element order as they are written, so the weight is checked
    without reading it back. A piece that arrives before its predecessors (a parameter split
    across two ranks' files, decoded by two threads) waits in memory, within a global budget;
    past it, the weight is checked by reading it back from the file instead.
    """

    target: _Target
    offset: int
    dtype: str  # bfloat16 or float16 (rounding.ROUNDED_DTYPES): 2 bytes an element
    numel: int
    blob: str
    layer: str
    budget: _Budget
    atom: AtomRecord  # the derived atom, for rebuilding it when its masters are not among the files
    covered: list[tuple[int, int]] = field(default_factory=list)
    hasher: Any = field(default_factory=xxhash.xxh3_128)
    hashed: int = 0  # elements hashed, in order
    waiting: dict[int, bytes] = field(default_factory=dict)  # first element -> rounded bytes
    read_back: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)

    def feed(self, first: int, data: memoryview) -> None:
        size = WEIGHT_ITEMSIZE
        with self.lock:
            if self.read_back:
                return
            if first == self.hashed:
                self.hasher.update(data)
                self.hashed += len(data) // size
                while self.hashed in self.waiting:
                    early = self.waiting.pop(self.hashed)
                    self.budget.give(len(early))
                    self.hasher.update(early)
                    self.hashed += len(early) // size
                return
            if first > self.hashed and self.budget.take(len(data)):
                self.waiting[first] = bytes(data)
            else:
                self.read_back = True
                self.budget.give(sum(len(early) for early in self.waiting.values()))
                self.waiting.clear()

    def cover(self, start: int, numel: int) -> None:
        with self.lock:
            self.covered.append((start, numel))


def _scratch(nbytes: int) -> memoryview:
    return memoryview(thread_buffer("placement-chunk", nbytes, codec.GROUP_CHUNK))  # grows for blosc2's 16 MiB


def _rounded(piece: memoryview, dtype: str) -> memoryview:
    """The FP32 elements of ``piece`` rounded to ``dtype`` exactly as DeepSpeed does (``Tensor.to``),
    in a buffer of this thread's that the next call reuses."""
    nbytes = len(piece) // 4 * WEIGHT_ITEMSIZE
    dest = memoryview(thread_buffer("placement-rounded", nbytes, codec.GROUP_CHUNK // 2))
    round_into(piece, dtype, dest)
    return dest


def write_files(
    repo: StepReader,
    facts: ManifestRecord,
    rows: list[FileRecord],
    root: Path,
    advance: Callable[[int], None],
    threads: int | None = None,
) -> None:
    """Write every file of ``rows`` (all with a container) under ``root``, checked and fsynced.

    A derived weight whose masters are not among these files (they are in a file checked out
    by re-pickling) is rebuilt through the atom reader.
    """
    with PlacedFiles(repo, facts, rows, root) as files:
        files.place_stored(advance, threads)
        files.finish()


class PlacedFiles:
    """Files of a manifest being written in place: their containers at once, their stored atoms
    by :meth:`place_stored`, and their derived weights from whoever streams the FP32 masters.

    A checkout's masters are among its files, so placing them rounds the weights as they pass.
    A universal checkpoint and a reshard write the masters into files of their own (``fp32.pt``,
    the optimizer files at M ranks); their writers pass each master chunk through
    :meth:`passing` so that the model-states file's weights are rounded from the same decoded
    bytes, instead of the masters being read and decoded a second time (a sixth of the run).
    :meth:`finish` checks every weight against its recorded hash and rebuilds through the
    index, on the caller's thread, any that nobody fed whole.
    """

    def __init__(self, repo: StepReader, facts: ManifestRecord, rows: list[FileRecord], root: Path) -> None:
        self.store, self.manifest, self.step, self.rows = repo, facts.id, facts.step, rows
        # atoms from other steps than the containers (a composite, a merge): mend the zip CRCs
        self.mend = not (facts.origin == COMMIT and facts.exact)
        self.targets: dict[str, _Target] = {}
        self.edited: dict[str, set[str]] = {}  # path -> zip records rewritten, whose CRCs to mend
        try:
            for row in rows:
                path = safe_join(root, row.path)
                path.parent.mkdir(parents=True, exist_ok=True)
                self.targets[row.path] = _Target(
                    row.path, PlacedWriter(path, row.raw_size), f"step {facts.step}, file {row.path}",
                    row.raw_size, row.kind,
                )  # fmt: skip
            self.blobs = {b.hash: b for b in repo.view(Contents).referenced_blobs(facts.id)}
            self.atoms = _atoms(repo.view(Contents), facts.id, self.targets, self.blobs)
            for row in rows:
                _write_container(repo, row, self.targets[row.path], self.atoms[row.path])
            self.weights = _derived_weights(self.atoms, self.targets)
        except BaseException:
            self.close()
            raise

    def place_stored(self, advance: Callable[[int], None], threads: int | None = None) -> None:
        """Decode every stored atom of the files into place (a master also feeds its weights)."""
        _place_atoms(self.store, self.atoms, self.blobs, self.targets, self.weights, advance, threads)

    def feed_master(self, param: str, first: int, piece: memoryview) -> None:
        """FP32 elements ``[first, first + len(piece) // 4)`` of ``param``'s master, already
        hash-checked or about to be (an error then fails the whole write): rounded into each
        copy of its derived weight. Any thread may call it."""
        _feed(self.weights.get(param, []), first, piece)

    def passing(self, param: str, start: int, chunks: Iterable[memoryview]) -> Iterator[memoryview]:
        """``chunks``, FP32 elements of ``param``'s master from element ``start`` on, passed through
        and each fed to the weights; the range counts as covered once the last chunk has passed
        (the streams hash-check each atom after its last chunk)."""
        first = start
        for piece in chunks:
            self.feed_master(param, first, piece)
            first += len(piece) // 4
            yield piece
        self.cover_master(param, start, first - start)

    def cover_master(self, param: str, start: int, numel: int) -> None:
        """Elements ``[start, start + numel)`` of ``param``'s master have all been fed and checked."""
        for weight in self.weights.get(param, []):
            weight.cover(start, numel)

    def rewrite_record(self, path: str, suffix: str, edit: Callable[[bytes], bytes | None]) -> bool:
        """Replace the bytes of the zip record whose name ends with ``suffix`` in file ``path`` (its
        container already written) by ``edit(old)``, of the same length; the record's CRC is
        mended at :meth:`finish`. False, and nothing changed, when ``edit`` returns None."""
        target = self.targets[path]
        found = [(name, span) for name, span in record_offsets(target.out.fd).items() if name.endswith(suffix)]
        if len(found) != 1:
            return False
        name, (offset, size) = found[0]
        old = bytearray(size)
        target.out.pread_into(memoryview(old), offset)
        new = edit(bytes(old))
        if new is None or len(new) != size:
            return False
        target.out.pwrite(memoryview(new), offset)
        self.edited.setdefault(path, set()).add(name)
        return True

    def finish(self) -> None:
        """Check every derived weight, mend the CRCs, check each size, fsync and set each mode."""
        _check_weights(self.store, self.manifest, self.step, self.weights)
        for row in self.rows:
            target = self.targets[row.path]
            if self.mend and target.kind == TORCH:
                mend_crcs(target.out.fd, target.where)
            elif self.mend and target.kind == DCP:  # each tensor item is a zip of its own
                skeleton = self.store.read_blob(row.blob, f"{target.where} (skeleton)")
                for base, length in item_windows(skeleton, target.size, target.where):
                    mend_crcs(target.out.fd, target.where, base=base, length=length)
            elif row.path in self.edited:
                mend_crcs(target.out.fd, target.where, self.edited[row.path])
            if os.fstat(target.out.fd).st_size != target.size:
                raise CorruptStoreError(f"{target.where}: came out at the wrong size; run ", Call("verify"))
            os.fsync(target.out.fd)
            os.fchmod(target.out.fd, (row.mode or 0o644) & 0o777)  # never setuid, setgid or sticky

    def close(self) -> None:
        for target in self.targets.values():
            target.out.close()

    def __enter__(self) -> PlacedFiles:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _atoms(
    contents: Contents, manifest: int, targets: dict[str, _Target], blobs: dict[str, BlobRecord]
) -> dict[str, list[AtomRecord]]:
    """The atoms of the files being written, by file in file order, each checked to fit its place."""
    by_path: dict[str, list[AtomRecord]] = {path: [] for path in targets}
    for a in contents.atoms(manifest):
        if a.path not in by_path:
            continue
        target = targets[a.path]
        if a.file_offset is None or a.file_offset < 0 or a.file_offset + a.nbytes > target.size:
            raise CorruptStoreError(f"{target.where}: an atom of {a.param} has no valid place in the file")
        if a.derived is None and a.blob not in blobs:
            raise CorruptStoreError(f"{target.where}: blob {a.blob} has no row in the index; run ", Call("verify"), ".")
        if a.derived is None and blobs[a.blob].raw_size != a.nbytes:
            raise CorruptStoreError(
                f"{target.where}: blob {a.blob} holds {blobs[a.blob].raw_size} bytes, not {a.nbytes}"
            )
        by_path[a.path].append(a)
    for atoms in by_path.values():
        atoms.sort(key=lambda a: a.file_offset or 0)
    return by_path


def _write_container(repo: BlobReader, row: FileRecord, target: _Target, atoms: list[AtomRecord]) -> None:
    assert row.container is not None
    literal = repo.read_blob(row.container, f"{target.where} (container)")
    runs = gaps(target.size, [(a.file_offset or 0, a.nbytes) for a in atoms])
    if sum(length for _, length in runs) != len(literal):
        raise CorruptStoreError(
            f"{target.where}: the container holds {len(literal)} bytes where the atoms leave "
            f"{sum(length for _, length in runs)}; the index is damaged"
        )
    view = memoryview(literal)
    at = 0
    for offset, length in runs:
        target.out.pwrite(view[at : at + length], offset)
        at += length


def _derived_weights(atoms: dict[str, list[AtomRecord]], targets: dict[str, _Target]) -> dict[str, list[_Weight]]:
    """Derived weights by parameter; one parameter's weight may sit in several files (DeepSpeed's
    model states and an HF model.safetensors), and each copy is rebuilt and checked."""
    weights: dict[str, list[_Weight]] = {}
    budget = _Budget(_EARLY_BUDGET)  # per checkout: nothing held over from a failed one
    for path, rows in atoms.items():
        for a in rows:
            if a.derived is None:
                continue
            if a.derived != ROUND_FROM_MASTER or a.start != 0:
                raise CorruptStoreError(f"{targets[path].where}: unknown derivation {a.derived!r}; upgrade tailorstore")
            weights.setdefault(a.param, []).append(
                _Weight(targets[path], a.file_offset or 0, a.dtype, a.numel, a.blob, a.layer, budget, a)
            )
    return weights


def _place_atoms(
    repo: BlobReader,
    atoms: dict[str, list[AtomRecord]],
    blobs: dict[str, BlobRecord],
    targets: dict[str, _Target],
    weights: dict[str, list[_Weight]],
    advance: Callable[[int], None],
    threads: int,
) -> None:
    jobs = [(targets[path], a) for path, rows in atoms.items() for a in rows if a.derived is None]
    jobs.sort(key=lambda job: -job[1].nbytes)  # big first, so the two threads finish together
    with ThreadPoolExecutor(max_workers=decode_threads(threads), thread_name_prefix="tailor-checkout") as pool:
        futures = {
            pool.submit(_place, repo, target, a, blobs[a.blob], weights.get(a.param, []) if a.kind == MASTER else []): a
            for target, a in jobs
        }
        try:
            for future in as_completed(futures):
                future.result()
                advance(futures[future].nbytes)
        except BaseException:
            for future in futures:
                future.cancel()
            raise


def _place(repo: BlobReader, target: _Target, atom: AtomRecord, blob: BlobRecord, weights: list[_Weight]) -> None:
    where = f"{target.where}, layer {atom.layer}, {atom.param} ({atom.kind})"
    hasher = xxhash.xxh3_128()
    pos = atom.file_offset or 0
    done = 0
    if atom.dtype != "float32":
        weights = []
    for piece in repo.decoded_pieces(blob, atom.nbytes, _scratch, where):
        hasher.update(piece)
        target.out.pwrite(piece, pos)
        _feed(weights, atom.start + done // 4, piece)
        pos += len(piece)
        done += len(piece)
    if hasher.hexdigest() != atom.blob:
        raise damaged_blob(where, atom.blob)
    for weight in weights:
        weight.cover(atom.start, atom.numel)
    start_writeback(target.out.fd, atom.file_offset or 0, atom.nbytes)  # the page-cache edges


def _feed(weights: list[_Weight], first: int, piece: memoryview) -> None:
    """Round FP32 elements ``[first, ...)`` of a master into each copy of its weight, and hash them."""
    for weight in weights:
        if first + len(piece) // 4 <= weight.numel:
            rounded = _rounded(piece, weight.dtype)
            weight.target.out.pwrite(rounded, weight.offset + first * WEIGHT_ITEMSIZE)
            weight.feed(first, rounded)


def _check_weights(repo: StepReader, manifest: int, step: int, weights: dict[str, list[_Weight]]) -> None:
    """Every derived weight fully rebuilt from masters, and equal to its recorded hash."""
    for param, w in ((param, w) for param, copies in weights.items() for w in copies):
        where = f"{w.target.where}, layer {w.layer}, {param} (weight, rebuilt from its FP32 master)"
        if gaps(w.numel, w.covered):  # its masters are not among these files: round them as they stream
            pos = w.offset
            for piece in stream_atom(repo, manifest, w.atom, 0, w.numel * WEIGHT_ITEMSIZE, where):
                w.target.out.pwrite(piece, pos)
                pos += len(piece)
            continue  # stream_atom checked the weight's hash
        if not w.read_back and w.hashed == w.numel:
            if w.hasher.hexdigest() != w.blob:
                raise CorruptStoreError(f"{where}: the weight rebuilt from the master does not match its hash")
            continue
        hasher = xxhash.xxh3_128()
        nbytes = w.numel * WEIGHT_ITEMSIZE
        for at in range(0, nbytes, codec.MAX_CHUNK):
            n = min(codec.MAX_CHUNK, nbytes - at)
            buf = _scratch(n)
            w.target.out.pread_into(buf, w.offset + at)
            hasher.update(buf)
        if hasher.hexdigest() != w.blob:
            raise CorruptStoreError(f"{where}: the weight rebuilt from the master does not match its hash")
