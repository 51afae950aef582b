"""Faults on an S3 store (a real local S3 server, real DeepSpeed saves, real `tailor`
processes): kill -9 during commit and during gc, and two hosts committing while a third runs
gc. After each, a host with a fresh cache finds a store that passes `verify --deep`, with
every earlier step checking out byte for byte."""

from __future__ import annotations

import os
import random
import subprocess
import time
from pathlib import Path

import pytest

from tailorstore.curate.gc import Retention, gc
from tailorstore.curate.refs import remove
from tailorstore.ingest.commit import commit_checkpoint
from tailorstore.report.verify import verify
from tailorstore.restore.checkout import checkout_step
from tailorstore.store.index.catalogue import Catalogue
from tailorstore.store.repo import Repository
from testbed.compare import same_tree
from testbed.local_s3 import LocalS3
from tests.conftest import KillClock, Runs, as_of_step, tailor_process

SEED = 20261123
KILLS = 2
MAX_ATTEMPTS = 6  # more only while no kill has landed: each miss narrows the span


def start(location: str, cache: Path, *args: str) -> subprocess.Popen[bytes]:
    """`tailor ARGS` as a host with its own cache directory."""
    env = {**os.environ, "TAILOR_STORE": location, "TAILOR_CACHE": str(cache)}
    return tailor_process(*args, env=env, stdout=subprocess.DEVNULL, text=False)


def finished(proc: subprocess.Popen[bytes]) -> None:
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err.decode()


def fresh_host(location: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Repository:
    """The store as a host that never saw it sees it: its index built from the objects alone."""
    cache = tmp_path / f"host-{time.monotonic_ns()}"
    monkeypatch.setenv("TAILOR_CACHE", str(cache))
    return Repository.open(location)


def assert_intact(store: Repository, save: Path, steps: list[int], work: Path) -> None:
    report = verify(store, deep=True)
    assert report.ok, report.problems
    held = sorted(m.step for m in store.view(Catalogue).manifests())
    assert set(steps) <= set(held), (steps, held)
    for step in steps:
        out = work / f"out-{step}-{time.monotonic_ns()}"
        checkout_step(store, f"step={step}", out)
        assert same_tree(out / f"global_step{step}", save / f"global_step{step}")


def only_live_objects(store: Repository) -> None:
    """After a gc: every blob the backend holds is referenced, and every referenced one is held."""
    referenced = set()
    for m in store.view(Catalogue).manifests():
        referenced |= store.view(Catalogue).referenced_hashes(m.id)
    assert store.held_blobs() == referenced


def test_kill_commit_and_gc_on_s3(
    s3_server: LocalS3, s3_location: str, runs: Runs, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    save = runs.get("zero2-bf16").save_dir
    at3, at6 = as_of_step(save, 3, tmp_path / "at3"), as_of_step(save, 6, tmp_path / "at6")
    Repository.init(s3_location).close()
    with Repository.open(s3_location) as store:
        commit_checkpoint(store, at3)
    rng = random.Random(SEED)

    # commit: the span of a whole `tailor commit` process, measured once
    began = time.perf_counter()
    finished(start(s3_location, tmp_path / "measure", "commit", str(at6), "--quiet"))
    span = time.perf_counter() - began
    with fresh_host(s3_location, tmp_path, monkeypatch) as store:
        remove(store, "step=6")
        gc(store, Retention())  # the next commits write every blob of step 6 again
    clock = KillClock(span, rng, 0.25, 0.9)  # from a quarter: one measurement can run long
    landed = 0
    for i in range(MAX_ATTEMPTS):
        if i >= KILLS and landed:
            break
        began = time.perf_counter()
        proc = start(s3_location, tmp_path / f"committer-{i}", "commit", str(at6), "--quiet")
        landed += clock.kill(proc, began)
        with fresh_host(s3_location, tmp_path, monkeypatch) as store:
            assert_intact(store, save, [3], tmp_path)
            if any(m.step == 6 for m in store.view(Catalogue).manifests()):  # the kill came after the commit point
                assert_intact(store, save, [3, 6], tmp_path)
                remove(store, "step=6")
            gc(store, Retention())  # the dead committer's lease is stale: its pid is gone
            only_live_objects(store)
    assert landed >= 1, "no kill landed while a commit ran"

    # gc: step 3 dropped by --keep-last 1 while killed at random moments
    with fresh_host(s3_location, tmp_path, monkeypatch) as store:
        commit_checkpoint(store, at6)
    began = time.perf_counter()
    finished(start(s3_location, tmp_path / "measure-gc", "gc", "--keep-last", "1", "--dry-run"))
    span = time.perf_counter() - began
    clock = KillClock(span, rng, 0.5, 2.0)  # the span of a dry run; a real gc deletes too
    landed = 0
    for i in range(MAX_ATTEMPTS):
        if i >= KILLS and landed:
            break
        with fresh_host(s3_location, tmp_path, monkeypatch) as store:
            if not any(m.step == 3 for m in store.view(Catalogue).manifests()):
                commit_checkpoint(store, at3)  # garbage for the next gc
        began = time.perf_counter()
        proc = start(s3_location, tmp_path / f"collector-{i}", "gc", "--keep-last", "1")
        landed += clock.kill(proc, began)
        with fresh_host(s3_location, tmp_path, monkeypatch) as store:
            steps = sorted(m.step for m in store.view(Catalogue).manifests())
            assert steps in ([3, 6], [6]), steps
            assert_intact(store, save, steps, tmp_path)
    assert landed >= 1, "no kill landed while a gc ran"
    with fresh_host(s3_location, tmp_path, monkeypatch) as store:
        gc(store, Retention(keep_last=1))
        only_live_objects(store)
        assert_intact(store, save, [6], tmp_path)


def test_two_hosts_commit_while_a_third_collects(
    s3_server: LocalS3, s3_location: str, runs: Runs, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The dangerous case: the blobs the commits need are garbage when they start (their step
    was removed), so a gc that ran under a commit would delete what the commit reuses."""
    save = runs.get("zero2-bf16").save_dir
    at3, at6 = as_of_step(save, 3, tmp_path / "at3"), as_of_step(save, 6, tmp_path / "at6")
    Repository.init(s3_location).close()
    with Repository.open(s3_location) as store:
        commit_checkpoint(store, at3)
        commit_checkpoint(store, at6)
        remove(store, "step=3")
        remove(store, "step=6")  # every blob is now garbage that a gc would delete
    for round_ in range(1):
        hosts = [
            start(s3_location, tmp_path / f"a{round_}", "commit", str(at3), "--quiet"),
            start(s3_location, tmp_path / f"b{round_}", "commit", str(at6), "--quiet", "--run", "other"),
            start(s3_location, tmp_path / f"c{round_}", "gc"),
        ]
        for proc in hosts:
            finished(proc)
        with fresh_host(s3_location, tmp_path, monkeypatch) as store:
            held = sorted((m.run, m.step) for m in store.view(Catalogue).manifests())
            assert held == [("main", 3), ("other", 6)], held
            report = verify(store, deep=True)
            assert report.ok, report.problems
            out = tmp_path / f"out{round_}"
            checkout_step(store, "step=3", out / "main")
            checkout_step(store, "other:step=6", out / "other")
            assert same_tree(out / "main" / "global_step3", save / "global_step3")
            assert same_tree(out / "other" / "global_step6", save / "global_step6")
            remove(store, "step=3")
            remove(store, "other:step=6")
