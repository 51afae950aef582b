"""Where each parameter lies inside DeepSpeed's flat ZeRO partitions.

DeepSpeed flattens each optimizer param group into one buffer and hands every
data-parallel rank a slice of it. To store a parameter's state once per parameter (and to
tailor it by layer), the slices are cut back at parameter boundaries, with the same
bookkeeping DeepSpeed's own ``ds_to_universal`` and ``zero_to_fp32`` use:

* ZeRO 1/2 (and the BF16_Optimizer): a group's parameters are laid end to end in
  ``param_shapes`` order, each followed by its ``param_alignment_paddings`` entry; the
  whole is padded and split into equal partitions, rank r holding ``[r*P, (r+1)*P)``. A
  parameter may straddle two ranks.
* ZeRO 3: every parameter is split on its own into ``ceil(numel / world)`` elements per
  rank, the last rank's piece padded; a rank's flat group is its pieces end to end.

The result is a list of :class:`Piece`; a piece with ``param=None`` is padding.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from tailorstore.core.errors import LayoutError


@dataclass(frozen=True)
class Piece:
    offset: int  # first element within the rank's flat partition
    numel: int
    param: str | None  # None for padding
    start: int  # first element within the parameter (for padding: == offset)


def _fill_gaps(pieces: list[Piece], total: int) -> list[Piece]:
    """Cover [0, total) completely, naming every gap as padding."""
    out: list[Piece] = []
    cursor = 0
    for piece in sorted(pieces, key=lambda p: p.offset):
        if piece.offset < cursor:
            raise LayoutError(f"parameter {piece.param} overlaps another inside the flat partition")
        if piece.offset > cursor:
            out.append(Piece(cursor, piece.offset - cursor, None, cursor))
        out.append(piece)
        cursor = piece.offset + piece.numel
    if cursor > total:
        raise LayoutError(f"parameters need {cursor} elements but the flat partition has only {total}")
    if cursor < total:
        out.append(Piece(cursor, total - cursor, None, cursor))
    return out


def zero12_pieces(
    shapes: Sequence[tuple[str, int]],
    alignment_paddings: Sequence[int] | None,
    rank: int,
    partition_numel: int,
    saved_numel: int | None = None,
) -> list[Piece]:
    """Cut rank ``rank``'s partition of one ZeRO 1/2 param group at parameter boundaries.

    DeepSpeed saves the last rank's partition without its group padding, so the saved
    flat tensor (``saved_numel``) may be shorter than the partition all ranks share.
    """
    saved = partition_numel if saved_numel is None else saved_numel
    if alignment_paddings is not None and len(alignment_paddings) != len(shapes):
        raise LayoutError(f"{len(alignment_paddings)} alignment paddings for {len(shapes)} parameters in one group")
    lo, hi = rank * partition_numel, (rank + 1) * partition_numel
    pieces: list[Piece] = []
    offset = 0
    for i, (name, numel) in enumerate(shapes):
        begin, end = max(offset, lo), min(offset + numel, hi, lo + saved)
        if begin < end:
            pieces.append(Piece(begin - lo, end - begin, name, begin - offset))
        offset += numel + (alignment_paddings[i] if alignment_paddings else 0)
    return _fill_gaps(pieces, saved)


def zero3_pieces(shapes: Sequence[tuple[str, int]], world_size: int, rank: int, flat_numel: int) -> list[Piece]:
    """Cut rank ``rank``'s flat group of ZeRO 3 into per-parameter pieces."""
    pieces: list[Piece] = []
    offset = 0
    for name, numel in shapes:
        per_rank = math.ceil(numel / world_size)
        first = rank * per_rank
        own = max(0, min(first + per_rank, numel) - first)
        if own:
            pieces.append(Piece(offset, own, name, first))
        offset += per_rank
    if offset > flat_numel:
        raise LayoutError(f"ZeRO-3 parameters need {offset} elements on rank {rank}, the group has {flat_numel}")
    return _fill_gaps(pieces, flat_numel)


def check_slice_mappings(pieces: Sequence[Piece], mappings: Mapping[str, object]) -> None:
    """Cross-check our cut against DeepSpeed's ``param_slice_mappings`` of the same rank."""
    ours = {p.param: (p.offset, p.numel) for p in pieces if p.param is not None}
    for name, address in mappings.items():
        theirs = (int(address.start), int(address.numel))  # type: ignore[attr-defined]
        if ours.get(name) != theirs:
            raise LayoutError(
                f"parameter {name}: DeepSpeed records (start, numel) {theirs} in this partition, "
                f"param_shapes give {ours.get(name)}"
            )
    extra = set(ours) - set(mappings)
    if extra:
        raise LayoutError(f"parameters {sorted(extra)[:3]} fall in this partition but DeepSpeed lists them nowhere")
