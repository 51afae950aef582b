"""Bit-exact comparison of checkpoint object trees, for tests and the demo."""

from __future__ import annotations

import filecmp
from pathlib import Path
from typing import Any

import torch


def same_tree(a: Path, b: Path) -> bool:
    """The two directories hold the same files with the same bytes (compared in chunks, so
    checkpoint files of gigabytes are never held whole)."""
    files_a = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    files_b = sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file())
    return files_a == files_b and all(filecmp.cmp(a / f, b / f, shallow=False) for f in files_a)


def tensors_identical(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.numel() == 0:
        return True
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def differences(a: Any, b: Any, path: str = "") -> list[str]:
    """Every place where two loaded checkpoints differ: type, keys, tensor bits or values."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or not tensors_identical(a, b):
            return [f"{path}: tensors differ"]
        return []
    if type(a) is not type(b):
        return [f"{path}: {type(a).__name__} != {type(b).__name__}"]
    if isinstance(a, dict):
        if list(a) != list(b):
            return [f"{path}: keys differ"]
        return [d for k in a for d in differences(a[k], b[k], f"{path}/{k}")]
    if isinstance(a, (list, tuple)) and not isinstance(a, torch.Size):
        if len(a) != len(b):
            return [f"{path}: lengths differ"]
        return [d for i, (x, y) in enumerate(zip(a, b, strict=True)) for d in differences(x, y, f"{path}/{i}")]
    if repr(a) != repr(b):
        return [f"{path}: {a!r} != {b!r}"]
    return []
