"""Derived weights: the bf16/fp16 model weight that is exactly the FP32 master, rounded.

In mixed precision DeepSpeed makes each low-precision weight by rounding its FP32 master,
so storing both stores the same information twice. At commit, the masters stream by first
(optimizer files are read before model-states files); each parameter's master is rounded to
the weight's dtype and only the xxh3-128 of the rounded bytes is kept. When the weight comes,
a weight whose own xxh3-128 equals that hash is marked derived and gets no blob; checkout
rebuilds it from the master atoms of the same manifest and checks the rebuilt bytes against
the weight's recorded hash, so a derived weight can never come back wrong. Where the
rounding does not reproduce the weight (edited weights, another rounding), it is stored.
Commit and checkout round with the same numpy code (rounding.py).
"""

from __future__ import annotations

from tailorstore.core import atom_types as A
from tailorstore.core.rounding import ROUNDED_DTYPES
from tailorstore.ingest.pieces_ahead import Prepared
from tailorstore.store.codec import content_hash


def is_derivable_weight(entry: A.TensorEntry, seg: A.Segment) -> bool:
    """A whole low-precision weight: the pieces a rounded FP32 master may stand in for."""
    return seg.kind == A.WEIGHT and seg.start == 0 and entry.dtype_name in ROUNDED_DTYPES


class RoundedMasters:
    """Hashes of each parameter's whole FP32 master rounded to its weight's dtype.

    Pieces of one parameter may arrive from several files (ranks); only the pieces of a
    parameter not yet complete are held, rounded (2 bytes an element).
    """

    def __init__(self, weights: dict[str, tuple[str, int]], checked: frozenset[tuple[str, str]] = frozenset()) -> None:
        self.weights = weights  # param -> (weight dtype name, numel), for low-precision weights only
        self._pending: dict[str, dict[int, memoryview]] = {}
        self.hashes: dict[str, str] = {}
        # (file, param): weights whose masters other ranks hold and compared range by range, all equal
        self.checked = checked

    def rounding_of(self, seg: A.Segment, dtype: str) -> tuple[str, bool] | None:
        """For a master piece this needs rounded: the weight's dtype, and whether the piece is the
        whole parameter (then its rounded bytes' name is the weight's). None for any other piece."""
        if dtype != "float32" or seg.kind != A.MASTER or seg.param not in self.weights or seg.param in self.hashes:
            return None
        weight_dtype, numel = self.weights[seg.param]
        return weight_dtype, seg.start == 0 and seg.numel == numel

    def add_piece(self, seg: A.Segment, dtype: str, piece: Prepared) -> None:
        """A master piece as read from its file, rounded when :meth:`rounding_of` asked for it
        (pieces_ahead.py): held until its parameter is whole."""
        if seg.param in self.hashes:
            return
        if piece.rounded_digest is not None:  # the whole parameter in one piece, named already
            self.hashes[seg.param] = piece.rounded_digest
            return
        if piece.rounded is None:
            return
        self._pending.setdefault(seg.param, {})[seg.start] = piece.rounded
        self._complete(seg.param)

    def _complete(self, param: str) -> None:
        pieces = self._pending[param]
        _, numel = self.weights[param]
        cursor = 0
        ordered = []
        for start in sorted(pieces):
            if start != cursor:
                return
            ordered.append(pieces[start])
            cursor += len(pieces[start]) // 2
        if cursor != numel:
            return
        whole = b"".join(ordered) if len(ordered) > 1 else ordered[0]
        self.hashes[param] = content_hash(whole)
        del self._pending[param]

    def may_derive(self, path: str, param: str) -> bool:
        return param in self.hashes or (path, param) in self.checked

    def derivable(self, path: str, seg: A.Segment, weight_hash: str) -> bool:
        if seg.kind != A.WEIGHT or seg.start != 0:
            return False
        return self.hashes.get(seg.param) == weight_hash or (path, seg.param) in self.checked
