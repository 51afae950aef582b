"""Committing: turn one checkpoint directory into blobs plus one manifest.

Call order (docs/FORMAT.md section 8, Commit), and who makes each call:

1. ``commit`` (any process, or each rank through ``integrations/common/distributed.py``): read and check
   every input file, each through one descriptor, its identity recorded; bad input is refused
   before anything is written;
2. take the store lock shared (a lease on a remote store) and bring the index up to date under it;
3. decide which layers to store (the policy) and which to inherit from earlier steps;
4. write the blobs the store does not have yet into one batch, made durable together, then check
   that no input changed under the commit;
5. record: one index transaction and the manifest object's create-only put, through
   ``store/publish.record_manifest`` (the commit point; on a leased store, gc's notices are read
   after it, ``store/gc_notices.py``); or, for a part (``part=True``), the part object's
   create-only put, read against gc's notices the same way, and the index left unchanged
   (``ingest/finalize.py`` records the step once every part is in);
6. release the lock; then (``delete_after_commit``) check that every blob is there and delete the
   save, as clean-up that never fails the commit.

Until step 5, no reader can see the step; blobs written before a crash are orphans that gc removes.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Protocol

from tailorstore.access import structure
from tailorstore.access.changes import ChangeTerms, LayerChange, change_terms, masters_by_layer, stored_pieces
from tailorstore.core import atom_types as A
from tailorstore.core.errors import BadCheckpointError, Call, StepExistsError, StoreError
from tailorstore.core.failpoints import failpoint, operation
from tailorstore.core.layers import STATE, sort_key
from tailorstore.core.policies import CommitFacts, decide, needs_changes
from tailorstore.core.progress import Progress, Silent
from tailorstore.core.records import (
    COMMIT,
    AtomKey,
    AtomRecord,
    BlobRecord,
    FileRecord,
    LayerRecord,
    ManifestRecord,
    StoredLayer,
)
from tailorstore.core.rounding import ROUND_FROM_MASTER
from tailorstore.core.save_bound import bounded
from tailorstore.core.step_rules import check_tag
from tailorstore.formats.deepspeed import ModelInfo
from tailorstore.formats.kinds import RAW
from tailorstore.formats.layout import (
    ACCELERATE,
    DCP_FOLDER,
    DEEPSPEED,
    DEEPSPEED_TAG,
    HF_TRAINER,
    MEGATRON,
    CheckpointLayout,
    detect,
)
from tailorstore.formats.reader import ReadFile, read_checkpoint, write_order
from tailorstore.formats.source import CHUNK, InputFile, check_unchanged
from tailorstore.ingest.commit_options import CommitOptions, CommitResult, PartPlan
from tailorstore.ingest.derive import RoundedMasters, is_derivable_weight
from tailorstore.ingest.finalize import missing_pieces
from tailorstore.ingest.pieces_ahead import PiecesAhead, Prepared, prepare, read_helpers
from tailorstore.store import parts
from tailorstore.store.backends.roles import Editor
from tailorstore.store.failed_writes import cleaned_up_on_failure, remove_unindexed
from tailorstore.store.gc_notices import check_publication
from tailorstore.store.lease import LeaseHandle
from tailorstore.store.lock import LockHandle
from tailorstore.store.manifests.runs import check_run_name
from tailorstore.store.packs.writer import BlobWriter
from tailorstore.store.parts import Part
from tailorstore.store.publish import THIS_MANIFEST, ManifestRows, record_manifest, refuse_taken
from tailorstore.store.repo import Repository, StepReader, check_step


class CommitHistory(Protocol):
    """The index as a commit plans one: the run's history to inherit layers from, and what is taken."""

    def commit_at(self, step: int, run: str) -> ManifestRecord | None: ...

    def commits_before(self, step: int, run: str) -> int: ...

    def layer_history(self, before_step: int, run: str) -> list[StoredLayer]: ...

    def layers(self, manifest: int) -> list[LayerRecord]: ...

    def atoms_by_key(self, manifest: int, layer: str | None = None) -> dict[AtomKey, AtomRecord]: ...

    def count_atoms(self, manifest: int, layer: str, kind: str) -> int: ...

    def by_object_key(self, key: str) -> ManifestRecord | None: ...

    def tagged(self, tag: str) -> ManifestRecord | None: ...


