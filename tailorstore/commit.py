"""``tailor commit``: turn one checkpoint directory into blobs plus one manifest.

The order of work is what makes a failed or killed commit harmless:

1. read and check every input file (bad input is refused before anything is written);
2. decide which layers to store (the policy) and which to inherit from earlier steps;
3. write the blobs that the store does not have yet, each durable on its own;
4. record the manifest (manifest row, files, atoms, layers) in one SQLite transaction.

Until step 4 commits, no reader can see the step; blobs written before a crash are
orphans that ``tailor gc`` removes.
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from . import atoms as A
from . import structure
from .changes import LayerChange, masters_by_layer, stored_pieces
from .derive import LOW_PRECISION, ROUND_FROM_MASTER, RoundedMasters
from .errors import BadCheckpointError, StepExistsError, StoreError
from .formats.deepspeed import ModelInfo
from .formats.layout import CheckpointLayout, detect
from .formats.reader import RAW, ReadFile, read_checkpoint, write_order
from .formats.source import CHUNK, InputFile, check_unchanged
from .layers import STATE, sort_key
from .policies import CommitFacts, PolicySpec, decide, needs_changes
from .progress import Progress, Silent
from .refs import check_tag
from .store import manifest_objects
from .store.atom_rows import INSERT_ATOMS, AtomKey, atoms_by_key
from .store.backend import blob_key
from .store.packs import pack_key
from .store.posix import is_out_of_space
from .store.repo import Repository, check_step
from .store.writer import BlobWriter, disk_full


@dataclass
class CommitOptions:
    step: int | None = None
    tag: str | None = None
    force: bool = False
    trust_pickles: bool = False
    level: int = 1
    threads: int = 3  # compression uses both cores; a third thread keeps them busy while one waits on a write
    lock_timeout: float = 600.0
    policy: PolicySpec = field(default_factory=PolicySpec)
    derive_weights: bool = True


@dataclass
class CommitResult:
    step: int
    manifest: int
    files: int
    atoms: int
    raw_bytes: int
    new_blobs: int
    new_bytes: int
    derived_bytes: int
    seconds: float
    stored_layers: list[str] = field(default_factory=list)
    inherited_layers: dict[str, int] = field(default_factory=dict)  # layer -> source step
    changes: dict[str, float] = field(default_factory=dict)


@dataclass
class _Inheritance:
    manifest: int
    step: int
    source: int
    source_step: int
    atoms: dict[AtomKey, sqlite3.Row]


def check_options(options: CommitOptions) -> None:
    """Refuse values that would commit something no selector reaches, or that the codec cannot take."""
    if options.step is not None:
        check_step(options.step)
    if not 1 <= options.level <= 22:
        raise StoreError(f"--level {options.level} is not allowed: zstd levels run from 1 to 22 (1 is the default).")
    if options.tag:
        check_tag(options.tag)


def _step_of(options: CommitOptions, layout: CheckpointLayout, files: list[ReadFile]) -> int:
    if options.step is not None:
        return options.step
    if layout.step is not None:
        return layout.step
    for f in files:
        if "global_steps" in f.meta:
            return check_step(f.meta["global_steps"])
    raise BadCheckpointError(f"{layout.root}: cannot tell which step this checkpoint is; pass --step N.")


def _refuse_existing(conn: sqlite3.Connection, step: int, tag: str | None) -> None:
    if conn.execute("SELECT 1 FROM manifests WHERE step=? AND origin='commit'", (step,)).fetchone():
        raise StepExistsError(
            f"step {step} is already in the store. Commit under another --step, or pass --force to replace it."
        )
    if tag and conn.execute("SELECT 1 FROM manifests WHERE tag=?", (tag,)).fetchone():
        raise StepExistsError(f"tag {tag!r} already names a manifest; choose another tag or pass --force.")


def _inheritance(store: Repository, step: int, layers: frozenset[str]) -> dict[str, _Inheritance]:
    """For each layer, the newest earlier committed step that has it, with its atoms by key."""
    found: dict[str, _Inheritance] = {}
    rows = store.conn.execute(
        "SELECT l.layer, l.manifest, m.step, l.source, l.source_step FROM layers l JOIN manifests m ON m.id=l.manifest "
        "WHERE m.origin='commit' AND m.step<? ORDER BY m.step DESC",
        (step,),
    ).fetchall()
    for r in rows:
        if r["layer"] in layers and r["layer"] != STATE and r["layer"] not in found:
            found[r["layer"]] = _Inheritance(r["manifest"], r["step"], r["source"], r["source_step"], {})
    return found


def _load_inherited_atoms(store: Repository, inherit: _Inheritance, layer: str) -> None:
    inherit.atoms.update(atoms_by_key(store.conn, inherit.manifest, layer))


@dataclass
class _Scan:
    """What the validating pass learns. Files keep their entries (meta tensors with file offsets,
    no data) so that writing needs no second unpickling."""

    files: list[ReadFile] = field(default_factory=list)
    layers: frozenset[str] = frozenset()
    weights: dict[str, tuple] = field(default_factory=dict)  # low-precision weights: param -> (dtype, numel)
    structure: dict[str, int] = field(default_factory=dict)  # param -> elements (structure.from_segments)
    infos: dict[str, ModelInfo] = field(default_factory=dict)


def _scan(layout: CheckpointLayout, trust_pickles: bool) -> _Scan:
    """Read and check every file, one at a time, before anything is written."""
    scan = _Scan()
    layers: set[str] = set()
    for f in read_checkpoint(layout, trust_pickles=trust_pickles, infos=scan.infos):
        for entry in f.entries:
            for seg in entry.segments:
                layers.add(seg.layer)
                if seg.kind == A.WEIGHT and seg.start == 0 and entry.tensor.dtype in LOW_PRECISION:
                    scan.weights[seg.param] = (entry.tensor.dtype, seg.numel)
        scan.files.append(f)
    scan.layers = frozenset(layers)
    scan.structure = structure.from_segments([s for f in scan.files for e in f.entries for s in e.segments])
    return scan


def _measure_changes(
    store: Repository, layout: CheckpointLayout, scan: _Scan, sources: dict[str, _Inheritance]
) -> dict:
    """Relative change of each layer's FP32 master since the version an earlier step holds, file by file."""
    totals: dict[str, LayerChange] = {}
    by_path = {f.path: f for f in scan.files}
    for f in (by_path[path] for path in write_order(layout)):
        with f.open() as src:
            for layer, pieces in masters_by_layer(f, src).items():
                if layer in sources:
                    stored = stored_pieces(store, sources[layer].manifest, layer, keys=set(pieces))
                    totals.setdefault(layer, LayerChange()).add(pieces, stored)
            src.check()
    expected = {
        layer: store.conn.execute(
            "SELECT count(*) FROM atoms WHERE manifest=? AND layer=? AND kind='master'", (src.manifest, layer)
        ).fetchone()[0]
        for layer, src in sources.items()
    }
    return {layer: t.value() for layer, t in totals.items() if t.pieces == expected.get(layer) and t.matched}


