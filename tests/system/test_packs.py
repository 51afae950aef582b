"""Packs: small blobs share objects, gc repacks what is mostly dead, and an index rebuilt
from the packs and manifest objects finds every blob where it now is. Real DeepSpeed saves."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import xxhash

from tailorstore.core.object_keys import pack_key
from tailorstore.curate.gc import REPACK_AT, GcPlan, Retention, gc
from tailorstore.curate.refs import remove
from tailorstore.ingest.commit import commit_checkpoint
from tailorstore.report.verify import verify
from tailorstore.restore.checkout import checkout_step
from tailorstore.store.index._index import Index
from tailorstore.store.index.catalogue import Catalogue
from tailorstore.store.manifests.keys import MANIFEST_PREFIX, is_manifest_key
from tailorstore.store.manifests.sync import sync
from tailorstore.store.packs.pack import PACK_BELOW, pack_names, read_trailer
from tailorstore.store.repo import Repository
from tests.conftest import Runs, as_of_step, assert_only_live, index_db, object_count, tailor
from tests.system.test_hosts import wait_stopped
from tests.system.test_roundtrip import assert_same_checkpoint


def disk_usage(root: Path) -> int:
    return sum(p.stat().st_blocks * 512 for sub in ("blobs", "packs") for p in (root / sub).rglob("*") if p.is_file())


def test_small_blobs_share_pack_objects(runs: Runs, tmp_path: Path) -> None:
    save = runs.get("zero2-bf16").save_dir
    store = Repository.init(tmp_path / "store")
    commit_checkpoint(store, as_of_step(save, 6, tmp_path / "at6"))
    small = index_db(store).execute("SELECT count(*) FROM blobs WHERE raw_size < ?", (PACK_BELOW,)).fetchone()[0]
    packed = index_db(store).execute("SELECT count(*) FROM blobs WHERE pack IS NOT NULL").fetchone()[0]
    assert small > 100 and packed == small, "every small blob is in a pack"
    assert object_count(store) < 10, "hundreds of blobs, a handful of objects"
    stored = index_db(store).execute("SELECT sum(stored_size) FROM blobs").fetchone()[0]
    assert disk_usage(store.root) < 1.1 * stored + 64 * 4096, "no block rounding per blob"
    for name, size in index_db(store).execute("SELECT name, size FROM packs"):
        assert read_trailer(store.backend, name)[0] == size  # self-describing
        body = store.backend.get(pack_key(name))
        assert len(body) == size and xxhash.xxh3_128_hexdigest(body) == name, "named by the hash of its bytes"
    out = tmp_path / "out"
    checkout_step(store, "step=6", out)
    assert_same_checkpoint(as_of_step(save, 6, tmp_path / "ref"), out)


def test_gc_repacks_mostly_dead_packs_and_the_index_rebuilds(runs: Runs, tmp_path: Path) -> None:
    save = runs.get("ten-saves").save_dir
    store = Repository.init(tmp_path / "store")
    for step in range(1, 11):
        commit_checkpoint(store, as_of_step(save, step, tmp_path / f"at{step}"))
    packs_before = {r[0] for r in index_db(store).execute("SELECT name FROM packs")}
    for step in range(2, 10):
        remove(store, f"step={step}")
    plan = gc(store, Retention())
    assert plan.dead_packs, "packs of steps nothing keeps go whole"
    assert plan.freed_bytes > 0
    assert_only_live(store)  # and nothing left holds REPACK_AT or more dead bytes
    after = {r[0] for r in index_db(store).execute("SELECT name FROM packs")}
    assert after != packs_before
    assert verify(store, deep=True).ok
    for step in (1, 10):
        out = tmp_path / f"out{step}"
        checkout_step(store, f"step={step}", out)
        assert_same_checkpoint(as_of_step(save, step, tmp_path / f"ref{step}"), out)

    root = store.root
    store.close()
    for f in root.glob("index.sqlite*"):
        f.unlink()
    Repository.rebuild_index(root)
    with Repository.open(root) as rebuilt:
        assert verify(rebuilt, deep=True).ok
        checkout_step(rebuilt, "step=1", tmp_path / "again")
    assert_same_checkpoint(as_of_step(save, 1, tmp_path / "ref-again"), tmp_path / "again")
    assert 0 < REPACK_AT < 1


def test_a_partly_dead_pack_is_repacked(runs: Runs, tmp_path: Path) -> None:
    """One commit's pack holds blobs of two steps' worth of state; dropping one repacks it."""
    save = runs.get("zero2-bf16").save_dir
    store = Repository.init(tmp_path / "store")
    merged = as_of_step(save, 6, tmp_path / "both")  # global_step3 beside global_step6: one commit, one pack
    (merged / "extra").mkdir()
    for f in (save / "global_step3").iterdir():
        (merged / "extra" / f.name).write_bytes(f.read_bytes())
    commit_checkpoint(store, merged)
    commit_checkpoint(store, as_of_step(save, 3, tmp_path / "at3"))
    remove(store, "step=6")
    plan = gc(store, Retention())
    assert plan.repack, "the shared pack was mostly dead and got repacked"
    assert_only_live(store)
    assert verify(store, deep=True).ok
    checkout_step(store, "step=3", tmp_path / "out")
    assert_same_checkpoint(as_of_step(save, 3, tmp_path / "ref"), tmp_path / "out")


class _GcMidway:
    """The store's real backend, with another host's gc deleting ``victim`` (a pack, or a manifest
    object) right after this host listed it: the moment no lock covers while a store is opened."""

    def __init__(self, inner: object, victim: str) -> None:
        self.inner, self.victim = inner, victim

    def list(self, prefix: str) -> Iterator[str]:
        names = list(self.inner.list(prefix))  # type: ignore[attr-defined]
        if self.victim.startswith(prefix) and self.victim in names:
            self.inner.delete(self.victim)  # type: ignore[attr-defined]
        return iter(names)

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)


def test_objects_deleted_between_listing_and_reading_are_skipped_when_opening(runs: Runs, tmp_path: Path) -> None:
    """Opening a store syncs its index without the lock; a pack or manifest object that another host's
    gc deletes after the listing is treated as gone, not as an error (it was one, seen on S3)."""
    save = runs.get("zero2-bf16").save_dir
    with Repository.init(tmp_path / "store") as store:
        commit_checkpoint(store, as_of_step(save, 3, tmp_path / "at3"))
        commit_checkpoint(store, as_of_step(save, 6, tmp_path / "at6"))
        backend = store.backend
        packs = sorted(pack_names(backend))
        manifests = sorted(k for k in backend.list(MANIFEST_PREFIX) if is_manifest_key(k))
    assert packs and len(manifests) == 2
    for victim in (pack_key(packs[0]), manifests[-1]):
        fresh = Index.create(tmp_path / f"fresh-{len(victim)}.sqlite")
        imported, _ = sync(_GcMidway(backend, victim), fresh, locked=True)  # type: ignore[arg-type]
        assert victim.split("/")[-1] not in fresh.packs()
        assert imported == len([m for m in manifests if m != victim and backend.exists(m)])
        fresh.close()


def _store_to_repack(runs: Runs, tmp_path: Path) -> tuple[Repository, Path]:
    """Step 6 with a copy of step 3's files beside it, then step 3: their small blobs share packs,
    which are mostly dead once step 6 is removed (the caller removes it)."""
    save = runs.get("zero2-bf16").save_dir
    store = Repository.init(tmp_path / "store")
    merged = as_of_step(save, 6, tmp_path / "both")
    (merged / "extra").mkdir()
    for f in (save / "global_step3").iterdir():
        (merged / "extra" / f.name).write_bytes(f.read_bytes())
    commit_checkpoint(store, merged)
    commit_checkpoint(store, as_of_step(save, 3, tmp_path / "at3"))
    return store, save


def _repacked_store(runs: Runs, tmp_path: Path) -> tuple[Repository, Path, dict[str, bytes], GcPlan]:
    """A store whose gc just repacked a pack (as in the test above), with the old packs' bytes kept."""
    store, save = _store_to_repack(runs, tmp_path)
    before = {name: store.backend.get(pack_key(name)) for name in pack_names(store.backend)}
    remove(store, "step=6")
    plan = gc(store, Retention())
    assert plan.repack, "the shared pack was mostly dead and got repacked"
    return store, save, before, plan


