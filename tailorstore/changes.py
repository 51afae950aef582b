"""How much a layer moved: ||w - w_ref|| / ||w_ref|| over its FP32 master.

The adaptive policy, ``tailor diff`` and ``tailor plot`` all use this measure. Masters are
compared piece by piece, keyed by (parameter, rank, first element), so both sides must come
from the same partitioning (same world size and ZeRO stage).
"""

from __future__ import annotations

import math
from collections import defaultdict

import torch

from . import atoms as A
from .atom_reader import decode_atom
from .formats.reader import ReadFile
from .formats.source import InputFile
from .store.repo import Repository

PieceKey = tuple[str, int, int]


def masters_by_layer(f: ReadFile, src: InputFile, kind: str = A.MASTER) -> dict[str, dict[PieceKey, torch.Tensor]]:
    """One input file's pieces of ``kind``, by layer, each read from the file into private memory."""
    out: dict[str, dict[PieceKey, torch.Tensor]] = defaultdict(dict)
    for entry in f.entries:
        for seg in entry.segments:
            if seg.kind == kind and seg.numel:
                data = f.piece(src, entry, seg)
                out[seg.layer][(seg.param, seg.rank, seg.start)] = torch.frombuffer(data, dtype=entry.tensor.dtype)
    return out


def stored_pieces(
    store: Repository, manifest: int, layer: str, kind: str = A.MASTER, keys: set[PieceKey] | None = None
) -> dict[PieceKey, torch.Tensor]:
    """Decode a layer's pieces of one kind from the store (derived weights are rebuilt).

    ``keys`` limits the decoding to those pieces, so a caller streaming file by file holds
    only one file's worth.
    """
    atoms = sorted(store.index.atoms(manifest, layer=layer, kind=kind), key=lambda a: (a.param, a.rank, a.start))
    return {
        (a.param, a.rank, a.start): decode_atom(store, manifest, a, "measuring change")
        for a in atoms
        if keys is None or (a.param, a.rank, a.start) in keys
    }


class LayerChange:
    """Accumulates ||w - w_ref||^2 and ||w_ref||^2 over the pieces of one layer as they stream by."""

    def __init__(self) -> None:
        self.diff = 0.0
        self.ref = 0.0
        self.pieces = 0
        self.matched = True

    def add(self, current: dict[PieceKey, torch.Tensor], reference: dict[PieceKey, torch.Tensor]) -> None:
        if set(current) != set(reference):
            self.matched = False
            return
        with torch.no_grad():
            for key, tensor in current.items():
                old = reference[key].float()
                self.diff += float(torch.sum((tensor.float() - old) ** 2, dtype=torch.float64))
                self.ref += float(torch.sum(old**2, dtype=torch.float64))
        self.pieces += len(current)

    def value(self) -> float:
        if self.ref == 0.0:
            return 0.0 if self.diff == 0.0 else math.inf
        return math.sqrt(self.diff / self.ref)


def relative_change(current: dict[PieceKey, torch.Tensor], reference: dict[PieceKey, torch.Tensor]) -> float | None:
    """None when the two sides do not hold the same pieces (different layout)."""
    if not reference or set(current) != set(reference):
        return None
    change = LayerChange()
    change.add(current, reference)
    return change.value()
