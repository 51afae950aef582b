"""Finalizing a step: turn the parts several hosts committed into one manifest.

Each host commits only its own ranks' files as a part (``commit(DIR, part=True)``). Once every
host is done, one of them (global rank 0 under torch.distributed) finalizes. A step with a missing
part is refused, naming the missing ranks, and nothing is recorded; the parts stay for a later
finalize.

Call order (docs/FORMAT.md section 8, Parts and Finalize):

1. every host: ``commit(..., part=True)`` writes its blobs, then puts its part object create-only
   (the part's commit point); the index is not changed;
2. one host, once all parts are in: ``finalize(step)`` takes the lock shared, brings the index up
   to date, lists and reads the step's parts (with a label, only that save's);
3. checks that they form one save (one tag, layout, world size and stage; a path two parts hold
   is the same file atom by atom) and that together they hold every file the world size needs;
4. checks that every blob they name exists;
5. records one manifest through ``store/publish.record_manifest``, as a single-host commit would
   (under a plan the parts carry, with its policy and inherited layers);
6. deletes the parts, after the index transaction commits.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol

from tailorstore.access import structure
from tailorstore.core.environment import TRY_ENV
from tailorstore.core.errors import (
    LOCK_TIMEOUT,
    BadCheckpointError,
    Call,
    CorruptStoreError,
    StepExistsError,
    StoreError,
)
from tailorstore.core.failpoints import operation
from tailorstore.core.object_keys import blob_key
from tailorstore.core.policies import PolicySpec
from tailorstore.core.progress import Progress
from tailorstore.core.records import COMMIT, MAIN_RUN, AtomRecord, FileRecord, LayerRecord, ManifestRecord
from tailorstore.core.save_bound import bounded
from tailorstore.core.step_rules import check_tag
from tailorstore.formats import dcp
from tailorstore.formats.deepspeed import file_rank, is_model_states, is_optim_states
from tailorstore.formats.kinds import DCP
from tailorstore.formats.layout import ACCELERATE, DCP_FOLDER, DEEPSPEED, DEEPSPEED_TAG, HF_TRAINER
from tailorstore.store.backends.roles import Remover, Scanner
from tailorstore.store.manifests.runs import check_run_name
from tailorstore.store.parts import Part, read_parts
from tailorstore.store.publish import THIS_MANIFEST, ManifestRows, record_manifest
from tailorstore.store.repo import BlobReader, Repository, StepReader, StoreWriter, check_step


class FinalizeLookup(Protocol):
    """The index as a finalize checks its parts: are the step and the tag taken, and which steps
    do they inherit from."""

    def commit_at(self, step: int, run: str) -> ManifestRecord | None: ...

    def by_object_key(self, key: str) -> ManifestRecord | None: ...

    def tagged(self, tag: str) -> ManifestRecord | None: ...


CHECKERS = 16  # blob objects asked after at once: each a round trip, not a core


@dataclass
class FinalizeResult:
    step: int
    manifest: int
    parts: int
    files: int
    atoms: int
    raw_bytes: int
    new_bytes: int
    seconds: float
    sources: list[str] = field(default_factory=list)


def missing_pieces(layout: str, files: list[FileRecord], world_size: int | None, zero_stage: int | None) -> list[str]:
    """Pure: what a DeepSpeed or DCP step lacks for its saved world size, in words (empty when
    complete). An HF Trainer checkpoint without DeepSpeed or DCP files has no ranks to check."""
    names = [f.path.rsplit("/", 1)[-1] for f in files]
    model = [n for n in names if is_model_states(n)]
    optim_ranks = {file_rank(n) for n in names if is_optim_states(n)}
    if layout == DCP_FOLDER or any(f.kind == DCP or f.path.rsplit("/", 1)[-1] == dcp.METADATA for f in files):
        return _missing_dcp(files, world_size)  # a DCP save, even one whose rank files are all gone
    if layout in (HF_TRAINER, ACCELERATE) and not model and not optim_ranks:
        return []
    if not model:
        return ["the model states file (mp_rank_00_model_states.pt, which rank 0 writes)"]
    if world_size is None:
        return []
    missing: list[str] = []
    if zero_stage:
        lost = sorted(set(range(world_size)) - optim_ranks)
        if lost:
            missing.append(f"the optimizer states of rank(s) {lost}")
    if zero_stage == 3:
        model_ranks = {file_rank(n) for n in model}
        lost = sorted(set(range(world_size)) - model_ranks)
        if lost:
            missing.append(f"the model states of rank(s) {lost}")
    return missing


def _missing_dcp(files: list[FileRecord], world_size: int | None) -> list[str]:
    """What a DCP step lacks: each folder's ``.metadata`` (rank 0 writes it), and a ``.distcp`` file
    of every rank below the world size its metadata gave (each rank writes one). A folder left with
    its ``.metadata`` alone (every rank's part gone, as a ``gc --drop-parts`` takes them) lacks its
    rank files, said as such, never DeepSpeed's files."""
    missing: list[str] = []
    by_folder: dict[str, list[str]] = {}
    for f in files:
        folder, _, name = f.path.rpartition("/")
        by_folder.setdefault(folder, []).append(name)
    folders = 0
    for folder, names in sorted(by_folder.items()):
        if not any(dcp.is_distcp(n) for n in names) and dcp.METADATA not in names:
            continue
        folders += 1
        if dcp.METADATA not in names:
            missing.append(f"{folder or '.'}/{dcp.METADATA} (which rank 0 writes)")
        ranks = {dcp.file_rank(n) for n in names if dcp.is_distcp(n)}
        lost = sorted(set(range(world_size or 0)) - ranks)
        if lost:
            missing.append(f"the .distcp files of rank(s) {lost} in {folder or '.'}")
        elif not ranks:
            missing.append(f"every rank's .distcp file in {folder or '.'}")
    if not folders:
        missing.append(f"the DCP folder's {dcp.METADATA} and .distcp files")
    return missing


def _content(part: Part, path: str) -> list[tuple]:
    """What a file of a part holds, tensor by tensor: each atom's place and bytes (by hash), without
    whether it was derived (a part that holds every master piece of a parameter derives its weight,
    another stores it; the bytes, and so the hash, are the same)."""
    return sorted(
        (a.slot, a.offset, a.numel, a.dtype, a.shape, a.param, a.kind, a.rank, a.start, a.blob)
        for a in part.atoms
        if a.path == path
    )


def _merged_files(parts: list[Part]) -> tuple[list[FileRecord], list[AtomRecord]]:
    """Files and atoms of all parts. A file two parts both hold (``latest``, scripts, the model
    states every part with optimizer states holds) must be the same in both, tensor by tensor: its
    skeleton alone (``files.blob``) is the same for two tries of one step with other values, so
    comparing only that would mix two tries of a save into one step (I4, docs/FORMAT.md 8.1)."""
    files: dict[str, tuple[FileRecord, Part]] = {}
    for part in parts:
        for f in part.files:
            seen = files.get(f.path)
            if seen is not None and (
                (seen[0].blob, seen[0].raw_size) != (f.blob, f.raw_size)
                or _content(seen[1], f.path) != _content(part, f.path)
            ):
                raise BadCheckpointError(
                    f"step {part.step}: {f.path} differs between parts {seen[1].source} and {part.source}; the "
                    "parts are not of one save (a stale part of an earlier try of the step?). Drop the parts with ",
                    Call("gc", drop_parts=True),
                    " and commit again.",
                )
            files.setdefault(f.path, (f, part))
    atoms = [a for f, part in files.values() for a in part.atoms if a.path == f.path]
    return sorted((f for f, _ in files.values()), key=lambda f: f.path), atoms


def _one_try(parts: list[Part], step: int, label: str | None) -> None:
    """The parts prove they are of one try of the save (I4). Parts that carry a try token
    (``$TAILOR_TRY``, or the save's label) must all carry the same one. Parts without one (written
    before tokens, or by hosts given none) are taken only when ``label`` chose them (a save's
    label is unique to one start of its job) or when shared files link every part to the others:
    :func:`_merged_files` then finds a file of two tries unequal. Parts that share no file prove
    nothing: two tries' parts (one host's rank 0, another's rank 1) were recorded as one step."""
    tokens = sorted({p.attempt for p in parts})
    if len(tokens) > 1:
        said = ", ".join(repr(t) if t else "none" for t in tokens)
        raise BadCheckpointError(
            f"step {step}: the parts are of different tries of the save (try tokens {said}); they are not one "
            "save. Drop the stale parts with ",
            Call("gc", drop_parts=True),
            " and commit every host's part of one try again.",
        )
    if tokens != [""] or label is not None or len(parts) < 2:
        return
    linked, rest = {id(parts[0])}, parts[1:]
    paths = {f.path for f in parts[0].files}
    while rest:
        joined = [p for p in rest if paths & {f.path for f in p.files}]
        if not joined:
            raise BadCheckpointError(
                f"step {step}: parts {parts[0].source} and {rest[0].source} share no file and carry no try token, "
                f"so nothing shows they are of one try of the save. Commit each host's part with the same "
                f"{TRY_ENV} (or label), then finalize."
            )
        for p in joined:
            linked.add(id(p))
            paths |= {f.path for f in p.files}
        rest = [p for p in rest if id(p) not in linked]


def _one_plan(parts: list[Part]) -> dict | None:
    """The plan every part carries (a rank-parallel commit under a policy), or None; parts that
    disagree are not one commit."""
    plans = [json.dumps(p.plan, sort_keys=True) for p in parts]
    if len(set(plans)) > 1:
        raise BadCheckpointError("the parts carry different plans (layers stored, inherited); they are not one commit")
    return parts[0].plan


def _plan_sources(lookup: FinalizeLookup, plan: dict, step: int) -> dict[str, tuple[int, int]]:
    """Inherited layer -> (this index's id of its source manifest, source step)."""
    out = {}
    for layer, (_, source_key, source_step) in plan["inherited"].items():
        source = lookup.by_object_key(source_key)
        if source is None or source_step >= step:
            raise CorruptStoreError(
                f"step {step}'s parts inherit layer {layer} from {source_key}, which is not an earlier step here"
            )
        out[layer] = (source.id, source_step)
    return out


def _one_fact(parts: list[Part], name: str) -> int | None:
    found = {p.facts[name] for p in parts if name in p.facts}
    if len(found) > 1:
        raise BadCheckpointError(f"the parts disagree on {name} ({sorted(found)}); they are not one save")
    return found.pop() if found else None


def _check_blobs(repo: BlobReader, parts: list[Part]) -> None:
    """Every blob a part names is in the backend (loose objects, asked :data:`CHECKERS` at a time)
    or in a pack the index knows."""
    loose = [(part, row) for part in parts for row in part.blobs if row.pack is None]
    with ThreadPoolExecutor(CHECKERS, thread_name_prefix="tailor-finalize") as pool:
        sizes = list(pool.map(lambda item: repo.object_size(blob_key(item[1].hash)), loose))
    missing = [item for item, size in zip(loose, sizes, strict=True) if size != item[1].stored_size]
    missing += [(part, row) for part in parts for row in part.blobs if row.pack and repo.blob(row.hash) is None]
    if missing:
        part, row = missing[0]
        raise CorruptStoreError(
            f"part {part.key} ({part.source}): blob {row.hash} is missing from {repo.location}. "
            "Commit that part again with ",
            Call("commit", "DIR", part=True, force=True),
            ", then finalize.",
        )


@dataclass(frozen=True)
class FinalizeRequest:
    """What a finalize records: the step of ``run`` from its parts (with ``label``, only the parts
    published with it: one save's, while a dead node's part of an earlier try of the same step
    waits for gc), under ``tag``, with ``metrics`` (JSON, checked by the caller); ``force`` records
    it even where its model differs from the run's."""

    step: int
    run: str = MAIN_RUN
    tag: str | None = None
    force: bool = False
    label: str | None = None
    metrics: str | None = None
    lock_timeout: float = LOCK_TIMEOUT

    def check(self) -> None:
        check_step(self.step)
        check_run_name(self.run)
        if self.tag:
            check_tag(self.tag)


@dataclass(frozen=True)
class _OneSave:
    """The parts, proved one save, merged: what the manifest will record."""

    parts: list[Part]
    layout: str
    files: list[FileRecord]
    atoms: list[AtomRecord]
    world_size: int | None
    zero_stage: int | None
    plan: dict | None


def finalize_step(repo: Repository, request: FinalizeRequest, progress: Progress | None = None) -> FinalizeResult:
    """Finalize's call order: lock shared and sync; read the parts and refuse what is no one
    complete save (:func:`_one_save`); decide each layer's source; record the manifest (the commit
    point); only then delete the parts."""
    began = time.perf_counter()
    request.check()
    with (
        operation("finalize"),
        bounded(f"finalize of step {request.step}"),
        repo.lock(exclusive=False, timeout=request.lock_timeout, progress=progress) as lock,
    ):
        repo.refresh(lock)  # packs and manifests other hosts wrote since this store was opened
        save = _one_save(repo, request)
        sources = _plan_sources(repo.view(FinalizeLookup), save.plan, request.step) if save.plan else {}
        rows = _rows(repo, request, save, sources)
        [manifest] = record_manifest(repo, rows, fence=lock)  # the commit point
        # after the manifest is durable (a crash before leaves parts gc can drop); one request on S3
        repo.objects(Remover).delete_many([part.key for part in save.parts])
    return FinalizeResult(
        step=request.step,
        manifest=manifest,
        parts=len(save.parts),
        files=len(save.files),
        atoms=len(save.atoms),
        raw_bytes=rows.record.raw_bytes,
        new_bytes=rows.record.new_bytes,
        seconds=time.perf_counter() - began,
        sources=sorted(p.source for p in save.parts),
    )


def _one_save(repo: StoreWriter, request: FinalizeRequest) -> _OneSave:
    """The step's parts, refused unless they are one try of one save, complete, of this run's model."""
    step, run = request.step, request.run
    parts = read_parts(repo.objects(Scanner), step, run, request.label)
    if not parts:
        raise StoreError(
            f"step {step} has no parts to finalize. Each host commits its ranks with ",
            Call("commit", "DIR", part=True),
            " first.",
        )
    lookup = repo.view(FinalizeLookup)
    if lookup.commit_at(step, run) is not None:
        raise StepExistsError(f"step {step} is already in the store; its parts were finalized before.")
    if request.tag and lookup.tagged(request.tag) is not None:  # the publisher checks again, in its transaction
        raise StepExistsError(f"tag {request.tag!r} already names a manifest; choose another tag.")
    kinds = {p.layout for p in parts}
    tags = {p.ds_tag for p in parts}
    if len(tags) > 1 or (len(kinds) > 1 and not kinds <= {DEEPSPEED, DEEPSPEED_TAG}):
        raise BadCheckpointError(
            f"step {step}: the parts hold different layouts or tag folders "
            f"({sorted(kinds)}, {sorted(map(str, tags))}); they are not one save."
        )
    layout = DEEPSPEED if DEEPSPEED in kinds else kinds.pop()
    _one_try(parts, step, request.label)
    files, atoms = _merged_files(parts)
    world_size, zero_stage = _one_fact(parts, "world_size"), _one_fact(parts, "zero_stage")
    missing = missing_pieces(layout, files, world_size, zero_stage)
    if missing:
        raise BadCheckpointError(
            f"step {step} is incomplete: its {len(parts)} part(s) lack {'; '.join(missing)}. Commit the missing "
            "host's files with ",
            Call("commit", "DIR", part=True),
            ", then finalize again.",
        )
    _check_blobs(repo, parts)
    if not request.force:
        structure.refuse_other_model(
            repo.view(structure.ModelShape), structure.from_atoms(atoms), run, repo.run_base(run)
        )
    return _OneSave(parts, layout, files, atoms, world_size, zero_stage, _one_plan(parts))


def _rows(
    repo: StepReader, request: FinalizeRequest, save: _OneSave, sources: dict[str, tuple[int, int]]
) -> ManifestRows:
    """The manifest's rows: the step's record, its files and atoms, each layer's source."""
    layer_bytes: dict[str, int] = {}
    for a in save.atoms:
        layer_bytes[a.layer] = layer_bytes.get(a.layer, 0) + a.nbytes
    changes = save.plan["changes"] if save.plan else {}
    record = ManifestRecord(
        step=request.step,
        origin=COMMIT,
        created_at=time.time(),
        layout=save.layout,
        ds_tag=save.parts[0].ds_tag,
        zero_stage=save.zero_stage,
        world_size=save.world_size,
        policy=json.dumps(save.plan["policy"] if save.plan else PolicySpec().as_json()),
        exact=not sources,
        raw_bytes=sum(f.raw_size for f in save.files),
        new_bytes=sum(p.new_bytes for p in save.parts),
        source="; ".join(sorted(p.source for p in save.parts)),
        run=request.run,
        tags=(request.tag,) if request.tag else (),
        metrics=request.metrics,
    )
    layers = [
        LayerRecord(
            x, *(sources[x] if x in sources else (THIS_MANIFEST, request.step)), n, x not in sources, changes.get(x)
        )
        for x, n in sorted(layer_bytes.items())
    ]
    return ManifestRows(
        record,
        save.files,
        save.atoms,
        layers,
        reported_blobs=[b for p in save.parts for b in p.blobs],  # a packed blob keeps the row its pack gave
        derived_from=[repo.manifest(m) for m in sorted({m for m, _ in sources.values()})],
    )