def _assert_step3_whole(store: Repository, save: Path, tmp_path: Path) -> None:
    problems = verify(store, deep=True)
    assert problems.ok, problems.problems[:3]
    assert_only_live(store)
    checkout_step(store, "step=3", tmp_path / "out")
    assert_same_checkpoint(as_of_step(save, 3, tmp_path / "ref"), tmp_path / "out")


def test_a_store_opened_while_gc_repacks_keeps_its_blobs_where_they_are(runs: Runs, tmp_path: Path) -> None:
    """gc writes the new pack, points the index at it, then deletes the old pack. A store opened in
    between (a background commit opens one each time) lists the old pack too. It must not take the
    old pack's trailer as the truth: that pointed the live blobs at the pack about to go, and the
    next gc deleted the new pack, the only copy (16 blobs lost in a 70-save run with gc beside it)."""
    store, save, before, plan = _repacked_store(runs, tmp_path)
    for name in plan.repack:  # the moment after gc's index transaction, before it deletes the old packs
        store.backend.put(pack_key(name), before[name])
    with Repository.open(store.root):  # opened right then, without the lock
        pass
    for name in plan.repack:  # gc's last step
        store.backend.delete(pack_key(name))
    gc(store, Retention())  # the next gc
    _assert_step3_whole(store, save, tmp_path)