@dataclass
class Inheritance:
    manifest: int
    step: int
    source: int
    source_step: int
    atoms: dict[AtomKey, AtomRecord]


def check_options(options: CommitOptions) -> None:
    """Refuse values that would commit something no selector reaches, or that the codec cannot take."""
    if options.step is not None:
        check_step(options.step)
    if not 1 <= options.level <= 22:
        raise StoreError(Call(level=options.level), " is not allowed: zstd levels run from 1 to 22 (1 is the default).")
    if options.tag:
        check_tag(options.tag)
    check_run_name(options.run)
    if options.part and (options.policy.name != "full" or options.tag):
        raise StoreError(
            "a commit of a part stores every layer and takes no tag: drop ",
            Call(policy="..."),
            " and ",
            Call(tag="..."),
            " (tag the step once ",
            Call("finalize", "step=N"),
            " recorded it).",
        )


def step_of(options: CommitOptions, layout: CheckpointLayout, files: list[ReadFile]) -> int:
    if options.step is not None:
        return options.step
    if layout.step is not None:  # from a folder's name or trainer_state.json: any size of number
        return check_step(layout.step)
    for f in files:
        if isinstance(f.meta.get("global_steps"), int):
            return check_step(f.meta["global_steps"])
    raise BadCheckpointError(
        f"{layout.committed}: cannot tell which step this checkpoint is; pass ", Call(step="N"), "."
    )


def inheritance(
    history: CommitHistory, step: int, layers: frozenset[str], run: str, base: ManifestRecord | None
) -> dict[str, Inheritance]:
    """For each layer, the newest earlier committed step of the run that has it, with its atoms
    by key; then the run's base (the step it branched from), which is older than all of them."""
    found: dict[str, Inheritance] = {}
    stored = history.layer_history(step, run)
    if base is not None:
        stored += [StoredLayer(base.step, x) for x in history.layers(base.id)]
    for at_step, x in stored:
        if x.layer in layers and x.layer != STATE and x.layer not in found:
            found[x.layer] = Inheritance(x.manifest, at_step, x.source, x.source_step, {})
    return found


def load_inherited_atoms(history: CommitHistory, inherit: Inheritance, layer: str) -> None:
    inherit.atoms.update(history.atoms_by_key(inherit.manifest, layer))


def inherited_from(history: CommitHistory, inherited: Mapping[str, tuple[str, str, int]]) -> dict[str, Inheritance]:
    """Where each inherited layer comes from, in this host's index: a rank-parallel plan names each
    layer's holder and source by object key (the same on every host), as (holder, source, source
    step), and each rank looks up its own ids by them. Their atoms are not loaded here."""
    out: dict[str, Inheritance] = {}
    for layer, (holder_key, source_key, source_step) in inherited.items():
        holder, source = (
            history.by_object_key(holder_key),
            history.by_object_key(source_key),
        )
        if holder is None or source is None:
            raise StoreError(f"layer {layer} is inherited from {holder_key}, which this store no longer holds")
        out[layer] = Inheritance(holder.id, holder.step, source.id, source_step, {})
    return out


def planned_sources(repo: StepReader, plan: PartPlan, layers: Iterable[str]) -> dict[str, Inheritance]:
    """A rank's view of where the plan's inherited layers come from, their atoms loaded."""
    wanted = {}
    for layer in layers:
        if layer not in plan.inherited:
            raise StoreError(f"the plan of this rank-parallel commit says nothing of layer {layer}")
        wanted[layer] = plan.inherited[layer]
    history = repo.view(CommitHistory)
    out = inherited_from(history, wanted)
    for layer, inherit in out.items():
        load_inherited_atoms(history, inherit, layer)
    return out


