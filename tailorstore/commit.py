"""``tailor commit``: turn one checkpoint directory into blobs plus one manifest.

The order of work is what makes a failed or killed commit harmless:

1. read and check every input file (bad input is refused before anything is written);
2. write the blobs that the store does not have yet, each durable on its own;
3. record the manifest (step, files, atoms, layers) in one SQLite transaction.

Until step 3 commits, no reader can see the step; blobs written before a crash are
orphans that ``tailor gc`` removes.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from .atoms import byte_view
from .errors import BadCheckpointError, StepExistsError, StoreError
from .formats.layout import CheckpointLayout, detect
from .formats.reader import RAW, ReadFile, read_checkpoint
from .layers import sort_key
from .progress import Progress, Silent
from .store.repo import Store
from .store.writer import BlobWriter


@dataclass
class CommitOptions:
    step: int | None = None
    tag: str | None = None
    force: bool = False
    trust_pickles: bool = False
    level: int = 1
    threads: int = 2
    lock_timeout: float = 600.0


@dataclass
class CommitResult:
    step: int
    files: int
    atoms: int
    raw_bytes: int
    new_blobs: int
    new_bytes: int
    seconds: float
    layers: list[str] = field(default_factory=list)


def check_tag(tag: str) -> str:
    if not tag or tag.isdigit() or any(c in tag for c in "=/\\\x00") or tag != tag.strip():
        raise StoreError(f"tag {tag!r} is not allowed: use letters, digits, '-', '_' or '.', not only digits.")
    return tag


def _step_of(options: CommitOptions, layout: CheckpointLayout, files: list[ReadFile]) -> int:
    if options.step is not None:
        return options.step
    if layout.step is not None:
        return layout.step
    for f in files:
        if "global_steps" in f.meta:
            return f.meta["global_steps"]
    raise BadCheckpointError(f"{layout.root}: cannot tell which step this checkpoint is; pass --step N.")


def _refuse_existing(store: Store, step: int, tag: str | None, force: bool) -> None:
    if force:
        return
    if store.conn.execute("SELECT 1 FROM steps WHERE step=?", (step,)).fetchone():
        raise StepExistsError(
            f"step {step} is already in the store. Commit under another --step, or pass --force to replace it."
        )
    if tag and store.conn.execute("SELECT 1 FROM steps WHERE tag=?", (tag,)).fetchone():
        raise StepExistsError(f"tag {tag!r} already names a step; choose another tag or pass --force.")


def commit_checkpoint(
    store: Store,
    ckpt_dir: Path,
    options: CommitOptions | None = None,
    progress: Progress | None = None,
    on_wait: Callable[[str], None] | None = None,
) -> CommitResult:
    options = options or CommitOptions()
    progress = progress or Silent()
    began = time.perf_counter()
    tag = check_tag(options.tag) if options.tag else None
    layout = detect(Path(ckpt_dir))
    files = list(read_checkpoint(layout, trust_pickles=options.trust_pickles))
    step = _step_of(options, layout, files)

    with store.lock(exclusive=False, timeout=options.lock_timeout, on_wait=on_wait) as lock:
        _refuse_existing(store, step, tag, options.force)
        writer = BlobWriter(store, level=options.level, threads=options.threads)
        try:
            file_rows, atom_rows = _write_files(step, files, writer, progress)
            new_blobs = writer.finish()
        except BaseException:
            writer.abort()
            if lock.try_exclusive():
                _remove_unindexed(store, writer)
            raise
        finally:
            progress.close()
        raw_bytes = sum(f.size for f in files)
        layer_bytes: dict[str, int] = {}
        for row in atom_rows:
            layer_bytes[row[11]] = layer_bytes.get(row[11], 0) + row[4] * _itemsize(row[5])
        facts: dict[str, int] = {}
        for f in files:
            facts.update({k: v for k, v in f.meta.items() if k not in facts})
        with store.transaction() as conn:
            if options.force:
                conn.execute("DELETE FROM steps WHERE step=?", (step,))
                if tag:
                    conn.execute("UPDATE steps SET tag=NULL WHERE tag=?", (tag,))
            _refuse_existing(store, step, tag, False)
            conn.executemany(
                "INSERT OR IGNORE INTO blobs(hash, raw_size, stored_size, codec, created_at) VALUES (?,?,?,?,?)",
                [(b.hash, b.raw_size, b.stored_size, b.codec, b.created_at) for b in new_blobs],
            )
            conn.execute(
                "INSERT INTO steps(step, tag, created_at, layout, ds_tag, zero_stage, world_size, policy, exact,"
                " raw_bytes, new_bytes, source) VALUES (?,?,?,?,?,?,?,?,?,?,?,?)",
                (
                    step, tag, time.time(), layout.kind, layout.ds_tag, facts.get("zero_stage"),
                    facts.get("world_size"), json.dumps({"name": "full"}), 1, raw_bytes,
                    sum(b.stored_size for b in new_blobs), str(Path(ckpt_dir).resolve()),
                ),
            )
            conn.executemany(
                "INSERT INTO files(step, path, file_key, kind, rank, blob, raw_size, mode, trusted)"
                " VALUES (?,?,?,?,?,?,?,?,?)",
                file_rows,
            )
            conn.executemany(
                "INSERT INTO atoms(step, path, slot, offset, numel, dtype, shape, param, kind, rank, start, layer,"
                " blob) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)",
                atom_rows,
            )
            conn.executemany(
                "INSERT INTO layers(step, layer, source_step, raw_bytes) VALUES (?,?,?,?)",
                [(step, layer, step, n) for layer, n in layer_bytes.items()],
            )
    return CommitResult(
        step=step,
        files=len(file_rows),
        atoms=len(atom_rows),
        raw_bytes=raw_bytes,
        new_blobs=len(new_blobs),
        new_bytes=sum(b.stored_size for b in new_blobs),
        seconds=time.perf_counter() - began,
        layers=sorted(layer_bytes, key=sort_key),
    )


_ITEMSIZE_CACHE: dict[str, int] = {}


def _itemsize(dtype: str) -> int:
    if dtype not in _ITEMSIZE_CACHE:
        from .atoms import dtype_from_name

        _ITEMSIZE_CACHE[dtype] = dtype_from_name(dtype).itemsize
    return _ITEMSIZE_CACHE[dtype]


def _write_files(
    step: int, files: list[ReadFile], writer: BlobWriter, progress: Progress
) -> tuple[list[tuple], list[tuple]]:
    file_rows: list[tuple] = []
    atom_rows: list[tuple] = []
    progress.start(f"commit step {step}", sum(f.size for f in files))
    for f in files:
        if f.kind == RAW:
            digest = _add_whole_file(f.source, writer)
        else:
            assert f.skeleton is not None
            digest = writer.add(memoryview(f.skeleton))
            for entry in f.entries:
                data = byte_view(entry.tensor)
                size = entry.tensor.element_size()
                whole_shape = json.dumps(list(entry.tensor.shape))
                for seg in entry.segments:
                    piece = data[seg.offset * size : (seg.offset + seg.numel) * size]
                    blob = writer.add(piece)
                    shape = whole_shape if seg.numel == entry.tensor.numel() else json.dumps([seg.numel])
                    atom_rows.append(
                        (step, f.path, entry.slot, seg.offset, seg.numel, entry.dtype_name, shape, seg.param,
                         seg.kind, seg.rank, seg.start, seg.layer, blob)
                    )
        file_rows.append((step, f.path, f.file_key, f.kind, f.rank, digest, f.size, f.mode, int(f.trusted)))
        progress.advance(f.size)
    return file_rows, atom_rows


def _add_whole_file(path: Path, writer: BlobWriter) -> str:
    data = path.read_bytes()
    return writer.add(memoryview(data))


def _remove_unindexed(store: Store, writer: BlobWriter) -> None:
    """After a failed commit, alone on the store: delete the blobs it wrote that nothing indexes."""
    for digest in writer.written():
        if store.blob(digest) is None:
            store.backend.delete(digest)
