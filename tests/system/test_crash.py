"""kill -9 at random moments of commit, gc and checkout: the store always opens and verifies.

Kill times are drawn from a seeded generator over the measured span of each command, from
shortly before its imports finish to just after it would have ended, so the kills land while
files are read, blobs are written, the index transaction runs, and after.
"""

from __future__ import annotations

import fcntl
import os
import random
import subprocess
import time
from pathlib import Path

from tailorstore.curate.gc import Retention, gc
from tailorstore.curate.refs import remove
from tailorstore.ingest.commit import commit_checkpoint
from tailorstore.report.verify import verify
from tailorstore.restore.checkout import checkout_step
from tailorstore.store.repo import Repository
from tests.conftest import Runs, as_of_step, assert_only_live, index_db, kill_after, object_count, tailor_process
from tests.system.test_roundtrip import assert_same_checkpoint

KILLS = 12
SEED = 20261122


def start(store: Path, *args: str) -> subprocess.Popen[bytes]:
    quiet = ("--quiet",) if args[0] != "gc" else ()
    env = dict(os.environ, TAILOR_STORE=str(store))
    return tailor_process(*args, *quiet, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=False)


def timed(store: Path, *args: str) -> float:
    began = time.perf_counter()
    assert start(store, *args).wait(timeout=300) == 0
    return time.perf_counter() - began


def check_intact(store: Repository, run: Runs, steps: list[int], save_dir: Path, work: Path) -> None:
    report = verify(store, deep=True)
    assert report.ok, report.problems
    for step in steps:
        out = work / f"out{step}"
        checkout_step(store, f"step={step}", out)
        assert_same_checkpoint(as_of_step(save_dir, step, work / f"ref{step}"), out)


def test_kill_commit_at_random_points(runs: Runs, tmp_path: Path) -> None:
    save_dir = runs.get("ten-saves").save_dir
    store = Repository.init(tmp_path / "store")
    for step in (1, 2):
        commit_checkpoint(store, as_of_step(save_dir, step, tmp_path / f"at{step}"))
    at3 = as_of_step(save_dir, 3, tmp_path / "at3")
    baseline = blob_count(store)
    visible, writing = time_to_visible(store, at3, baseline)
    remove(store, "step=3")
    gc(store, Retention())  # so that every attempt writes its blobs again
    rng = random.Random(SEED)
    landed = absent = 0
    for i in range(KILLS):
        proc = start(store.root, "commit", str(at3))
        if i % 2:  # anywhere from reading the input to just after the commit would end
            landed += kill_after(proc, rng.uniform(0.3 * visible, 1.1 * visible))
        else:  # once the first new blob is on disk: while blobs are written and the index transaction runs
            wait_for_new_blob(store, baseline, proc)
            landed += kill_after(proc, rng.uniform(0.0, 1.2 * (visible - writing)))
        index_db(store).close()
        store = Repository.open(store.root)  # a fresh open, as the next command would do
        present = index_db(store).execute("SELECT count(*) FROM manifests WHERE step=3").fetchone()[0]
        check_intact(store, runs, [1, 2, 3] if present else [1, 2], save_dir, tmp_path / f"k{i}")
        if present:
            remove(store, "step=3")
        else:
            absent += 1
    assert landed >= KILLS // 2 and absent >= 3, (landed, absent)
    on_disk_before = disk_bytes(store)
    plan = gc(store, Retention())
    assert not store.backend.leftovers()
    assert verify(store, deep=True).ok and verify(store).notes == []
    # Exactly the blobs that steps 1 and 2 use are left, and the plan freed exactly what went.
    assert_only_live(store)
    assert plan.freed_bytes == on_disk_before - disk_bytes(store) > 0


def disk_bytes(store: Repository) -> int:
    return sum(
        p.stat().st_size for sub in ("blobs", "packs", "tmp") for p in (store.root / sub).rglob("*") if p.is_file()
    )


def blob_count(store: Repository) -> int:
    return object_count(store)


def wait_for_new_blob(store: Repository, baseline: int, proc: subprocess.Popen[bytes]) -> None:
    while proc.poll() is None and blob_count(store) <= baseline:
        time.sleep(0.002)


