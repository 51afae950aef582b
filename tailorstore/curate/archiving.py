"""The archive tier's work on one step: each large weight quantized against the previous archived step.

Thinning (thinning.py) decides which rows a step keeps; this module turns the kept weights into
blobs of the archive codec (store/archive_codec.py). Per weight it encodes a keyframe and, where
the previous archived step of the run holds the same atom on a chain shorter than the grid's
keyframe interval, a residual against that atom as it reads back, and keeps the smaller.

Encoding is numpy and zstd, which release the GIL, so it runs on a pool of the usable cores
(``core/threads.py``); what touches the index (reading the exact weight, the base, naming the new
blob) stays on the caller's thread, which owns the SQLite connection. At most ``IN_FLIGHT_BYTES``
of exact weights wait for a worker at once, so memory stays bounded whatever the model's size.
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Protocol

from tailorstore.access.atom_reader import decode_atom
from tailorstore.core.atom_types import MASTER, WEIGHT
from tailorstore.core.errors import Call, CorruptStoreError, StoreError
from tailorstore.core.records import THIN_ARCHIVE, AtomKey, AtomRecord, BlobRecord, ManifestRecord
from tailorstore.core.tensor_ref import DTYPES
from tailorstore.core.threads import compute_threads
from tailorstore.store import archive_codec
from tailorstore.store.packs.writer import BlobWriter
from tailorstore.store.repo import BlobReader, Repository


class ArchiveHistory(Protocol):
    """The index as archiving finds the previous archived step of a run."""

    def manifests(self, run: str | None = None) -> list[ManifestRecord]: ...

    def atoms_by_key(self, manifest: int, layer: str | None = None) -> dict[AtomKey, AtomRecord]: ...


ARCHIVE_FROM = 4096  # elements: smaller weights are kept exact at the archive tier
KEYFRAME_EVERY = 16  # an archived weight's chain holds at most this many blobs before a new keyframe
IN_FLIGHT_BYTES = 256 << 20  # exact weights handed to the encoders and not yet written


@dataclass(frozen=True)
class ArchiveGrid:
    """How coarse the archive tier is: ``levels`` grid steps from 0 to a group's largest magnitude
    (each value within 1/(2 levels) of it), and a keyframe at least every ``keyframe_every`` links.
    The defaults (31 levels, a keyframe every 16) kept every archived step of the headline's 70-save
    series within 0.1% of its exact held-out loss at 20x (docs/benchmarks.md); 127 levels is
    int8-grade. Fewer levels and longer chains store less."""

    levels: int = archive_codec.DEFAULT_LEVELS
    keyframe_every: int = KEYFRAME_EVERY

    def __post_init__(self) -> None:
        if type(self.levels) is not int or not 1 <= self.levels <= 32767:
            raise StoreError(Call(archive_levels=self.levels), " is not allowed: give a whole number from 1 to 32767.")
        if type(self.keyframe_every) is not int or not 1 <= self.keyframe_every <= archive_codec.MAX_CHAIN:
            raise StoreError(
                Call(keyframe_every=self.keyframe_every),
                f" is not allowed: give a whole number from 1 to {archive_codec.MAX_CHAIN}.",
            )


def archivable(atom: AtomRecord) -> bool:
    """A weight (or the FP32 master that stands in for one) large enough for the archive codec to
    pay; smaller tensors (norms, biases) stay exact."""
    return atom.kind in (WEIGHT, MASTER) and atom.dtype in archive_codec.ITEMSIZE and atom.numel >= ARCHIVE_FROM


def store_rebuilt(writer: BlobWriter, data: memoryview, atom: AtomRecord, step: int) -> None:
    """Write a derived weight, rebuilt from its master, as a blob of its own before the master goes;
    its name must not change."""
    if writer.add(data, itemsize=DTYPES[atom.dtype].itemsize, is_float=True) != atom.blob:
        raise CorruptStoreError(f"step {step}: the rebuilt weight of {atom.param} changed its name")


def _previous_archived(history: ArchiveHistory, record: ManifestRecord) -> dict[AtomKey, AtomRecord]:
    """The atoms of the latest archived step of ``record``'s run before it: what it is quantized against."""
    earlier = [
        m
        for m in history.manifests(record.run)
        if m.tier == THIN_ARCHIVE and m.step < record.step and m.origin == record.origin
    ]
    if not earlier:
        return {}
    return history.atoms_by_key(max(earlier, key=lambda m: m.step).id)