def commit_checkpoint(
    store: Repository,
    ckpt_dir: Path,
    options: CommitOptions | None = None,
    progress: Progress | None = None,
    on_wait: Callable[[str], None] | None = None,
) -> CommitResult:
    options = options or CommitOptions()
    progress = progress or Silent()
    began = time.perf_counter()
    check_options(options)
    tag = options.tag or None
    layout = detect(Path(ckpt_dir))
    scan = _scan(layout, options.trust_pickles)
    files = scan.files
    step = _step_of(options, layout, files)
    layers = scan.layers

    with store.lock(exclusive=False, timeout=options.lock_timeout, on_wait=on_wait) as lock:
        if not options.force:
            _refuse_existing(store.conn, step, tag)
            structure.refuse_other_model(store.conn, scan.structure)
        sources = _inheritance(store, step, layers)
        commits_before = store.conn.execute(
            "SELECT count(*) FROM manifests WHERE origin='commit' AND step<?", (step,)
        ).fetchone()[0]
        adaptive = needs_changes(options.policy)
        changes = _measure_changes(store, layout, scan, sources) if adaptive else {}
        stored = decide(
            options.policy,
            CommitFacts(layers, commits_before, frozenset(sources), changes if adaptive else None),
        )
        for layer in layers - stored:
            _load_inherited_atoms(store, sources[layer], layer)
        writer = BlobWriter(store, level=options.level, threads=options.threads)
        try:
            plan = _write_files(layout, scan, options, stored, sources, writer, progress)
            for f in files:  # the last look, once every file is read: a change after a file's pass is refused too
                assert f.identity is not None
                check_unchanged(f.source, f.identity)
            new_blobs = writer.finish()
        except BaseException:
            writer.abort()
            if lock.try_exclusive():
                _remove_unindexed(store, writer)
            raise
        finally:
            progress.close()

        raw_bytes = sum(f.size for f in files)
        facts: dict[str, int] = {}
        for f in files:
            facts.update({k: v for k, v in f.meta.items() if k not in facts})
        new_bytes = sum(b.stored_size for b in new_blobs)
        published: str | None = None
        replaced: sqlite3.Row | None = None
        try:
            with store.transaction() as conn:
                pinned = 0
                if options.force:  # the replaced step keeps its tag and pin, unless a new tag is given
                    replaced = old = conn.execute(
                        "SELECT id, tag, pinned, object_key FROM manifests WHERE step=? AND origin='commit'", (step,)
                    ).fetchone()
                    if old is not None:
                        tag = tag or old["tag"]
                        pinned = old["pinned"]
                    conn.execute("DELETE FROM manifests WHERE step=? AND origin='commit'", (step,))
                    if tag:
                        conn.execute("UPDATE manifests SET tag=NULL WHERE tag=?", (tag,))
                _refuse_existing(conn, step, tag)
                conn.executemany(
                    "INSERT INTO packs(name, size) VALUES (?,?) ON CONFLICT(name) DO NOTHING", writer.new_packs()
                )
                conn.executemany(  # a repaired blob (rewritten because its object was missing) gets its new row
                    "INSERT INTO blobs(hash, raw_size, stored_size, codec, created_at, pack, pack_offset)"
                    " VALUES (?,?,?,?,?,?,?) ON CONFLICT(hash) DO UPDATE SET stored_size=excluded.stored_size,"
                    " codec=excluded.codec, pack=excluded.pack, pack_offset=excluded.pack_offset",
                    [
                        (b.hash, b.raw_size, b.stored_size, b.codec, b.created_at, b.pack, b.pack_offset)
                        for b in new_blobs
                    ],
                )
                manifest = conn.execute(
                    "INSERT INTO manifests(step, origin, tag, created_at, layout, ds_tag, zero_stage, world_size,"
                    " policy, exact, raw_bytes, new_bytes, source, pinned) VALUES (?,'commit',?,?,?,?,?,?,?,?,?,?,?,?)",
                    (
                        step,
                        tag,
                        time.time(),
                        layout.kind,
                        layout.ds_tag,
                        facts.get("zero_stage"),
                        facts.get("world_size"),
                        json.dumps(options.policy.as_json()),
                        int(stored >= layers),
                        raw_bytes,
                        new_bytes,
                        str(Path(ckpt_dir).resolve()),
                        pinned,
                    ),
                ).lastrowid
                conn.executemany(
                    "INSERT INTO files(manifest, path, file_key, kind, rank, blob, raw_size, mode, trusted, container)"
                    " VALUES (?,?,?,?,?,?,?,?,?,?)",
                    [(manifest, *row) for row in plan.file_rows],
                )
                conn.executemany(
                    INSERT_ATOMS,
                    [(manifest, *row) for row in plan.atom_rows],
                )
                conn.executemany(
                    "INSERT INTO layers(manifest, layer, source, source_step, raw_bytes, stored, change)"
                    " VALUES (?,?,?,?,?,?,?)",
                    [
                        (
                            manifest,
                            layer,
                            manifest if layer in stored else sources[layer].source,
                            step if layer in stored else sources[layer].source_step,
                            plan.layer_bytes.get(layer, 0),
                            int(layer in stored),
                            changes.get(layer),
                        )
                        for layer in layers
                    ],
                )
                try:
                    published = manifest_objects.publish(store.backend, conn, manifest)  # the commit point
                except OSError as exc:
                    if is_out_of_space(exc):
                        raise disk_full(store.location) from None
                    raise
        except BaseException:
            if published is not None:  # the object went up but the index refused it: take it back
                manifest_objects.unpublish(store.backend, [published])
            if replaced is not None:  # its tag object may name the new key by now
                manifest_objects.write_refs(store.backend, store.conn, [replaced["id"]])
            if lock.try_exclusive():  # e.g. a full disk under SQLite: leave no orphans behind
                _remove_unindexed(store, writer)
            raise
        if replaced is not None:
            manifest_objects.unpublish(store.backend, [replaced["object_key"]])
    return CommitResult(
        step=step,
        manifest=int(manifest),
        files=len(plan.file_rows),
        atoms=len(plan.atom_rows),
        raw_bytes=raw_bytes,
        new_blobs=len(new_blobs),
        new_bytes=new_bytes,
        derived_bytes=plan.derived_bytes,
        seconds=time.perf_counter() - began,
        stored_layers=sorted(stored, key=sort_key),
        inherited_layers={layer: sources[layer].source_step for layer in sorted(layers - stored, key=sort_key)},
        changes=changes,
    )


