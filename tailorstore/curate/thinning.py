"""Retention tiers: thin an old step to what evaluation and merging need instead of dropping it.

A step costs 14 bytes a parameter whole, but evaluating or averaging it needs only its weights
(2 bytes a parameter in bf16) or its FP32 master (4). ``tailor gc --keep-last 3 --thin weights``
keeps the last three steps whole (resumable) and thins every other step the rules would have
dropped:

- ``master`` keeps the FP32 master and every file but the optimizer states' moments: the atoms
  of DeepSpeed's optimizer-states files other than ``master`` go. Derived bf16 weights stay
  derived (their masters are kept).
- ``weights`` keeps what the model files hold (model states, ``model.safetensors``): the
  weights, buffers and the files themselves. A weight that was derived from its master becomes
  a blob of its own first (rebuilt and hash-checked, so its name does not change), because the
  master goes. A parameter the model files hold no weight of (ZeRO 3 saves keep none) keeps its
  FP32 master instead, the only copy of its values. Optimizer-states files whose atoms all go
  are dropped from the manifest.
- ``archive`` keeps what ``weights`` keeps, but stores each weight of 4096 elements
  or more lossily (archiving.py, store/archive_codec.py): quantized against the same weight of the previous
  archived step of the run, as that step reads back. A step is about 50x smaller than raw at
  the default grid (docs/benchmarks.md); it exports and averages within the grid's bound.

A DCP ``.distcp`` file or a plain ``torch.save`` training state holds parameters and optimizer
state side by side: at every tier its moment atoms go (exp_avg, exp_avg_sq, momentum) and its
parameters stay, an FP32 parameter (FSDP keeps them so) as the master it is.

A thinned manifest is recorded again with its tier (a new object version, as ``--force``
writes one): every target's :class:`~tailorstore.store.publish.Revision` goes to
``record_manifest`` at once, so all of them take their next version or none does, and the old
objects are deleted after the index commits. It exports and averages; it
does not check out, since what it would write could not resume training.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import PurePosixPath

from tailorstore.access.atom_reader import decode_atom
from tailorstore.access.contents import Contents
from tailorstore.core.atom_types import EXP_AVG, EXP_AVG_SQ, MASTER, WEIGHT
from tailorstore.core.errors import Call, StoreError
from tailorstore.core.progress import Silent
from tailorstore.core.records import (
    THIN_ARCHIVE,
    THIN_MASTER,
    TIERS,
    AtomRecord,
    FileRecord,
    ManifestRecord,
)
from tailorstore.curate.archiving import ArchiveGrid, archivable, archived, store_rebuilt
from tailorstore.formats import deepspeed as ds
from tailorstore.formats.kinds import DCP, TORCH
from tailorstore.store.failed_writes import cleaned_up_on_failure
from tailorstore.store.lease import LeaseHandle
from tailorstore.store.lock import LockHandle
from tailorstore.store.packs.writer import BlobWriter
from tailorstore.store.publish import Revision, record_manifest
from tailorstore.store.repo import Repository

# optimizer state beside the parameters in one file (DCP, plain saves): what every tier drops
MOMENT_KINDS = (EXP_AVG, EXP_AVG_SQ, "momentum_buffer", "max_exp_avg_sq", "sum", "square_avg")


def check_tier(tier: str) -> str:
    if tier not in TIERS:
        raise StoreError(Call(thin=tier), f" is not a tier; use one of {', '.join(TIERS)} (thinnest last).")
    return tier


def thinner(tier: str, than: str | None) -> bool:
    """Whether ``tier`` keeps less than ``than`` (None: a whole manifest)."""
    return TIERS.index(tier) > (-1 if than is None else TIERS.index(than))


@dataclass(frozen=True)
class ThinnedContents:
    files: list[FileRecord]
    atoms: list[AtomRecord]
    materialize: list[AtomRecord]  # derived weights that become blobs of their own (their masters go)

    def stored_atoms(self) -> list[AtomRecord]:
        """The atom rows as recorded after thinning: the materialized weights no longer derived."""
        keys = {_where(a) for a in self.materialize}
        return [replace(a, derived=None) if _where(a) in keys else a for a in self.atoms]

    def hashes(self) -> set[str]:
        """What the thinned manifest still needs: its files' blobs and every atom stored after thinning."""
        atoms = {a.blob for a in self.stored_atoms() if a.derived is None}
        return atoms | {f.blob for f in self.files} | {f.container for f in self.files if f.container}


