"""How much a layer moved: ||w - w_ref|| / ||w_ref|| over its FP32 master.

The adaptive policy, ``tailor diff`` and ``tailor plot`` all use this measure. Masters are
compared piece by piece, keyed by (parameter, rank, first element), so both sides must come
from the same partitioning (same world size and ZeRO stage).
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from tailorstore.access.atom_reader import decode_atom
from tailorstore.access.contents import Contents
from tailorstore.core import atom_types as A
from tailorstore.core.rounding import widened
from tailorstore.store.repo import StepReader

if TYPE_CHECKING:  # the commit passes them; diff, which imports this too, never reads a file
    from tailorstore.formats.reader import ReadFile
    from tailorstore.formats.source import InputFile

PieceKey = tuple[str, int, int]


def masters_by_layer(f: ReadFile, src: InputFile, kind: str = A.MASTER) -> dict[str, dict[PieceKey, np.ndarray]]:
    """One input file's pieces of ``kind``, by layer, each read from the file into private memory."""
    out: dict[str, dict[PieceKey, np.ndarray]] = defaultdict(dict)
    for entry in f.entries:
        for seg in entry.segments:
            if seg.kind == kind and seg.numel:
                data = f.piece(src, entry, seg)
                out[seg.layer][(seg.param, seg.rank, seg.start)] = widened(data, entry.dtype_name)
    return out


def stored_pieces(
    repo: StepReader, manifest: int, layer: str, kind: str = A.MASTER, keys: set[PieceKey] | None = None
) -> dict[PieceKey, np.ndarray]:
    """Decode a layer's pieces of one kind from the store (derived weights are rebuilt).

    ``keys`` limits the decoding to those pieces, so a caller streaming file by file holds
    only one file's worth.
    """
    atoms = sorted(
        repo.view(Contents).atoms(manifest, layer=layer, kind=kind), key=lambda a: (a.param, a.rank, a.start)
    )
    return {
        (a.param, a.rank, a.start): widened(decode_atom(repo, manifest, a, "measuring change"), a.dtype)
        for a in atoms
        if keys is None or (a.param, a.rank, a.start) in keys
    }


@dataclass(frozen=True)
class ChangeTerms:
    """One file's share of a layer's change: (||w - w_ref||^2, ||w_ref||^2) per piece, in order."""

    pieces: tuple[tuple[float, float], ...]
    matched: bool = True


def change_terms(current: dict[PieceKey, np.ndarray], reference: dict[PieceKey, np.ndarray]) -> ChangeTerms:
    if set(current) != set(reference):
        return ChangeTerms((), matched=False)
    return ChangeTerms(
        tuple(
            (
                float(np.sum(np.square(values - reference[key]), dtype=np.float64)),
                float(np.sum(np.square(reference[key]), dtype=np.float64)),
            )
            for key, values in current.items()
        )
    )


class LayerChange:
    """Accumulates ||w - w_ref||^2 and ||w_ref||^2 over the pieces of one layer as they stream by."""

    def __init__(self) -> None:
        self.diff = 0.0
        self.ref = 0.0
        self.pieces = 0
        self.matched = True

    def add(self, current: dict[PieceKey, np.ndarray], reference: dict[PieceKey, np.ndarray]) -> None:
        self.add_terms(change_terms(current, reference))

    def add_terms(self, terms: ChangeTerms) -> None:
        """Add one file's terms, piece by piece in their order: the same sums, in the same order,
        whether one process measures every file or each rank its own (ingest/rank_share.py)."""
        if not terms.matched:
            self.matched = False
            return
        for diff, ref in terms.pieces:
            self.diff += diff
            self.ref += ref
        self.pieces += len(terms.pieces)

    def value(self) -> float:
        if self.ref == 0.0:
            return 0.0 if self.diff == 0.0 else math.inf
        return math.sqrt(self.diff / self.ref)


def relative_change(current: dict[PieceKey, np.ndarray], reference: dict[PieceKey, np.ndarray]) -> float | None:
    """None when the two sides do not hold the same pieces (different layout)."""
    if not reference or set(current) != set(reference):
        return None
    change = LayerChange()
    change.add(current, reference)
    return change.value()