def test_rows_naming_a_gone_pack_are_placed_again_before_gc_plans(runs: Runs, tmp_path: Path) -> None:
    """An index whose rows still name a pack that is gone (left by a sync that raced a repack
    before this was fixed, or by a crash) is set right by the sync gc runs under its lock, from
    the trailer of the pack that holds the blobs, so gc never takes that pack for empty."""
    store, save, before, plan = _repacked_store(runs, tmp_path)
    moved = [
        b.hash
        for name in store.view(Catalogue).packs()
        if name not in before
        for b in store.view(Catalogue).blobs_in_pack(name)
    ]
    assert moved, "the repack moved live blobs into a new pack"
    # the damage: the moved blobs point back at the old pack
    index_db(store).executemany("UPDATE blobs SET pack=? WHERE hash=?", [(plan.repack[0], h) for h in moved])
    gc(store, Retention())
    _assert_step3_whole(store, save, tmp_path)


def test_a_store_opened_while_gc_thins_a_step_keeps_that_step(runs: Runs, tmp_path: Path) -> None:
    """Thinning records a step again under a new object version. A sync that listed the manifests
    before that and read the index after took the step for dropped and deleted its rows; the next
    gc would then have deleted what only that step used. The listing that decides is taken inside
    the index transaction, after the thinning's."""
    save = runs.get("zero2-bf16").save_dir
    root = tmp_path / "store"
    with Repository.init(root) as store:
        commit_checkpoint(store, as_of_step(save, 3, tmp_path / "at3"))
        commit_checkpoint(store, as_of_step(save, 6, tmp_path / "at6"))
        backend = store.backend

    class ThinnedWhileListing:
        """The real backend; right after the first listing of manifests, another process thins step 3."""

        def __init__(self) -> None:
            self.thinned = False

        def list(self, prefix: str) -> Iterator[str]:
            names = list(backend.list(prefix))
            if prefix == MANIFEST_PREFIX and not self.thinned:
                self.thinned = True
                with Repository.open(root) as other:
                    assert gc(other, Retention(keep_last=1, thin="weights")).thin
            return iter(names)

        def __getattr__(self, name: str) -> object:
            return getattr(backend, name)

    index = Index.open(root / "index.sqlite")
    sync(ThinnedWhileListing(), index, locked=False)  # type: ignore[arg-type]
    assert sorted(m.step for m in index.manifests()) == [3, 6]
    index.close()
    with Repository.open(root) as store:
        assert {m.step: m.tier for m in store.view(Catalogue).manifests()} == {3: "weights", 6: None}
        gc(store, Retention())
        problems = verify(store, deep=True)
        assert problems.ok, problems.problems[:3]


def test_a_gc_killed_after_writing_its_repacked_pack_loses_nothing(runs: Runs, tmp_path: Path) -> None:
    """gc writes the repacked pack, then is killed before the index points at it. The next gc takes
    that pack for dead, repacks the old one again into a pack of the same bytes, hence the same
    name, and must not then delete it as planned (it did: the step lost every blob of that pack)."""
    store, save = _store_to_repack(runs, tmp_path)
    remove(store, "step=6")
    store.close()
    env = {**os.environ, "TAILOR_STORE": str(store.root), "TAILOR_FAILPOINTS": "gc-repack-written=stop"}
    killed = subprocess.Popen([sys.executable, "-m", "tailorstore.cli.app", "gc"], env=env, text=True)
    wait_stopped(killed)
    killed.kill()
    killed.wait(timeout=60)
    assert tailor("gc", store=store.root).returncode == 0
    with Repository.open(store.root) as again:
        _assert_step3_whole(again, save, tmp_path)
