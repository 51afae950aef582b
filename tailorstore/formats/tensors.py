"""Torch tensors as bytes: the two helpers the torch-reading paths share.

Only readers of pickled checkpoints and the re-pickling checkout import this module, so a
process that needs neither never imports torch."""

from __future__ import annotations

import torch


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def byte_view(tensor: torch.Tensor) -> memoryview:
    """The raw bytes of a tensor in element order; copied only when the tensor is a strided view."""
    flat = tensor.reshape(-1).contiguous()
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")