def plan_document(plan: PartPlan) -> dict:
    """The plan as a part object carries it (docs/FORMAT.md, section 8)."""
    return {
        "policy": plan.policy,
        "stored": sorted(plan.stored, key=sort_key),
        "inherited": {layer: list(found) for layer, found in sorted(plan.inherited.items())},
        "changes": dict(sorted(plan.changes.items())),
    }


@dataclass
class Scan:
    """What the validating pass learns. Files keep their entries (meta tensors with file offsets,
    no data) so that writing needs no second unpickling."""

    files: list[ReadFile] = field(default_factory=list)
    layers: frozenset[str] = frozenset()
    weights: dict[str, tuple] = field(default_factory=dict)  # low-precision weights: param -> (dtype, numel)
    structure: dict[str, int] = field(default_factory=dict)  # param -> elements (structure.from_segments)
    infos: dict[str, ModelInfo] = field(default_factory=dict)
    layer_bytes: dict[str, int] = field(default_factory=dict)  # raw bytes of each layer, over every file


def scan_checkpoint(layout: CheckpointLayout, trust_pickles: bool, files: list[str] | None = None) -> Scan:
    """Read and check every file (or ``files``), one at a time, before anything is written."""
    scan = Scan()
    layers: set[str] = set()
    for f in read_checkpoint(layout, trust_pickles=trust_pickles, files=files, infos=scan.infos):
        for entry in f.entries:
            itemsize = entry.tensor.element_size()
            for seg in entry.segments:
                layers.add(seg.layer)
                scan.layer_bytes[seg.layer] = scan.layer_bytes.get(seg.layer, 0) + seg.numel * itemsize
                if is_derivable_weight(entry, seg):
                    scan.weights[seg.param] = (entry.dtype_name, seg.numel)
        scan.files.append(f)
    scan.layers = frozenset(layers)
    scan.structure = structure.from_segments([s for f in scan.files for e in f.entries for s in e.segments])
    return scan


def _measure_changes(repo: StepReader, layout: CheckpointLayout, scan: Scan, sources: dict[str, Inheritance]) -> dict:
    """Relative change of each layer's FP32 master since the version an earlier step holds, file by file."""
    by_path = {f.path: f for f in scan.files}
    terms = {path: file_change_terms(repo, by_path[path], sources) for path in write_order(layout)}
    return combine_changes(repo.view(CommitHistory), [terms[path] for path in write_order(layout)], sources)


def file_change_terms(repo: StepReader, f: ReadFile, sources: Mapping[str, Inheritance]) -> dict[str, ChangeTerms]:
    """One file's terms of each inheritable layer's change (a rank measures only its own files)."""
    out: dict[str, ChangeTerms] = {}
    with f.open() as src:
        for layer, pieces in masters_by_layer(f, src).items():
            if layer in sources:
                before = stored_pieces(repo, sources[layer].manifest, layer, keys=set(pieces))
                out[layer] = change_terms(pieces, before)
        src.check()
    return out


def combine_changes(
    history: CommitHistory, per_file: list[dict[str, ChangeTerms]], sources: Mapping[str, Inheritance]
) -> dict[str, float]:
    """The files' terms summed in write order, as one pass over every file sums them; a layer counts
    only where every master piece of its source was matched."""
    totals: dict[str, LayerChange] = {}
    for terms in per_file:
        for layer, found in terms.items():
            totals.setdefault(layer, LayerChange()).add_terms(found)
    expected = {
        layer: history.count_atoms(src.manifest, layer, A.MASTER) for layer, src in sources.items()
    }
    return {layer: t.value() for layer, t in totals.items() if t.pieces == expected.get(layer) and t.matched}