@dataclass
class _Plan:
    file_rows: list[tuple] = field(default_factory=list)
    atom_rows: list[tuple] = field(default_factory=list)
    layer_bytes: dict[str, int] = field(default_factory=dict)
    derived_bytes: int = 0


def _write_files(
    layout: CheckpointLayout,
    scan: _Scan,
    options: CommitOptions,
    stored: frozenset[str],
    sources: dict[str, _Inheritance],
    writer: BlobWriter,
    progress: Progress,
) -> _Plan:
    """The second pass: one file at a time, masters before weights, each file released when done."""
    plan = _Plan()
    rounded = RoundedMasters(scan.weights if options.derive_weights else {})
    progress.start("commit", sum(f.size for f in scan.files))
    by_path = {f.path: f for f in scan.files}
    for f in (by_path[path] for path in write_order(layout)):
        container: str | None = None
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
                for entry, seg in segments:
                    plan.atom_rows.append(_atom_row(f, src, entry, seg, stored, sources, writer, rounded, plan))
            src.check()
        plan.file_rows.append((f.path, f.file_key, f.kind, f.rank, digest, f.size, f.mode, int(f.trusted), container))
        f.release()
        progress.advance(f.size)
    return plan


def _add_raw(writer: BlobWriter, src: InputFile) -> str:
    """A file kept whole: copied once when small, streamed in chunks when large (memory stays bounded)."""
    if src.size <= CHUNK:
        return writer.add(src.read(0, src.size))
    return writer.add_stream(src, 0, src.size)


