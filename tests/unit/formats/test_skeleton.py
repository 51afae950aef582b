"""Skeletons (formats/skeleton.py): an object tree is walked at a bounded cost."""

from __future__ import annotations

import pickle

import pytest
import torch

from tailorstore.core import atom_types as A
from tailorstore.core.errors import BadCheckpointError
from tailorstore.formats.skeleton import split_tensors


@pytest.mark.slow  # seconds: the fast tier keeps its minute
def test_object_trees_are_walked_at_a_bounded_cost() -> None:
    node: list = []
    for _ in range(9):
        node = [node] * 10
    with pytest.raises(BadCheckpointError, match="nodes"):
        split_tensors({"x": node}, where="f")
    deep = pickle.loads(b"\x80\x02" + b"]" * 500 + b"a" * 499 + b".")
    with pytest.raises(BadCheckpointError, match="deeper"):
        split_tensors(deep, where="f")
    with pytest.raises(BadCheckpointError, match="TensorSlot"):
        split_tensors({"x": A.TensorSlot(0, "float32", (1,))}, where="f")
    skeleton, entries = split_tensors({"a": [torch.zeros(3), 1]}, where="f")
    assert isinstance(skeleton["a"][0], A.TensorSlot) and len(entries) == 1
