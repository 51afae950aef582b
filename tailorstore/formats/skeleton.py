"""Splitting an object tree into a tensor-free skeleton and its tensors, and back.

Dicts (with their exact type, OrderedDict included), lists and plain tuples are walked;
every tensor is replaced by a :class:`TensorSlot`. Other objects (torch.Size, enums,
DeepSpeed's LossScaler, ...) stay in the skeleton as they are, so the skeleton pickles
back to an equal structure.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from ..atoms import TensorEntry, TensorSlot, dtype_name
from ..errors import BadCheckpointError


def split_tensors(obj: Any) -> tuple[Any, list[TensorEntry]]:
    entries: list[TensorEntry] = []

    def walk(node: Any, path: str) -> Any:
        if isinstance(node, torch.Tensor):
            slot = TensorSlot(len(entries), dtype_name(node.dtype), tuple(node.shape))
            entries.append(TensorEntry(slot=slot.slot, path=path, tensor=node))
            return slot
        if isinstance(node, dict):
            out = copy.copy(node)
            out.clear()
            for key, value in node.items():
                out[key] = walk(value, f"{path}/{key}" if path else str(key))
            return out
        if type(node) is list:
            return [walk(v, f"{path}/{i}") for i, v in enumerate(node)]
        if type(node) is tuple:
            return tuple(walk(v, f"{path}/{i}") for i, v in enumerate(node))
        return node

    return walk(obj, ""), entries


def fill_tensors(skeleton: Any, tensors: dict[int, torch.Tensor]) -> Any:
    """Put tensors back where their slots are; the skeleton itself is not changed."""

    def walk(node: Any) -> Any:
        if isinstance(node, TensorSlot):
            try:
                return tensors[node.slot]
            except KeyError:
                raise BadCheckpointError(f"tensor slot {node.slot} has no data in the manifest") from None
        if isinstance(node, dict):
            out = copy.copy(node)
            out.clear()
            for key, value in node.items():
                out[key] = walk(value)
            return out
        if type(node) is list:
            return [walk(v) for v in node]
        if type(node) is tuple:
            return tuple(walk(v) for v in node)
        return node

    return walk(skeleton)


def slots_of(skeleton: Any) -> list[TensorSlot]:
    found: list[TensorSlot] = []

    def walk(node: Any) -> None:
        if isinstance(node, TensorSlot):
            found.append(node)
        elif isinstance(node, dict):
            for value in node.values():
                walk(value)
        elif type(node) in (list, tuple):
            for value in node:
                walk(value)

    walk(skeleton)
    return found