def time_to_visible(store: Repository, ckpt: Path, baseline: int) -> tuple[float, float]:
    """Seconds from starting `tailor commit` until its first new blob and until its step is in the index."""
    began = time.perf_counter()
    proc = start(store.root, "commit", str(ckpt))
    seen = writing = None
    while proc.poll() is None or seen is None:
        if writing is None and blob_count(store) > baseline:
            writing = time.perf_counter() - began
        if seen is None and index_db(store).execute("SELECT count(*) FROM manifests WHERE step=3").fetchone()[0]:
            seen = time.perf_counter() - began
        time.sleep(0.002)
    assert proc.returncode == 0 and writing is not None
    return seen, writing


def test_kill_gc_at_random_points(runs: Runs, tmp_path: Path) -> None:
    save_dir = runs.get("ten-saves").save_dir
    store = Repository.init(tmp_path / "store")
    for step in (1, 2):
        commit_checkpoint(store, as_of_step(save_dir, step, tmp_path / f"at{step}"))
    garbage = {s: as_of_step(save_dir, s, tmp_path / f"g{s}") for s in range(3, 11)}
    rng = random.Random(SEED + 1)
    full = None
    landed = 0
    for i in range(KILLS):
        step = 3 + i % 8
        commit_checkpoint(store, garbage[step])
        remove(store, f"step={step}")  # garbage for gc to collect
        if full is None:
            full = timed(store.root, "gc")
            continue
        landed += kill_after(start(store.root, "gc"), rng.uniform(0.3 * full, 1.05 * full))
        index_db(store).close()
        store = Repository.open(store.root)
        check_intact(store, runs, [1, 2], save_dir, tmp_path / f"k{i}")
    assert landed >= (KILLS - 1) // 2, landed
    gc(store, Retention())
    assert verify(store, deep=True).ok and verify(store).notes == []


def test_killed_checkout_leaves_nothing_complete_looking(runs: Runs, tmp_path: Path) -> None:
    save_dir = runs.get("ten-saves").save_dir
    store = Repository.init(tmp_path / "store")
    commit_checkpoint(store, as_of_step(save_dir, 5, tmp_path / "at5"))
    full = timed(store.root, "checkout", "step=5", "--out", str(tmp_path / "first"))
    rng = random.Random(SEED + 2)
    during_write = 0
    for i in range(8):
        out = tmp_path / f"out{i}"
        proc = start(store.root, "checkout", "step=5", "--out", str(out))
        if i % 2:  # anywhere in the command's span
            kill_after(proc, rng.uniform(0.5 * full, 1.05 * full))
        else:  # once it writes: the hidden partial directory exists
            while proc.poll() is None and not list(tmp_path.glob(f".out{i}.tailor-partial-*")):
                time.sleep(0.0005)
            kill_after(proc, rng.uniform(0.0, 0.01))
        partial = list(tmp_path.glob(f".out{i}.tailor-partial-*"))
        if out.exists():  # the rename happened: then it is complete
            assert_same_checkpoint(as_of_step(save_dir, 5, tmp_path / f"ref{i}"), out)
            assert not partial
        elif partial:
            during_write += 1  # killed while writing: only the hidden directory is left
            left = i
    assert during_write >= 2, during_write
    assert verify(store, deep=True).ok

    # The next checkout to that name deletes what the killed one left (a whole checkpoint's bytes
    # on a real run), but not the hidden directory of a process still writing: its lock says so.
    live = tmp_path / f".out{left}.tailor-partial-live"
    live.mkdir()
    (live / "being-written").write_bytes(b"x")
    holder = os.open(live, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(holder, fcntl.LOCK_EX)
        timed(store.root, "checkout", "step=5", "--out", str(tmp_path / f"out{left}"))  # exits 0
        assert list(tmp_path.glob(f".out{left}.tailor-partial-*")) == [live]  # the killed one's is gone
        assert (live / "being-written").exists()
    finally:
        os.close(holder)
    assert_same_checkpoint(as_of_step(save_dir, 5, tmp_path / "ref-left"), tmp_path / f"out{left}")
