"""DCP's chunks checked to tile their tensor exactly once, in bounded work (formats/dcp.py).

A hostile ``.metadata`` of one tensor cut into thousands of column chunks made the old sweep along
the first dimension compare every pair (quadratic: 8,000 chunks took most of a minute); the check
now lays the chunks on the grid their edges make, and refuses a layout no planner writes."""

from __future__ import annotations

import pytest

from tailorstore.core.errors import BadCheckpointError
from tailorstore.formats.dcp import Chunk, TensorInfo, _check_tiling


def _grid(rows: list[int], cols: list[int]) -> list[Chunk]:
    out, r0 = [], 0
    for r in rows:
        c0 = 0
        for c in cols:
            out.append(Chunk((r0, c0), (r, c)))
            c0 += c
        r0 += r
    return out


def test_row_column_and_two_dimensional_cuts_tile_and_a_scalar_too() -> None:
    _check_tiling("w", (10, 6), _grid([3, 3, 4], [6]), "m")
    _check_tiling("w", (10, 6), _grid([10], [1, 2, 3]), "m")
    _check_tiling("w", (10, 6), _grid([5, 5], [2, 2, 2]), "m")
    _check_tiling("step", (), [Chunk((), ())], "m")
    _check_tiling("empty", (0, 4), [Chunk((0, 0), (0, 4))], "m")


def test_overlapping_and_missing_chunks_are_refused() -> None:
    overlap = [Chunk((0, 0), (5, 6)), Chunk((4, 0), (4, 6)), Chunk((9, 0), (1, 6))]  # sizes add up to 60
    with pytest.raises(BadCheckpointError, match="overlap"):
        _check_tiling("w", (10, 6), overlap, "m")
    with pytest.raises(BadCheckpointError, match="exactly once"):
        _check_tiling("w", (10, 6), _grid([3, 3], [6]), "m")


def test_twenty_thousand_column_chunks_are_checked_in_linear_work() -> None:
    cols = [1] * 20_000
    _check_tiling("w", (4, 20_000), _grid([4], cols), "m")
    info = TensorInfo("float32", (4, 20_000), _grid([4], cols))
    assert info.chunk_at((0, 19_999)) is info.chunks[-1] and info.chunk_at((1, 0)) is None


def test_a_layout_whose_edges_make_far_more_cells_than_chunks_is_refused() -> None:
    """Staggered chunks (each row of chunks cut at other columns): no planner writes that, and its
    grid would be the square of the chunk count."""
    n = 3000
    chunks = [Chunk((r, 0), (1, r + 1)) for r in range(n)] + [Chunk((r, r + 1), (1, n - r - 1)) for r in range(n - 1)]
    with pytest.raises(BadCheckpointError, match="not laid out as a grid"):
        _check_tiling("w", (n, n), chunks, "m")
