"""``tailor gc``: drop manifests under retention rules, then delete unreferenced blobs.

Like restic's prune, gc first computes a plan (the manifests to drop, the blobs to delete
and the bytes freed), shows it, and only then carries it out, with the store lock held
exclusively so no commit is in flight.

The order of deletion is what keeps a killed gc harmless: manifests and blob rows leave
the index in one transaction first, blob files are unlinked after. A crash in between
leaves unindexed blob files, which are orphans that the next gc removes; it can never
leave an index row that points at a deleted file.

A blob is live when any kept manifest references it, through a file row or a non-derived
atom row. Composites reference their inherited blobs directly, so a blob first stored at a
dropped step lives on as long as a kept composite uses it.

Packs: a pack none of whose blobs lives is deleted. A pack whose dead bytes reach
``REPACK_AT`` of its size is repacked: its live blobs are read, hash-checked, written into
new packs, the index is pointed at them, and only then is the old pack deleted. A pack with
fewer dead bytes is left as it is (its dead rows leave the index; its bytes wait for a
later repack), so gc does not rewrite gigabytes to free a few kilobytes.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from dataclasses import dataclass, field

from . import codec
from .errors import CorruptStoreError, StoreError
from .store import manifest_objects
from .store.backend import blob_key, blob_names
from .store.packs import PackWriter, pack_key, pack_names
from .store.repo import Repository

REPACK_AT = 0.25  # repack a pack once this share of its bytes is dead


@dataclass(frozen=True)
class Retention:
    keep_last: int | None = None  # the K newest committed steps
    keep_every: int | None = None  # committed steps whose number is a multiple of N

    def __post_init__(self) -> None:
        for name, value in (("--keep-last", self.keep_last), ("--keep-every", self.keep_every)):
            if value is not None and value < 1:
                raise StoreError(f"{name} {value} is not allowed: give a whole number of 1 or more.")

    @property
    def drops_manifests(self) -> bool:
        return self.keep_last is not None or self.keep_every is not None


@dataclass
class GcPlan:
    drop: list[tuple[int, int]] = field(default_factory=list)  # (manifest, step)
    keep: list[tuple[int, int]] = field(default_factory=list)
    dead_blobs: list[str] = field(default_factory=list)  # indexed, referenced by no kept manifest
    orphan_files: list[str] = field(default_factory=list)  # blob files with no index row
    temp_files: list[str] = field(default_factory=list)
    dead_loose: list[str] = field(default_factory=list)  # the dead blobs that are objects of their own
    dead_packs: list[str] = field(default_factory=list)  # packs with no live blob
    repack: list[str] = field(default_factory=list)  # packs whose live blobs move to new packs
    orphan_packs: list[str] = field(default_factory=list)  # pack objects the index does not know
    freed_bytes: int = 0  # planned; after gc ran, what it freed

    def summary(self) -> str:
        packs = ""
        if self.dead_packs or self.repack or self.orphan_packs:
            packs = (
                f"; delete {len(self.dead_packs)} empty and {len(self.orphan_packs)} orphan pack(s), "
                f"repack {len(self.repack)}"
            )
        return (
            f"drop {len(self.drop)} manifest(s) {[s for _, s in self.drop]}, keep {len(self.keep)}; delete "
            f"{len(self.dead_blobs)} unreferenced blob(s), {len(self.orphan_files)} orphan blob file(s) and "
            f"{len(self.temp_files)} temp file(s){packs}, freeing {self.freed_bytes} bytes"
        )


def kept_manifests(rows: list, rules: Retention) -> set[int]:
    """Pure: which manifests survive. Tags, pins and merges always do."""
    if not rules.drops_manifests:
        return {r["id"] for r in rows}
    commits = sorted((r for r in rows if r["origin"] == "commit"), key=lambda r: r["step"])
    keep = {r["id"] for r in rows if r["tag"] or r["pinned"] or r["origin"] != "commit"}
    if rules.keep_last:
        keep |= {r["id"] for r in commits[-rules.keep_last :]}
    if rules.keep_every:
        keep |= {r["id"] for r in commits if r["step"] % rules.keep_every == 0}
    return keep


def plan_gc(store: Repository, rules: Retention) -> GcPlan:
    rows = store.conn.execute("SELECT id, step, origin, tag, pinned FROM manifests ORDER BY step, id").fetchall()
    keep = kept_manifests(rows, rules)
    plan = GcPlan(
        drop=[(r["id"], r["step"]) for r in rows if r["id"] not in keep],
        keep=[(r["id"], r["step"]) for r in rows if r["id"] in keep],
    )
    conn = store.conn
    conn.execute("CREATE TEMP TABLE IF NOT EXISTS gc_keep(id INTEGER PRIMARY KEY)")
    conn.execute("DELETE FROM gc_keep")
    conn.executemany("INSERT INTO gc_keep(id) VALUES (?)", [(m,) for m in keep])
    dead = conn.execute(
        "SELECT hash, stored_size, pack FROM blobs WHERE hash NOT IN ("
        " SELECT blob FROM files WHERE manifest IN (SELECT id FROM gc_keep)"
        " UNION SELECT container FROM files WHERE container IS NOT NULL AND manifest IN (SELECT id FROM gc_keep)"
        " UNION SELECT blob FROM atoms WHERE derived IS NULL AND manifest IN (SELECT id FROM gc_keep))"
    ).fetchall()
    plan.dead_blobs = [r["hash"] for r in dead]
    plan.dead_loose = [r["hash"] for r in dead if r["pack"] is None]
    dead_set = set(plan.dead_blobs)
    plan.freed_bytes = sum(r["stored_size"] for r in dead if r["pack"] is None)
    for pack in conn.execute("SELECT name, size FROM packs ORDER BY name").fetchall():
        rows = conn.execute("SELECT hash, stored_size FROM blobs WHERE pack=?", (pack["name"],)).fetchall()
        live = sum(r["stored_size"] for r in rows if r["hash"] not in dead_set)
        if not any(r["hash"] not in dead_set for r in rows):
            plan.dead_packs.append(pack["name"])
            plan.freed_bytes += pack["size"]
        elif pack["size"] - live >= REPACK_AT * pack["size"]:
            plan.repack.append(pack["name"])
            plan.freed_bytes += pack["size"] - live
    indexed = {r[0] for r in conn.execute("SELECT hash FROM blobs WHERE pack IS NULL")}
    for name in blob_names(store.backend):
        if name not in indexed:
            plan.orphan_files.append(name)
            plan.freed_bytes += store.object_size(blob_key(name)) or 0
    known = {r[0] for r in conn.execute("SELECT name FROM packs")}
    for name in pack_names(store.backend):
        if name not in known:
            plan.orphan_packs.append(name)
            plan.freed_bytes += store.object_size(pack_key(name)) or 0
    plan.temp_files = store.backend.leftovers()
    return plan


def gc(
    store: Repository,
    rules: Retention,
    *,
    dry_run: bool = False,
    lock_timeout: float = 600.0,
    on_wait: Callable[[str], None] | None = None,
    show_plan: Callable[[GcPlan], None] | None = None,
) -> GcPlan:
    with store.lock(exclusive=True, timeout=lock_timeout, on_wait=on_wait):
        plan = plan_gc(store, rules)
        if show_plan:
            show_plan(plan)
        if dry_run:
            return plan
        with store.transaction() as conn:
            # manifest objects first: a crash after them leaves only unreferenced blobs, which the next gc takes
            for m, _ in plan.drop:
                row = conn.execute("SELECT object_key FROM manifests WHERE id=?", (m,)).fetchone()
                manifest_objects.unpublish(store.backend, [row["object_key"]])
            conn.executemany("DELETE FROM manifests WHERE id=?", [(m,) for m, _ in plan.drop])
            conn.executemany("DELETE FROM blobs WHERE hash=?", [(h,) for h in plan.dead_blobs])
            conn.executemany("DELETE FROM packs WHERE name=?", [(p,) for p in plan.dead_packs])
        written = _repack(store, plan.repack)
        batch = store.backend.batch()
        for name in [*plan.dead_loose, *plan.orphan_files]:
            batch.delete(blob_key(name))
        for name in [*plan.dead_packs, *plan.repack, *plan.orphan_packs]:
            batch.delete(pack_key(name))
        batch.publish()
        store.backend.clear_leftovers(plan.temp_files)
        plan.freed_bytes -= written
    return plan


def _repack(store: Repository, packs: list[str]) -> int:
    """Move the live blobs of ``packs`` into new packs and point the index at them; returns
    the bytes written. The old packs stay until the caller deletes them, after this commits."""
    if not packs:
        return 0
    batch = store.backend.batch()
    writer = PackWriter(batch)
    moved = []
    for name in packs:
        for row in store.conn.execute("SELECT hash FROM blobs WHERE pack=? ORDER BY pack_offset", (name,)).fetchall():
            blob = store.blob(row["hash"])
            assert blob is not None
            data = store.backend.get(blob.key(), blob.pack_offset or 0, blob.stored_size)
            raw = bytearray(blob.raw_size)  # decoded and hash-checked: a damaged blob is never carried over
            codec.decode_into(blob.codec, io.BytesIO(data), memoryview(raw), f"repacking pack {name}: {blob.hash}")
            if codec.content_hash(raw) != blob.hash:
                raise CorruptStoreError(
                    f"pack {name}: blob {blob.hash} does not match its hash; gc stopped before deleting anything "
                    "of that pack. Run `tailor verify --deep`."
                )
            writer.add(blob.hash, data, blob.raw_size, blob.codec)
            moved.append(blob.hash)
    writer.flush()
    batch.publish()
    with store.transaction() as conn:
        conn.executemany("INSERT INTO packs(name, size) VALUES (?,?) ON CONFLICT(name) DO NOTHING", writer.sealed)
        conn.executemany(
            "UPDATE blobs SET pack=?, pack_offset=? WHERE hash=?",
            [(*writer.placed[h], h) for h in moved],
        )
        conn.executemany("DELETE FROM packs WHERE name=?", [(p,) for p in packs])
    return sum(size for _, size in writer.sealed)
