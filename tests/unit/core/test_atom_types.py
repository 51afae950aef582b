"""Atom types (core/atom_types.py): the classes a stored skeleton names are part of the format."""

from __future__ import annotations

import pickle

from tailorstore.core import atom_types as A


def test_stored_skeletons_name_tensor_slot_as_they_always_did() -> None:
    """The class a skeleton pickle names is part of the format (FORMAT.md 3.2): moving the module
    into core/ must not change the bytes a commit stores, nor stop old skeletons from loading."""
    data = pickle.dumps(A.TensorSlot(0, "float32", (1,)), protocol=2)
    assert b"tailorstore.atoms" in data and b"tailorstore.core" not in data
    assert pickle.loads(data) == A.TensorSlot(0, "float32", (1,))
