"""A model's structure: which parameters it has and how many elements each holds.

Layer inheritance, merges and ``diff`` compare pieces of the same parameter across steps, so
they only make sense between steps of one model. A commit reads the structure off the
pieces it cuts (weights and FP32 masters, whatever the ZeRO stage), and the store's earlier
steps give theirs from their atom rows; a commit of another model is refused unless forced.
"""

from __future__ import annotations

import sqlite3

from . import atoms as A
from .errors import StoreError

Structure = dict[str, int]  # parameter -> elements


def from_segments(segments: list[A.Segment]) -> Structure:
    """Pure: each parameter's element count, as the end of its furthest weight or master piece."""
    out: Structure = {}
    for seg in segments:
        if seg.kind in (A.WEIGHT, A.MASTER) and seg.numel:
            out[seg.param] = max(out.get(seg.param, 0), seg.start + seg.numel)
    return out


def of_manifest(conn: sqlite3.Connection, manifest: int) -> Structure:
    return {
        r[0]: r[1]
        for r in conn.execute(
            "SELECT param, max(start + numel) FROM atoms WHERE manifest=? AND kind IN (?, ?) AND numel > 0"
            " GROUP BY param",
            (manifest, A.WEIGHT, A.MASTER),
        )
    }


def differences(old: Structure, new: Structure, limit: int = 3) -> list[str]:
    """Pure: what differs, in words, at most ``limit`` items (empty when the structures agree)."""
    out = [f"{p} is new" for p in sorted(set(new) - set(old))]
    out += [f"{p} is gone" for p in sorted(set(old) - set(new))]
    out += [f"{p} has {new[p]} elements, not {old[p]}" for p in sorted(set(old) & set(new)) if old[p] != new[p]]
    return out[:limit] + ([f"and {len(out) - limit} more"] if len(out) > limit else [])


def refuse_other_model(conn: sqlite3.Connection, new: Structure) -> None:
    """Refuse a commit whose model differs from the newest committed step's (a different run)."""
    row = conn.execute("SELECT id, step FROM manifests WHERE origin='commit' ORDER BY id DESC LIMIT 1").fetchone()
    if row is None or not new:
        return
    old = of_manifest(conn, row["id"])
    diff = differences(old, new)
    if old and diff:
        raise StoreError(
            f"this checkpoint holds a different model from step {row['step']} in the store ({'; '.join(diff)}). "
            "Keep each model in its own store, or pass --force to commit it here anyway."
        )
