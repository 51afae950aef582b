"""ZeRO partitions (formats/zero_partitions.py): flat partitions cut through parameters, with
alignment and padding, as DeepSpeed cuts them."""

from __future__ import annotations

import pytest

from tailorstore.core.errors import LayoutError
from tailorstore.formats.zero_partitions import Piece, zero3_pieces, zero12_pieces


def test_zero12_cut_through_a_parameter() -> None:
    shapes = [("a", 5), ("b", 6), ("c", 3)]  # 14 elements, two ranks of 7
    assert zero12_pieces(shapes, None, 0, 7) == [Piece(0, 5, "a", 0), Piece(5, 2, "b", 0)]
    assert zero12_pieces(shapes, None, 1, 7) == [Piece(0, 4, "b", 2), Piece(4, 3, "c", 0)]


def test_zero12_alignment_and_unpadded_last_rank() -> None:
    shapes = [("a", 3), ("b", 3)]  # a + 1 alignment element + b = 7, padded to 8
    assert zero12_pieces(shapes, [1, 0], 0, 4) == [Piece(0, 3, "a", 0), Piece(3, 1, None, 3)]
    # The last rank saved only 3 of its 4 elements (its group padding stripped).
    assert zero12_pieces(shapes, [1, 0], 1, 4, saved_numel=3) == [Piece(0, 3, "b", 0)]


def test_zero3_ceil_split_with_padding() -> None:
    shapes = [("a", 5), ("b", 4)]
    assert zero3_pieces(shapes, 2, 0, 5) == [Piece(0, 3, "a", 0), Piece(3, 2, "b", 0)]
    assert zero3_pieces(shapes, 2, 1, 5) == [Piece(0, 2, "a", 3), Piece(2, 1, None, 2), Piece(3, 2, "b", 2)]
    with pytest.raises(LayoutError):
        zero3_pieces(shapes, 2, 1, 4)