def _where(atom: AtomRecord) -> tuple[str, int, int]:
    return (atom.path, atom.slot, atom.offset)


def _optimizer_paths(files: list[FileRecord]) -> set[str]:
    return {f.path for f in files if ds.is_optim_states(PurePosixPath(f.path).name)}


def _mixed_paths(files: list[FileRecord]) -> set[str]:
    """Files that hold a model's parameters and its optimizer's state side by side: DCP's
    ``.distcp`` files and plain ``torch.save`` training states (not DeepSpeed's own files)."""

    def plain(name: str) -> bool:
        return not (ds.is_model_states(name) or ds.is_optim_states(name))

    return {f.path for f in files if f.kind == DCP or (f.kind == TORCH and plain(PurePosixPath(f.path).name))}


def thinned_contents(files: list[FileRecord], atoms: list[AtomRecord], tier: str) -> ThinnedContents:
    """Pure: the rows a manifest keeps at ``tier`` (the module docstring says which and why)."""
    optimizer = _optimizer_paths(files)
    mixed = _mixed_paths(files)
    atoms = [a for a in atoms if not (a.path in mixed and a.kind in MOMENT_KINDS)]  # moments go at every tier
    if tier == THIN_MASTER:
        kept = [a for a in atoms if a.path not in optimizer or a.kind == MASTER]
        materialize: list[AtomRecord] = []
    else:  # weights
        weighted = {a.param for a in atoms if a.kind == WEIGHT and a.numel and a.path not in optimizer}
        kept = [a for a in atoms if a.path not in optimizer or (a.kind == MASTER and a.param not in weighted)]
        # derived weights the tier keeps exactly become blobs; archived ones are rebuilt, then archived
        materialize = [a for a in kept if a.derived is not None and not (tier == THIN_ARCHIVE and archivable(a))]
    still = {a.path for a in kept}
    return ThinnedContents([f for f in files if f.path not in optimizer or f.path in still], kept, materialize)


def contents_of(contents: Contents, manifest: int, tier: str) -> ThinnedContents:
    return thinned_contents(contents.files(manifest), contents.atoms(manifest), tier)


def thin(
    repo: Repository,
    targets: list[ManifestRecord],
    tier: str,
    lock: LockHandle | LeaseHandle,
    *,
    grids: dict[int, ArchiveGrid] | None = None,
) -> int:
    """Thin ``targets`` to ``tier`` under the caller's exclusive lock; returns the stored bytes written
    (the weights materialized or archived). Blobs no longer needed are left for gc's deletion that
    follows. Archiving goes one step at a time, oldest first, each recorded before the next: a step
    is quantized against the previous archived step of its run, which must be in the index.
    ``grids``: each archived manifest's grid (by id; the default grid for one not named)."""
    if tier == THIN_ARCHIVE:
        ordered = sorted(targets, key=lambda r: r.step)
        return sum(_thin(repo, [r], tier, lock, (grids or {}).get(r.id, ArchiveGrid())) for r in ordered)
    return _thin(repo, targets, tier, lock, None)


def _thin(
    repo: Repository,
    targets: list[ManifestRecord],
    tier: str,
    lock: LockHandle | LeaseHandle,
    grid: ArchiveGrid | None,  # the archive tier's; None for the others
) -> int:
    if not targets:
        return 0
    writer = BlobWriter(repo)
    plans: dict[int, ThinnedContents] = {}
    with cleaned_up_on_failure(repo, writer, lock, Silent()):
        for record in targets:
            contents = contents_of(repo.view(Contents), record.id, tier)
            for atom in contents.materialize:
                data = decode_atom(repo, record.id, atom, f"thinning step {record.step}")
                store_rebuilt(writer, data, atom, record.step)
            if grid is not None:
                pairs = list(zip(contents.atoms, contents.stored_atoms(), strict=True))
                contents = ThinnedContents(contents.files, archived(repo, record, pairs, writer, grid), [])
            plans[record.id] = contents
        new_blobs = writer.finish()
    revisions = [
        Revision(replace(record, tier=tier), plans[record.id].files, plans[record.id].stored_atoms(), exclusive=True)
        for record in targets
    ]
    revisions[0] = replace(revisions[0], blobs=new_blobs, packs=writer.new_packs())
    record_manifest(repo, *revisions, fence=lock)  # every step's next version, or none
    return sum(b.stored_size for b in new_blobs)