def ages_of(history: CommitHistory, sources: dict[str, Inheritance], commits_before: int, run: str) -> dict[str, int]:
    """Commits since each inheritable layer was last stored (one query per distinct source step)."""
    before = {
        step: history.commits_before(step, run)
        for step in {src.source_step for src in sources.values()}
    }
    return {layer: commits_before - before[src.source_step] for layer, src in sources.items()}


def detect_input(repo: StepReader, ckpt_dir: Path, part: bool = False) -> CheckpointLayout:
    """The checkpoint's layout, refused when a file it would commit lies inside the store: a store
    kept inside an HF Trainer's checkpoint folder had its own index (changing as the commit wrote
    it) recorded as files of the step."""
    layout = detect(Path(ckpt_dir), part=part)
    root = layout.root.resolve()
    for inside in repo.local_folders():
        if inside != root and root not in inside.parents:
            continue
        rel = inside.relative_to(root).as_posix()
        if rel == "." or any(f == rel or f.startswith(f"{rel}/") for f in layout.files):
            raise BadCheckpointError(
                f"{ckpt_dir}: the store {inside} lies inside this checkpoint, whose files would include the "
                "store's own. Keep the store outside the checkpoint folders."
            )
    return layout


def commit_checkpoint(
    repo: Repository,
    ckpt_dir: Path,
    options: CommitOptions | None = None,
    progress: Progress | None = None,
) -> CommitResult:
    options = options or CommitOptions()
    check_options(options)
    layout = detect_input(repo, Path(ckpt_dir), part=options.part)
    return commit_layout(repo, layout, str(Path(ckpt_dir).resolve()), options, progress)


def commit_layout(
    repo: Repository,
    layout: CheckpointLayout,
    source: str,
    options: CommitOptions,
    progress: Progress | None = None,
) -> CommitResult:
    """Commit the files of ``layout`` (a folder on disk, or a memory folder the DCP writer filled);
    ``source`` is what the step records it came from.

    The call order: scan the files (before any lock); lock shared and sync; decide which layers
    this step stores and where the others come from (:func:`_decide`); write the stored layers'
    blobs, each hashed and encoded from one copy; record the manifest (the commit point)."""
    progress = progress or Silent()
    began = time.perf_counter()
    check_options(options)
    scan = scan_checkpoint(layout, options.trust_pickles)
    step = step_of(options, layout, scan.files)
    if not options.part:
        refuse_incomplete(layout, scan.files)

    with (
        operation("part" if options.part else "commit"),
        bounded(f"{'part' if options.part else 'commit'} of step {step}"),
        repo.lock(exclusive=False, timeout=options.lock_timeout, progress=progress) as lock,
    ):
        # What other hosts recorded or dropped before this lock was taken: inheritance must not
        # name a manifest (and blobs) another host's gc removed since this store was opened.
        repo.refresh(lock)
        if options.part:
            return commit_part(repo, source, layout, scan, step, options, lock, progress, began)
        decision = _decide(repo, layout, scan, step, options)
        history = repo.view(CommitHistory)
        for layer in scan.layers - decision.stored:
            load_inherited_atoms(history, decision.sources[layer], layer)
        writer = BlobWriter(repo, level=options.level, threads=options.threads)
        with cleaned_up_on_failure(repo, writer, lock, progress):
            plan, new_blobs = _write_checked(
                layout, scan, options, decision.stored, decision.sources, writer, progress
            )
        rows = _commit_rows(layout, scan, step, source, options, decision, plan, new_blobs, writer)
        try:
            [manifest] = record_manifest(repo, rows, fence=lock)  # the commit point
        except BaseException:
            if lock.try_exclusive():  # e.g. a full disk under SQLite: leave no orphans behind
                remove_unindexed(repo, writer, lock)
            raise
    layers, stored, sources = scan.layers, decision.stored, decision.sources
    return CommitResult(
        step=step,
        manifest=int(manifest),
        files=len(plan.files),
        atoms=len(plan.atoms),
        raw_bytes=rows.record.raw_bytes,
        new_blobs=len(new_blobs),
        new_bytes=rows.record.new_bytes,
        derived_bytes=plan.derived_bytes,
        seconds=time.perf_counter() - began,
        stored_layers=sorted(stored, key=sort_key),
        inherited_layers={layer: sources[layer].source_step for layer in sorted(layers - stored, key=sort_key)},
        changes=decision.changes,
    )


