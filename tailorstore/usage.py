"""``tailor du``: where the store's bytes go, from the index (no blob is read).

A blob shared by several manifests or kinds is counted once, under the first kind that uses
it. "Held alone" is what dropping that manifest (and running gc) would free; "gc frees now"
is what `tailor gc` without retention rules would delete today.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from . import atoms as A
from .gc import Retention, plan_gc
from .store.repo import Repository

_KIND_GROUPS = {A.WEIGHT: "weights", A.MASTER: "masters", A.EXP_AVG: "moments", A.EXP_AVG_SQ: "moments"}


@dataclass
class KindUsage:
    raw_bytes: int = 0  # what the manifests' atoms of this kind stand for, counting every manifest
    stored_bytes: int = 0  # compressed bytes of the distinct blobs first used by this kind
    derived_bytes: int = 0  # raw bytes rebuilt from the master instead of stored


@dataclass
class StepUsage:
    manifest: int
    step: int
    tag: str | None
    raw_bytes: int
    held_alone: int  # stored bytes of blobs no other manifest uses


@dataclass
class Usage:
    manifests: int
    stored_bytes: int  # blobs as stored, plus the index
    index_bytes: int
    raw_bytes: int  # the checkpoints the manifests check out to
    ratio: float
    kinds: dict[str, KindUsage] = field(default_factory=dict)
    steps: list[StepUsage] = field(default_factory=list)
    gc_frees: int = 0


def usage(store: Repository) -> Usage:
    conn = store.conn
    # what the backend holds for blobs: loose blob objects, and whole packs (trailers and not yet repacked dead bytes)
    blob_bytes = (
        conn.execute("SELECT coalesce(sum(stored_size), 0) FROM blobs WHERE pack IS NULL").fetchone()[0]
        + conn.execute("SELECT coalesce(sum(size), 0) FROM packs").fetchone()[0]
    )
    index_bytes = sum(p.stat().st_size for p in store.where.index_path.parent.glob("index.sqlite*") if p.is_file())
    raw = conn.execute("SELECT coalesce(sum(raw_bytes), 0), count(*) FROM manifests").fetchone()
    stored = blob_bytes + index_bytes
    out = Usage(raw[1], stored, index_bytes, raw[0], raw[0] / stored if stored else 0.0)
    for r in conn.execute(
        "SELECT kind, sum(nbytes) AS raw, sum(CASE WHEN derived IS NULL THEN 0 ELSE nbytes END) AS derived"
        " FROM atoms GROUP BY kind"
    ):
        group = out.kinds.setdefault(_KIND_GROUPS.get(r["kind"], "other state"), KindUsage())
        group.raw_bytes += r["raw"]
        group.derived_bytes += r["derived"]
    for r in conn.execute(
        "SELECT k.kind, sum(b.stored_size) AS stored FROM (SELECT blob, min(kind) AS kind FROM atoms"
        " WHERE derived IS NULL GROUP BY blob) k JOIN blobs b ON b.hash = k.blob GROUP BY k.kind"
    ):
        out.kinds.setdefault(_KIND_GROUPS.get(r["kind"], "other state"), KindUsage()).stored_bytes += r["stored"]
    files = conn.execute(
        "SELECT coalesce(sum(b.stored_size), 0) FROM blobs b WHERE b.hash NOT IN (SELECT blob FROM atoms)"
    ).fetchone()[0]
    other_files = out.kinds.setdefault("files", KindUsage())  # skeletons, containers, whole files
    other_files.stored_bytes += files
    other_files.raw_bytes = max(0, out.raw_bytes - sum(k.raw_bytes for name, k in out.kinds.items() if name != "files"))
    alone = {
        r["manifest"]: r["bytes"]
        for r in conn.execute(
            "WITH refs AS (SELECT blob, manifest FROM atoms WHERE derived IS NULL UNION SELECT blob, manifest"
            " FROM files UNION SELECT container, manifest FROM files WHERE container IS NOT NULL),"
            " lone AS (SELECT blob, min(manifest) AS manifest FROM refs GROUP BY blob HAVING count(*) = 1)"
            " SELECT lone.manifest, sum(b.stored_size) AS bytes FROM lone JOIN blobs b ON b.hash = lone.blob"
            " GROUP BY lone.manifest"
        )
    }
    out.steps = [
        StepUsage(r["id"], r["step"], r["tag"], r["raw_bytes"], alone.get(r["id"], 0))
        for r in conn.execute("SELECT id, step, tag, raw_bytes FROM manifests ORDER BY step, id")
    ]
    out.gc_frees = plan_gc(store, Retention()).freed_bytes
    return out
