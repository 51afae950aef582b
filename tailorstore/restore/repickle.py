"""Checkout of a file committed without a container (tailorstore 0.1): rebuilt by torch.

Newer commits keep each pickled or safetensors file's bytes around its tensors (a
*container*), so placement.py writes them back without unpickling. A file without one is
rebuilt here from its skeleton and atoms, and re-pickled with ``torch.save``: the only
checkout path that needs torch.
"""

from __future__ import annotations

import os
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from tailorstore.access.atom_reader import decode_atom_into
from tailorstore.access.contents import Contents
from tailorstore.core.errors import CorruptStoreError, LayoutError
from tailorstore.core.local_files import create_new
from tailorstore.core.records import AtomRecord, FileRecord
from tailorstore.formats.kinds import SAFETENSORS
from tailorstore.formats.safe_load import load_skeleton
from tailorstore.formats.safetensors_file import tensor_layout
from tailorstore.formats.skeleton import fill_tensors, slots_of
from tailorstore.formats.tensors import byte_view, dtype_from_name
from tailorstore.store.repo import StepReader


def write_file(repo: StepReader, manifest: int, row: FileRecord, target: Path, where: str, trust: bool) -> None:
    if row.kind == SAFETENSORS:
        _write_safetensors(repo, manifest, row, target, where)
    else:
        _write_torch(repo, manifest, row, target, where, trust)


def _atoms_by_slot(contents: Contents, manifest: int, path: str) -> dict[int, list[AtomRecord]]:
    by_slot: dict[int, list[AtomRecord]] = defaultdict(list)
    for atom in contents.atoms(manifest, path=path):
        by_slot[atom.slot].append(atom)
    return by_slot


def _fill(repo: StepReader, manifest: int, tensor: torch.Tensor, atoms: list[AtomRecord], where: str) -> None:
    """Decode every atom of one tensor into place; the atoms must tile it exactly."""
    data = byte_view(tensor)
    size = tensor.element_size()
    cursor = 0
    for atom in atoms:
        if atom.offset != cursor or atom.dtype != str(tensor.dtype).removeprefix("torch."):
            raise CorruptStoreError(f"{where}: atoms of a tensor leave a gap, overlap or change dtype at {cursor}")
        piece = data[atom.offset * size : (atom.offset + atom.numel) * size]
        decode_atom_into(repo, manifest, atom, piece, where)
        cursor += atom.numel
    if cursor != tensor.numel():
        raise CorruptStoreError(f"{where}: atoms cover {cursor} of {tensor.numel()} elements of a tensor")


def _check_param_shapes(obj: Any, where: str) -> None:
    """Module weights must have the shapes DeepSpeed's own param_shapes record."""
    if not isinstance(obj, dict) or not isinstance(obj.get("module"), dict):
        return
    shapes: dict[str, Any] = {}
    groups = obj.get("param_shapes") or []
    for group in groups if isinstance(groups, list) else [groups]:
        shapes.update(group)
    for name, tensor in obj["module"].items():
        if name in shapes and tensor.numel() and tuple(tensor.shape) != tuple(shapes[name]):
            raise LayoutError(
                f"{where}: {name} has shape {tuple(tensor.shape)}, param_shapes say {tuple(shapes[name])}"
            )


def _write_torch(repo: StepReader, manifest: int, row: FileRecord, target: Path, where: str, trust: bool) -> None:
    skeleton = load_skeleton(repo.read_blob(row.blob, where), where, trusted=row.trusted, trust_pickles=trust)
    by_slot = _atoms_by_slot(repo.view(Contents), manifest, row.path)
    tensors: dict[int, torch.Tensor] = {}
    for slot in slots_of(skeleton):
        tensor = torch.empty(slot.shape, dtype=dtype_from_name(slot.dtype))
        _fill(repo, manifest, tensor, by_slot.get(slot.slot, []), f"{where}, tensor slot {slot.slot}")
        tensors[slot.slot] = tensor
    obj = fill_tensors(skeleton, tensors)
    _check_param_shapes(obj, where)
    torch.save(obj, target)


def _write_safetensors(repo: StepReader, manifest: int, row: FileRecord, target: Path, where: str) -> None:
    header = repo.read_blob(row.blob, where)
    by_slot = _atoms_by_slot(repo.view(Contents), manifest, row.path)
    with os.fdopen(create_new(target), "wb") as f:  # a new file of our own hidden folder
        f.write(header)
        for slot, (name, dtype, shape) in enumerate(tensor_layout(header, where)):
            tensor = torch.empty(shape, dtype=dtype_from_name(dtype))
            _fill(repo, manifest, tensor, by_slot.get(slot, []), f"{where}, tensor {name}")
            f.write(byte_view(tensor))