@dataclass(frozen=True)
class _Decision:
    """Which layers a commit stores, and where each other one comes from (as the index is now)."""

    stored: frozenset[str]
    sources: dict[str, Inheritance]
    changes: dict[str, float]
    read_from: dict[int, ManifestRecord]


def _decide(repo: StepReader, layout: CheckpointLayout, scan: Scan, step: int, options: CommitOptions) -> _Decision:
    """Under the lock: refuse another model or a taken step, find each layer's inheritance, and let
    the policy choose what to store (measuring the layers' change where it needs it)."""
    run = options.run
    base = repo.run_base(run)
    history = repo.view(CommitHistory)
    if not options.force:
        structure.refuse_other_model(repo.view(structure.ModelShape), scan.structure, run, base, layout.kind)
        refuse_taken(history, step, run, options.tag or None)
    sources = inheritance(history, step, scan.layers, run, base)
    read_from = {m: repo.manifest(m) for m in {i.manifest for i in sources.values()}}  # as they are now
    commits_before = history.commits_before(step, run) + (base is not None)
    adaptive = needs_changes(options.policy)
    changes = _measure_changes(repo, layout, scan, sources) if adaptive else {}
    ages = ages_of(history, sources, commits_before, run) if adaptive else {}
    facts = CommitFacts(
        scan.layers, commits_before, frozenset(sources), changes if adaptive else None, scan.layer_bytes, ages
    )
    return _Decision(decide(options.policy, facts), sources, changes, read_from)


def _commit_rows(
    layout: CheckpointLayout,
    scan: Scan,
    step: int,
    source: str,
    options: CommitOptions,
    decision: _Decision,
    plan: _Plan,
    new_blobs: list[BlobRecord],
    writer: BlobWriter,
) -> ManifestRows:
    """The manifest's rows: the step's record, its files and atoms, each layer's source."""
    layers, stored, sources = scan.layers, decision.stored, decision.sources
    facts = _facts(scan.files)
    inherited = sorted({sources[layer].manifest for layer in layers - stored})
    record = ManifestRecord(
        step=step,
        origin=COMMIT,
        created_at=time.time(),
        layout=layout.kind,
        ds_tag=layout.ds_tag,
        zero_stage=facts.get("zero_stage"),
        world_size=facts.get("world_size"),
        policy=json.dumps(options.policy.as_json()),
        exact=stored >= layers,
        raw_bytes=sum(f.size for f in scan.files),
        new_bytes=sum(b.stored_size for b in new_blobs),
        source=source,
        run=options.run,
        tags=(options.tag,) if options.tag else (),
        metrics=options.metrics,
    )
    layer_rows = [
        LayerRecord(
            layer,
            THIS_MANIFEST if layer in stored else sources[layer].source,
            step if layer in stored else sources[layer].source_step,
            plan.layer_bytes.get(layer, 0),
            layer in stored,
            decision.changes.get(layer),
        )
        for layer in layers
    ]
    return ManifestRows(
        record,
        plan.files,
        plan.atoms,
        layer_rows,
        blobs=new_blobs,  # a repaired blob (rewritten because its object was missing) moves
        packs=writer.new_packs(),
        derived_from=[decision.read_from[m] for m in inherited],
        replacing=options.force,  # the replaced step keeps its tag and pin, unless a new tag is given
    )


