"""Splitting an object tree into a tensor-free skeleton and its tensors, and back.

Dicts (with their exact type, OrderedDict included), lists and plain tuples are walked;
every tensor is replaced by a :class:`TensorSlot`. Other objects (torch.Size, enums,
DeepSpeed's LossScaler, or their torch-free stand-ins) stay in the skeleton as they are, so the skeleton pickles
back to an equal structure.
"""

from __future__ import annotations

import copy
import sys
from typing import Any

from tailorstore.core.atom_types import TensorEntry, TensorSlot, dtype_name
from tailorstore.core.errors import BadCheckpointError
from tailorstore.core.tensor_ref import TensorRef

MAX_DEPTH = 200  # DeepSpeed's deepest tree is about 6 levels
MIN_NODE_BUDGET = 1_000_000


def split_tensors(obj: Any, *, where: str = "", file_size: int = 0) -> tuple[Any, list[TensorEntry]]:
    """Skeleton and tensors of an object tree, at a bounded cost.

    A pickle can share one list many times over ("billion laughs") or nest thousands deep;
    walking either would take unbounded time, memory or stack. The walk visits at most
    ``max(1e6, file_size / 16)`` nodes and 200 levels, and refuses the file past either bound.
    An input that holds our own TensorSlot type is refused too: checkout could not tell it
    from the slots we put in.
    """
    entries: list[TensorEntry] = []
    budget = max(MIN_NODE_BUDGET, file_size // 16)
    visited = 0

    def refuse(why: str) -> BadCheckpointError:
        return BadCheckpointError(
            f"{where}: {why}; this is not the structure of a DeepSpeed or torch checkpoint, so it was not committed."
        )

    def walk(node: Any, path: str, depth: int = 0) -> Any:
        nonlocal visited
        visited += 1
        if visited > budget:
            raise refuse(f"the pickle's object tree has more than {budget} nodes (shared many times over?)")
        if depth > MAX_DEPTH:
            raise refuse(f"the pickle's object tree nests deeper than {MAX_DEPTH} levels")
        if isinstance(node, TensorSlot):
            raise refuse("it holds tailorstore's own TensorSlot objects")
        if _is_tensor(node):
            slot = TensorSlot(len(entries), dtype_name(node.dtype), tuple(node.shape))
            entries.append(TensorEntry(slot=slot.slot, path=path, tensor=node))
            return slot
        if isinstance(node, dict):
            out = copy.copy(node)
            out.clear()
            for key, value in node.items():
                out[key] = walk(value, f"{path}/{key}" if path else str(key), depth + 1)
            return out
        if type(node) is list:
            return [walk(v, f"{path}/{i}", depth + 1) for i, v in enumerate(node)]
        if type(node) is tuple:
            return tuple(walk(v, f"{path}/{i}", depth + 1) for i, v in enumerate(node))
        return node

    return walk(obj, ""), entries


def _is_tensor(node: Any) -> bool:
    """A TensorRef (the torch-free readers), or a torch tensor (the torch fallback). Without torch
    imported, nothing can be a torch tensor, so this never imports it."""
    if isinstance(node, TensorRef):
        return True
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(node, torch.Tensor)


def fill_tensors(skeleton: Any, tensors: dict[int, Any]) -> Any:
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
