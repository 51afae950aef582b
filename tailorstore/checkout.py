"""``tailor checkout``: write a step back in its native layout, every byte checked.

Files are written into a hidden sibling directory and renamed to ``--out`` only when every
file is complete, fsynced and every blob has matched its hash. A failed or killed
checkout therefore never leaves a directory that looks complete under the requested
name; the hidden ``.NAME.tailor-partial-*`` directory of a killed one can be deleted.
"""

from __future__ import annotations

import os
import secrets
import shutil
import sqlite3
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .atoms import byte_view, dtype_from_name
from .errors import CorruptStoreError, StoreError
from .formats.reader import RAW, SAFETENSORS, TORCH
from .formats.safetensors_file import tensor_layout
from .formats.skeleton import fill_tensors, slots_of
from .paths import safe_join
from .progress import Progress, Silent
from .safe_load import load_skeleton
from .store.repo import BlobRow, Store


@dataclass
class CheckoutResult:
    step: int
    out: Path
    files: int
    bytes_written: int
    inherited: dict[str, int] = field(default_factory=dict)  # layer -> source step, for composites


def _prepare_out(out: Path) -> Path:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise StoreError(f"{out}: already exists and is not empty; choose a new --out directory or remove it.")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tailor-partial-{secrets.token_hex(4)}"
    tmp.mkdir()
    return tmp


def _fsync_tree(root: Path) -> None:
    for folder, _dirs, names in os.walk(root):
        for name in [*names, ""]:
            fd = os.open(os.path.join(folder, name) if name else folder, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def checkout_step(
    store: Store,
    selector: str,
    out: Path,
    *,
    trust_pickles: bool = False,
    progress: Progress | None = None,
    warn: Callable[[str], None] | None = None,
) -> CheckoutResult:
    progress = progress or Silent()
    step = store.resolve(selector)
    out = Path(out)
    files = store.conn.execute(
        "SELECT path, kind, blob, raw_size, mode, trusted FROM files WHERE step=? ORDER BY path", (step,)
    ).fetchall()
    inherited = {
        r["layer"]: r["source_step"]
        for r in store.conn.execute(
            "SELECT layer, source_step FROM layers WHERE step=? AND source_step<>step", (step,)
        )
    }
    if inherited and warn:
        names = ", ".join(f"{layer} (from step {src})" for layer, src in sorted(inherited.items()))
        warn(f"step {step} is a composite: these layers come from other steps: {names}")
    for row in files:
        safe_join(out, row["path"])  # refuse before writing anything
    tmp = _prepare_out(out)
    written = 0
    try:
        progress.start(f"checkout step {step}", sum(r["raw_size"] for r in files))
        for row in files:
            target = safe_join(tmp, row["path"])
            target.parent.mkdir(parents=True, exist_ok=True)
            where = f"step {step}, file {row['path']}"
            if row["kind"] == RAW:
                _write_raw(store, row["blob"], target, where)
            elif row["kind"] == TORCH:
                _write_torch(store, step, row, target, where, trust_pickles)
            elif row["kind"] == SAFETENSORS:
                _write_safetensors(store, step, row, target, where)
            else:
                raise CorruptStoreError(f"{where}: unknown file kind {row['kind']!r}; upgrade tailorstore")
            os.chmod(target, row["mode"] or 0o644)
            written += target.stat().st_size
            progress.advance(row["raw_size"])
        _fsync_tree(tmp)
        if out.exists():
            out.rmdir()  # empty, checked above
        os.rename(tmp, out)
        _fsync_tree_parent(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        progress.close()
    return CheckoutResult(step, out, len(files), written, inherited)


def _fsync_tree_parent(out: Path) -> None:
    fd = os.open(out.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _blob_row(store: Store, digest: str, where: str) -> BlobRow:
    row = store.blob(digest)
    if row is None:
        raise CorruptStoreError(f"{where}: blob {digest} has no row in the index; run `tailor verify`.")
    return row


def _write_raw(store: Store, digest: str, target: Path, where: str) -> None:
    data = store.read_blob(digest, where)
    target.write_bytes(data)


def _atoms_by_slot(store: Store, step: int, path: str) -> dict[int, list[sqlite3.Row]]:
    by_slot: dict[int, list[sqlite3.Row]] = defaultdict(list)
    for atom in store.conn.execute(
        "SELECT slot, offset, numel, dtype, blob FROM atoms WHERE step=? AND path=? ORDER BY slot, offset",
        (step, path),
    ):
        by_slot[atom["slot"]].append(atom)
    return by_slot


def _fill(store: Store, tensor: torch.Tensor, atoms: list[sqlite3.Row], where: str) -> None:
    """Decode every atom of one tensor into place; the atoms must tile it exactly."""
    data = byte_view(tensor)
    size = tensor.element_size()
    cursor = 0
    for atom in atoms:
        if atom["offset"] != cursor:
            raise CorruptStoreError(f"{where}: atoms of a tensor leave a gap or overlap at element {cursor}")
        piece = data[atom["offset"] * size : (atom["offset"] + atom["numel"]) * size]
        row = _blob_row(store, atom["blob"], where)
        if row.raw_size != len(piece):
            raise CorruptStoreError(f"{where}: blob {row.hash} holds {row.raw_size} bytes, the atom needs {len(piece)}")
        store.read_blob_into(row, piece, where)
        cursor += atom["numel"]
    if cursor != tensor.numel():
        raise CorruptStoreError(f"{where}: atoms cover {cursor} of {tensor.numel()} elements of a tensor")


def _write_torch(store: Store, step: int, row: sqlite3.Row, target: Path, where: str, trust: bool) -> None:
    skeleton = load_skeleton(
        store.read_blob(row["blob"], where), where, trusted=bool(row["trusted"]), trust_pickles=trust
    )
    by_slot = _atoms_by_slot(store, step, row["path"])
    tensors: dict[int, torch.Tensor] = {}
    for slot in slots_of(skeleton):
        tensor = torch.empty(slot.shape, dtype=dtype_from_name(slot.dtype))
        _fill(store, tensor, by_slot.get(slot.slot, []), f"{where}, tensor slot {slot.slot}")
        tensors[slot.slot] = tensor
    torch.save(fill_tensors(skeleton, tensors), target)


def _write_safetensors(store: Store, step: int, row: sqlite3.Row, target: Path, where: str) -> None:
    header = store.read_blob(row["blob"], where)
    by_slot = _atoms_by_slot(store, step, row["path"])
    with open(target, "wb") as f:
        f.write(header)
        for slot, (name, dtype, shape) in enumerate(tensor_layout(header, where)):
            tensor = torch.empty(shape, dtype=dtype)
            _fill(store, tensor, by_slot.get(slot, []), f"{where}, tensor {name}")
            f.write(byte_view(tensor))