def _write_checked(
    layout: CheckpointLayout,
    scan: Scan,
    options: CommitOptions,
    stored: frozenset[str],
    sources: dict[str, Inheritance],
    writer: BlobWriter,
    progress: Progress,
    checked_weights: frozenset[tuple[str, str]] = frozenset(),
) -> tuple[_Plan, list[BlobRecord]]:
    """Write the blobs, then take the last look at every input (a change after a file's pass
    is refused too), then make the blobs durable."""
    rounded = RoundedMasters(scan.weights if options.derive_weights else {}, checked_weights)
    plan = write_files(layout, scan, stored, sources, writer, rounded, progress, readers=read_helpers(writer.threads))
    for f in scan.files:
        assert f.identity is not None
        check_unchanged(f.where, f.identity)
    return plan, writer.finish()


def refuse_incomplete(layout: CheckpointLayout, files: list[ReadFile]) -> None:
    """A whole commit must hold the whole save, as finalize requires of its parts together: every
    rank's optimizer states for the world size the model states name (and for ZeRO-3 every rank's
    model states). One node's share of a save, committed as the step (a killed job's staged save,
    recovered on one node), was recorded as if it were whole, and resumed from nowhere."""
    if layout.kind not in (DEEPSPEED, DEEPSPEED_TAG, DCP_FOLDER, MEGATRON, HF_TRAINER, ACCELERATE):
        return
    facts = _facts(files)
    missing = missing_pieces(layout.kind, files, facts.get("world_size"), facts.get("zero_stage"))  # type: ignore[arg-type]
    if missing:
        raise BadCheckpointError(
            f"{layout.committed}: this save is incomplete: it lacks {'; '.join(missing)}. Commit a save that "
            "finished on every rank, or each host's share of it with ",
            Call("commit", "DIR", part=True),
            " and then finalize.",
        )


def _facts(files: list[ReadFile]) -> dict[str, int]:
    """Step, ZeRO stage and world size, as the first file that says each one says it."""
    facts: dict[str, int] = {}
    for f in files:
        facts.update({k: v for k, v in f.meta.items() if k not in facts})
    return facts


def commit_part(
    repo: Repository,
    source: str,
    layout: CheckpointLayout,
    scan: Scan,
    step: int,
    options: CommitOptions,
    lock: LockHandle | LeaseHandle,
    progress: Progress,
    began: float,
    checked_weights: frozenset[tuple[str, str]] = frozenset(),
    elsewhere: frozenset[str] = frozenset(),
) -> CommitResult:
    """Write this host's files' blobs, then one part object naming them; no manifest yet.

    Every layer is stored, unless ``options.plan`` (a rank-parallel commit's decision, made once
    from every rank's survey) says which: the other layers' pieces are then inherited as a
    single-process commit inherits them. Weights are derived where this part holds their
    masters too, or where the ranks holding them checked them (``checked_weights``). Blobs in
    ``elsewhere`` are written by another rank's part of the same commit. The part object is
    the commit point of a part.
    """
    if repo.view(CommitHistory).commit_at(step, options.run) is not None and not options.force:
        raise StepExistsError(f"step {step} is already in the store; a part of it cannot be added any more.")
    stored, sources = scan.layers, {}
    if options.plan is not None:
        stored = options.plan.stored & scan.layers
        sources = planned_sources(repo, options.plan, scan.layers - stored)
    writer = BlobWriter(repo, level=options.level, threads=options.threads, elsewhere=elsewhere)
    with cleaned_up_on_failure(repo, writer, lock, progress):
        plan, new_blobs = _write_checked(
            layout, scan, options, stored, sources, writer, progress, checked_weights=checked_weights
        )
        written = {b.hash: b for b in new_blobs}
        needed = {f.blob for f in plan.files} | {f.container for f in plan.files if f.container}
        needed |= {a.blob for a in plan.atoms if a.derived is None}
        blobs = [written.get(h) or repo.blob(h) for h in sorted(needed)]
        part = Part(
            step=step,
            run=options.run,
            layout=layout.kind,
            ds_tag=layout.ds_tag,
            facts=_facts(scan.files),
            source=f"{socket.gethostname()}:{source}",
            created_at=time.time(),
            raw_bytes=sum(f.size for f in scan.files),
            new_bytes=sum(b.stored_size for b in new_blobs),
            files=plan.files,
            atoms=plan.atoms,
            blobs=[b for b in blobs if b is not None],
            label=options.part_label,
            plan=plan_document(options.plan) if options.plan is not None else None,
            attempt=options.part_try or parts.try_token(options.part_label),
        )
        lock.check("committing a part")
        failpoint("before-part-publish")
        objects = repo.objects(Editor)
        key = parts.publish(objects, part, fence=lambda: lock.check("committing a part"))
        if lock.by_time:  # its blobs against gc's notices, after the put (store/gc_notices.py)
            try:
                check_publication(objects, part.blobs, "committing a part", repo.size_lookup(part.blobs))
            except BaseException:
                objects.delete_many([key])  # taken back: a part a finalize must never count
                raise
    return CommitResult(
        step=step,
        manifest=0,
        files=len(plan.files),
        atoms=len(plan.atoms),
        raw_bytes=part.raw_bytes,
        new_blobs=len(new_blobs),
        new_bytes=part.new_bytes,
        derived_bytes=plan.derived_bytes,
        seconds=time.perf_counter() - began,
        stored_layers=sorted(scan.layers, key=sort_key),
        part=key,
    )