def _atom_row(
    f: ReadFile,
    src: InputFile,
    entry: A.TensorEntry,
    seg: A.Segment,
    stored: frozenset[str],
    sources: dict[str, _Inheritance],
    writer: BlobWriter,
    rounded: RoundedMasters,
    plan: _Plan,
) -> tuple:
    size = entry.tensor.element_size()
    nbytes = seg.numel * size
    shape = json.dumps(list(entry.tensor.shape) if seg.numel == entry.tensor.numel() else [seg.numel])
    plan.layer_bytes[seg.layer] = plan.layer_bytes.get(seg.layer, 0) + nbytes
    derived: str | None = None
    if seg.layer in stored:
        piece = f.piece(src, entry, seg)  # private memory: hashed and compressed from this one copy
        if seg.kind == A.MASTER:
            rounded.add_piece(seg, entry.tensor.dtype, piece)
        weight_hash = writer.hash_only(piece) if seg.param in rounded.hashes else None
        if weight_hash is not None and rounded.derivable(seg, weight_hash):
            blob, derived = weight_hash, ROUND_FROM_MASTER
            plan.derived_bytes += nbytes
        else:
            blob = writer.add(piece, itemsize=size, is_float=entry.tensor.is_floating_point())
    else:
        source = sources[seg.layer]
        old = source.atoms.get((f.file_key, seg.param, seg.kind, seg.rank, seg.start, seg.numel))
        if old is None or old["dtype"] != entry.dtype_name:
            raise StoreError(
                f"layer {seg.layer} cannot be inherited from step {source.step}: it has no matching piece for "
                f"{seg.param} ({seg.kind}, rank {seg.rank}) in {f.path}. The layout or world size changed; "
                "commit this step with --policy full."
            )
        blob, derived = old["blob"], old["derived"]
    return (
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


def _remove_unindexed(store: Repository, writer: BlobWriter) -> None:
    """After a failed commit, alone on the store: delete the blobs it wrote that nothing indexes."""
    for digest in writer.written():
        if store.blob(digest) is None:
            store.backend.delete(blob_key(digest))
    for name in writer.written_packs():
        if store.conn.execute("SELECT 1 FROM packs WHERE name=?", (name,)).fetchone() is None:
            store.backend.delete(pack_key(name))
