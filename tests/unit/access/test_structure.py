"""A model's structure (access/structure.py), built from its pieces, and the differences of two."""

from __future__ import annotations

from tailorstore.access import structure
from tailorstore.core import atom_types as A


def test_structure_from_pieces_and_its_differences() -> None:
    segs = [
        A.Segment(0, 10, "w1", A.MASTER, 0, 0, "block.0"),
        A.Segment(0, 6, "w1", A.MASTER, 1, 10, "block.0"),
        A.Segment(0, 16, "w1", A.WEIGHT, 0, 0, "block.0"),
        A.Segment(0, 4, "w2", A.EXP_AVG, 0, 0, "block.0"),
    ]
    assert structure.from_segments(segs) == {"w1": 16}
    assert structure.differences({"w1": 16}, {"w1": 16}) == []
    assert structure.differences({"w1": 16, "w0": 1}, {"w1": 15, "w3": 2}) == [
        "w3 is new",
        "w0 is gone",
        "w1 has 15 elements, not 16",
    ]