class PieceWriter(Protocol):
    """Names pieces by their xxh3-128 and, for a real commit, writes the new ones (BlobWriter)."""

    def add(self, data: memoryview, *, itemsize: int = 1, is_float: bool = False, digest: str | None = None) -> str: ...
    def add_stream(self, src: InputFile, offset: int, length: int) -> str: ...


class MasterPieces(Protocol):
    """Sees each FP32 master piece as it is written; decides which weights are derived (derive.py)."""

    def rounding_of(self, seg: A.Segment, dtype: str) -> tuple[str, bool] | None: ...
    def add_piece(self, seg: A.Segment, dtype: str, piece: Prepared) -> None: ...
    def may_derive(self, path: str, param: str) -> bool: ...
    def derivable(self, path: str, seg: A.Segment, weight_hash: str) -> bool: ...


@dataclass
class _Plan:
    files: list[FileRecord] = field(default_factory=list)
    atoms: list[AtomRecord] = field(default_factory=list)
    layer_bytes: dict[str, int] = field(default_factory=dict)
    derived_bytes: int = 0


def write_files(
    layout: CheckpointLayout,
    scan: Scan,
    stored: frozenset[str],
    sources: dict[str, Inheritance],
    writer: PieceWriter,
    rounded: MasterPieces,
    progress: Progress,
    release: bool = True,
    readers: int = 0,
) -> _Plan:
    """The second pass: one file at a time, masters before weights, each file released when done.

    ``writer`` names (and writes) every blob; ``rounded`` sees every FP32 master piece and says
    which weights are derived. A rank-parallel commit's survey passes a writer that only
    names and a ``rounded`` that only compares (rank_share.py), and keeps the files' entries
    (``release=False``) for the write that follows. ``readers`` helper threads prepare each
    file's pieces ahead of the loop (pieces_ahead.py)."""
    plan = _Plan()
    progress.start("commit", sum(f.size for f in scan.files))
    by_path = {f.path: f for f in scan.files}
    for f in (by_path[path] for path in write_order(layout)):
        container: str | None = None
        done = 0  # of this file's bytes, told to ``progress``: piece by piece, so one large file moves the bar
        with f.open() as src:
            if f.kind == RAW:
                digest = _add_raw(writer, src)
            else:
                digest = writer.add(memoryview(f.skeleton_blob()))
                literal = f.container(src)
                container = None if literal is None else writer.add(memoryview(literal))
                # Masters first, so that a weight in the same file (ZeRO 0) finds its rounded master.
                segments = [(e, s) for e in f.entries for s in e.segments]
                segments.sort(key=lambda es: es[1].kind != A.MASTER)
                jobs = [_job(f, src, e, s, rounded) for e, s in segments if s.layer in stored]
                with PiecesAhead(jobs, readers if f.located else 0) as pieces:
                    for entry, seg in segments:
                        atom = _atom(f, pieces.take, entry, seg, stored, sources, writer, rounded, plan)
                        plan.atoms.append(atom)
                        step = min(atom.nbytes, f.size - done)
                        if step > 0:
                            progress.advance(step)
                            done += step
            src.check()
        plan.files.append(FileRecord(f.path, f.file_key, f.kind, f.rank, digest, f.size, f.mode, f.trusted, container))
        if release:
            f.release()
        if f.size > done:
            progress.advance(f.size - done)  # the rest: its skeleton, container, or the whole of a raw file
    return plan