def _chain(base: BlobRecord) -> tuple[str, ...]:
    """The bases of a blob built on ``base``: ``base``'s own chain, then ``base``."""
    if archive_codec.is_archive(base.codec):
        return (*archive_codec.parse(base.codec, base.raw_size, f"blob {base.hash}").bases, base.hash)
    return (base.hash,)


def _base(
    repo: BlobReader, base_atom: AtomRecord | None, atom: AtomRecord, grid: ArchiveGrid, where: str
) -> tuple[memoryview | None, tuple[str, ...]]:
    """What ``atom`` is quantized against: the previous archived step's same atom as it reads back,
    and the chain that makes, or (None, ()) for a keyframe: no such atom, another dtype or size,
    or a chain already at the grid's keyframe interval."""
    if base_atom is None or base_atom.dtype != atom.dtype:
        return None, ()
    base = repo.blob(base_atom.blob)
    if base is None or base.raw_size != atom.nbytes or len(chain := _chain(base)) >= grid.keyframe_every:
        return None, ()
    base_bytes = memoryview(bytearray(base.raw_size))
    repo.read_blob_into(base, base_bytes, f"{where}: its base")
    return base_bytes, chain


def _smaller(
    exact: memoryview, dtype: str, base: memoryview | None, chain: tuple[str, ...], levels: int
) -> archive_codec.Archived | None:
    """On a worker: the keyframe, or the residual on ``base`` where its payload is smaller; None
    when neither can be archived within its bound (the weight stays exact)."""
    choice = archive_codec.encode(exact, dtype, None, (), levels)
    if base is not None:
        delta = archive_codec.encode(exact, dtype, base, chain, levels)
        if delta is not None and (choice is None or len(delta.payload) < len(choice.payload)):
            choice = delta
    return choice


def archived(
    repo: Repository,
    record: ManifestRecord,
    pairs: list[tuple[AtomRecord, AtomRecord]],
    writer: BlobWriter,
    grid: ArchiveGrid,
) -> list[AtomRecord]:
    """The atom rows of ``record`` after archiving, in order. ``pairs``: each row as the manifest
    holds it and as thinning keeps it (a derived weight is read through the first, rebuilt from
    its master). Archivable rows come back naming their archived blob."""
    previous = _previous_archived(repo.view(ArchiveHistory), record)
    out: list[AtomRecord] = [atom for _, atom in pairs]
    pending: deque[tuple[int, memoryview, Future[archive_codec.Archived | None]]] = deque()
    queued = 0

    def settle_oldest() -> None:
        nonlocal queued
        index, exact, future = pending.popleft()
        queued -= len(exact)
        choice, atom = future.result(), pairs[index][1]
        if choice is not None:
            digest = writer.add_encoded(choice.raw, choice.payload, choice.spec.descriptor())
            out[index] = replace(atom, blob=digest, derived=None)
        elif atom.derived is not None:  # kept exact (not finite, or beyond int16): its master goes, so it is stored
            store_rebuilt(writer, exact, atom, record.step)
            out[index] = replace(atom, derived=None)

    with ThreadPoolExecutor(compute_threads(), thread_name_prefix="tailor-archive") as pool:
        try:
            for index, (original, atom) in enumerate(pairs):
                if not archivable(atom):
                    continue
                where = f"archiving step {record.step}, {atom.param} ({atom.kind})"
                exact = decode_atom(repo, record.id, original, where)  # a derived weight: rebuilt from its master
                base_bytes, chain = _base(repo, previous.get(atom.key()), atom, grid, where)
                while pending and queued + atom.nbytes > IN_FLIGHT_BYTES:
                    settle_oldest()
                future = pool.submit(_smaller, exact, atom.dtype, base_bytes, chain, grid.levels)
                pending.append((index, exact, future))
                queued += atom.nbytes
            while pending:
                settle_oldest()
        except BaseException:
            for _, _, future in pending:
                future.cancel()
            raise
    return out
