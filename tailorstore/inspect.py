"""``tailor log`` and ``tailor show``: what the store holds, from the index alone.

Both read only SQLite rows (no blob is opened), so they stay fast however large the
checkpoints are; ``benchmarks/`` times them on a store of 1,000 steps.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from .layers import sort_key
from .store.repo import Repository


@dataclass
class StepSummary:
    step: int
    manifest: int
    origin: str
    created_at: float
    tag: str | None
    raw_bytes: int
    new_bytes: int
    exact: bool
    pinned: bool
    policy: dict


@dataclass
class LayerSummary:
    layer: str
    source_step: int
    stored: bool
    kinds: list[str] = field(default_factory=list)
    raw_bytes: int = 0
    stored_bytes: int = 0  # compressed size of the distinct blobs behind this layer
    derived_bytes: int = 0  # raw bytes rebuilt from the FP32 master instead of stored
    change: float | None = None


@dataclass
class StepDetail:
    summary: StepSummary
    layers: list[LayerSummary] = field(default_factory=list)
    derived_bytes: int = 0


_SUMMARY = "SELECT id, step, origin, created_at, tag, raw_bytes, new_bytes, exact, pinned, policy FROM manifests"


def _summary(r: object) -> StepSummary:
    return StepSummary(
        step=r["step"],
        manifest=r["id"],
        origin=r["origin"],
        created_at=r["created_at"],
        tag=r["tag"],  # type: ignore[index]
        raw_bytes=r["raw_bytes"],
        new_bytes=r["new_bytes"],
        exact=bool(r["exact"]),  # type: ignore[index]
        pinned=bool(r["pinned"]),
        policy=json.loads(r["policy"]),  # type: ignore[index]
    )


def log(store: Repository) -> list[StepSummary]:
    return [_summary(r) for r in store.conn.execute(f"{_SUMMARY} ORDER BY step, id")]


def show(store: Repository, selector: str) -> StepDetail:
    manifest = store.resolve(selector)
    summary = _summary(store.conn.execute(f"{_SUMMARY} WHERE id=?", (manifest,)).fetchone())
    per_layer = {
        r["layer"]: LayerSummary(r["layer"], r["source_step"], bool(r["stored"]), change=r["change"])
        for r in store.conn.execute(
            "SELECT layer, source_step, stored, change FROM layers WHERE manifest=?", (manifest,)
        )
    }
    for r in store.conn.execute(
        "SELECT layer, group_concat(DISTINCT kind) AS kinds, sum(nbytes) AS raw,"
        " sum(CASE WHEN derived IS NULL THEN 0 ELSE nbytes END) AS derived"
        " FROM atoms WHERE manifest=? GROUP BY layer",
        (manifest,),
    ):
        layer = per_layer.setdefault(r["layer"], LayerSummary(r["layer"], summary.step, True))
        layer.kinds = sorted(set(r["kinds"].split(",")))
        layer.raw_bytes, layer.derived_bytes = r["raw"], r["derived"]
    for r in store.conn.execute(
        "SELECT layer, sum(stored_size) AS stored FROM (SELECT DISTINCT a.layer, a.blob, b.stored_size"
        " FROM atoms a JOIN blobs b ON b.hash = a.blob WHERE a.manifest=? AND a.derived IS NULL) GROUP BY layer",
        (manifest,),
    ):
        per_layer[r["layer"]].stored_bytes = r["stored"]
    layers = sorted(per_layer.values(), key=lambda x: sort_key(x.layer))
    return StepDetail(summary, layers, sum(x.derived_bytes for x in layers))