def _add_raw(writer: BlobWriter, src: InputFile) -> str:
    """A file kept whole: copied once when small, streamed in chunks when large (memory stays bounded)."""
    if src.size <= CHUNK:
        return writer.add(src.read(0, src.size))
    return writer.add_stream(src, 0, src.size)


def _job(
    f: ReadFile, src: InputFile, entry: A.TensorEntry, seg: A.Segment, rounded: MasterPieces
) -> tuple[Callable[[], Prepared], int]:
    """How to prepare one stored piece (read, name, and round where a weight may derive from it),
    and the bytes that holds."""
    nbytes = seg.numel * entry.tensor.element_size()
    read = partial(f.piece, src, entry, seg)
    rounding = rounded.rounding_of(seg, entry.dtype_name) if seg.kind == A.MASTER else None
    if rounding is None:
        return partial(prepare, read), nbytes
    return partial(prepare, read, *rounding), nbytes + nbytes // 2  # the rounded copy: half the bytes


def _atom(
    f: ReadFile,
    take_piece: Callable[[], Prepared],
    entry: A.TensorEntry,
    seg: A.Segment,
    stored: frozenset[str],
    sources: dict[str, Inheritance],
    writer: PieceWriter,
    rounded: MasterPieces,
    plan: _Plan,
) -> AtomRecord:
    size = entry.tensor.element_size()
    nbytes = seg.numel * size
    shape = json.dumps(list(entry.tensor.shape) if seg.numel == entry.tensor.numel() else [seg.numel])
    plan.layer_bytes[seg.layer] = plan.layer_bytes.get(seg.layer, 0) + nbytes
    derived: str | None = None
    if seg.layer in stored:
        prepared = take_piece()  # private memory: hashed and compressed from this one copy
        piece = prepared.data
        if seg.kind == A.MASTER:
            rounded.add_piece(seg, entry.dtype_name, prepared)
        weight_hash = prepared.digest if rounded.may_derive(f.path, seg.param) else None
        if weight_hash is not None and rounded.derivable(f.path, seg, weight_hash):
            blob, derived = weight_hash, ROUND_FROM_MASTER
            plan.derived_bytes += nbytes
        else:
            blob = writer.add(piece, itemsize=size, is_float=entry.tensor.is_floating_point(), digest=prepared.digest)
    else:
        source = sources[seg.layer]
        old = source.atoms.get((f.file_key, seg.param, seg.kind, seg.rank, seg.start, seg.numel))
        if old is None or old.dtype != entry.dtype_name:
            raise StoreError(
                f"layer {seg.layer} cannot be inherited from step {source.step}: it has no matching piece for "
                f"{seg.param} ({seg.kind}, rank {seg.rank}) in {f.path}. The layout or world size changed; "
                "commit this step with ",
                Call(policy="full"),
                ".",
            )
        blob, derived = old.blob, old.derived
    return AtomRecord(
        f.path,
        entry.slot,
        seg.offset,
        seg.numel,
        entry.dtype_name,
        shape,
        seg.param,
        seg.kind,
        seg.rank,
        seg.start,
        nbytes,
        seg.layer,
        blob,
        derived,
        None if entry.file_offset is None or not f.located else entry.file_offset + seg.offset * size,
    )
