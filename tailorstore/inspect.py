"""``tailor log`` and ``tailor show``: what the store holds, from the index alone.

Both read only SQLite rows (no blob is opened), so they stay fast however large the
checkpoints are; ``benchmarks/`` times them on a store of 1,000 steps.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from .layers import sort_key
from .store.repo import Store


@dataclass
class StepSummary:
    step: int
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
    kinds: list[str]
    raw_bytes: int
    stored_bytes: int  # compressed size of the distinct blobs behind this layer
    change: float | None


@dataclass
class StepDetail:
    summary: StepSummary
    layers: list[LayerSummary] = field(default_factory=list)
    files: list[dict] = field(default_factory=list)


def log(store: Store) -> list[StepSummary]:
    return log_rows(store)


def show(store: Store, selector: str) -> StepDetail:
    step = store.resolve(selector)
    summary = log_rows(store, "WHERE step=?", (step,))[0]
    per_layer: dict[str, LayerSummary] = {}
    for r in store.conn.execute("SELECT layer, source_step, change FROM layers WHERE step=?", (step,)):
        per_layer[r["layer"]] = LayerSummary(r["layer"], r["source_step"], [], 0, 0, r["change"])
    for r in store.conn.execute(
        """
        SELECT a.layer, group_concat(DISTINCT a.kind) AS kinds, sum(b.raw_size) AS raw
        FROM atoms a JOIN blobs b ON b.hash = a.blob WHERE a.step=? GROUP BY a.layer
        """,
        (step,),
    ):
        layer = per_layer.setdefault(r["layer"], LayerSummary(r["layer"], step, [], 0, 0, None))
        layer.kinds = sorted(set(r["kinds"].split(",")))
        layer.raw_bytes = r["raw"]
    for r in store.conn.execute(
        """
        SELECT layer, sum(stored_size) AS stored FROM (
            SELECT DISTINCT a.layer, a.blob, b.stored_size FROM atoms a JOIN blobs b ON b.hash = a.blob
            WHERE a.step=?)
        GROUP BY layer
        """,
        (step,),
    ):
        per_layer[r["layer"]].stored_bytes = r["stored"]
    files = [
        dict(r)
        for r in store.conn.execute(
            "SELECT path, kind, rank, raw_size FROM files WHERE step=? ORDER BY path", (step,)
        )
    ]
    layers = sorted(per_layer.values(), key=lambda x: sort_key(x.layer))
    return StepDetail(summary, layers, files)


def log_rows(store: Store, where: str = "", args: tuple = ()) -> list[StepSummary]:
    rows = store.conn.execute(
        "SELECT step, created_at, tag, raw_bytes, new_bytes, exact, pinned, policy FROM steps "
        f"{where} ORDER BY step",
        args,
    ).fetchall()
    return [
        StepSummary(r["step"], r["created_at"], r["tag"], r["raw_bytes"], r["new_bytes"], bool(r["exact"]),
                    bool(r["pinned"]), json.loads(r["policy"]))
        for r in rows
    ]


def to_json(obj: object) -> str:
    return json.dumps(asdict(obj) if hasattr(obj, "__dataclass_fields__") else obj, indent=2)  # type: ignore[arg-type]
