"""Derived weights: the bf16/fp16 model weight that is exactly the FP32 master, rounded.

In mixed precision DeepSpeed makes each low-precision weight by rounding its FP32 master,
so storing both stores the same information twice. At commit we check this per atom, bit
for bit; where it holds the weight gets no blob, only a marker, and checkout rebuilds it
from the master atoms of the same manifest and checks the result against the weight's
recorded hash. Where it does not hold (a user edited weights, another rounding), the
weight is stored as usual.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch

from . import atoms as A

ROUND_FROM_MASTER = "round-from-master"
_LOW_PRECISION = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class MasterPiece:
    start: int
    numel: int
    data: torch.Tensor  # 1-D float32 view into the loaded file


def master_pieces(entries: list[A.TensorEntry]) -> dict[str, list[MasterPiece]]:
    by_param: dict[str, list[MasterPiece]] = defaultdict(list)
    for entry in entries:
        if entry.tensor.dtype != torch.float32:
            continue
        flat = entry.tensor.reshape(-1)
        for seg in entry.segments:
            if seg.kind == A.MASTER:
                by_param[seg.param].append(MasterPiece(seg.start, seg.numel, flat[seg.offset : seg.offset + seg.numel]))
    return by_param


def assemble(pieces: list[MasterPiece], numel: int) -> torch.Tensor | None:
    """The whole FP32 master of a parameter from its pieces, or None if they do not tile it."""
    ordered = sorted({(p.start, p.numel): p for p in pieces}.values(), key=lambda p: p.start)
    cursor = 0
    for piece in ordered:
        if piece.start != cursor:
            return None
        cursor += piece.numel
    if cursor != numel:
        return None
    return torch.cat([p.data for p in ordered]) if len(ordered) > 1 else ordered[0].data


def derivable(weight: torch.Tensor, seg: A.Segment, masters: dict[str, list[MasterPiece]]) -> bool:
    """Is this weight atom exactly its master rounded? Checked bit for bit."""
    if seg.kind != A.WEIGHT or weight.dtype not in _LOW_PRECISION or seg.start != 0 or seg.param not in masters:
        return False
    master = assemble(masters[seg.param], seg.numel)
    if master is None:
        return False
    piece = weight.reshape(-1)[seg.offset : seg.offset + seg.numel]
    rounded = master.to(weight.dtype)
    return torch.equal(rounded.view(torch.int16), piece.view(torch.int16))


def rebuild(master: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return master.to(dtype)
