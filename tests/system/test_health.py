"""Keeping the store healthy: retention and gc, verify, faults, format versions, locks."""

from __future__ import annotations

import errno
import json
import os
import sqlite3
import subprocess
from pathlib import Path

import pytest

from tailorstore.core.errors import FormatVersionError, LockTimeoutError, StoreError
from tailorstore.core.policies import PolicySpec
from tailorstore.curate.gc import Retention, gc
from tailorstore.curate.refs import pin, remove, tag
from tailorstore.ingest.commit import CommitOptions, commit_checkpoint
from tailorstore.report.verify import verify
from tailorstore.restore.checkout import checkout_step
from tailorstore.store.repo import Repository
from tests.conftest import Runs, as_of_step, assert_only_live, blob_object, index_db, store_state, tailor
from tests.system.test_roundtrip import assert_same_checkpoint
from tests.system.test_tailoring import assert_layers_from_sources


def test_gc_with_retention_tags_and_a_composite(runs: Runs, tmp_path: Path) -> None:
    run = runs.get("ten-saves")
    store = Repository.init(tmp_path / "store")
    for step in range(1, 11):
        policy = PolicySpec("parity") if step == 8 else PolicySpec("full")
        commit_checkpoint(store, as_of_step(run.save_dir, step, tmp_path / f"at{step}"), CommitOptions(policy=policy))
    tag(store, "step=2", "warmup-end")
    sources8 = {
        r["layer"]: r["source_step"]
        for r in index_db(store).execute(
            "SELECT layer, source_step FROM layers l JOIN manifests m ON m.id=l.manifest WHERE m.step=8"
        )
    }
    assert 7 in sources8.values(), "step 8 must inherit from step 7, which gc is going to drop"

    before = store_state(store.root)
    dry = tailor("gc", "--keep-last", "3", "--keep-every", "4", "--dry-run", "--json", store=store.root)
    assert dry.returncode == 0, dry.stderr
    planned = json.loads(dry.stdout)
    assert sorted(s for _, s in planned["drop"]) == [1, 3, 5, 6, 7]
    assert planned["freed_bytes"] > 0 and planned["dead_blobs"]
    assert store_state(store.root) == before, "--dry-run changed the store"

    text = tailor("gc", "--keep-last", "3", "--keep-every", "4", store=store.root)
    assert text.returncode == 0 and text.stdout.startswith("plan: drop 5 manifest(s) (steps 1, 3, 5, 6, 7)")
    kept = [r[0] for r in index_db(store).execute("SELECT step FROM manifests ORDER BY step")]
    assert kept == [2, 4, 8, 9, 10]
    assert_only_live(store)
    assert verify(store, deep=True).ok

    for step in (2, 4, 9, 10):
        out = tmp_path / f"out{step}"
        checkout_step(store, f"step={step}", out)
        assert_same_checkpoint(as_of_step(run.save_dir, step, tmp_path / f"ref{step}"), out)
    out8 = tmp_path / "out8"
    checkout_step(store, "step=8", out8)
    assert_layers_from_sources(out8, run.save_dir, sources8, tmp_path / "cmp8")


def test_rm_pin_and_tag_protect(runs: Runs, tmp_path: Path) -> None:
    run = runs.get("ten-saves")
    store = Repository.init(tmp_path / "store")
    for step in (1, 2, 3):
        commit_checkpoint(store, as_of_step(run.save_dir, step, tmp_path / f"at{step}"))
    pin(store, "step=1")
    tag(store, "step=2", "keep-me")
    with pytest.raises(StoreError, match="pinned"):
        remove(store, "step=1")
    gc(store, Retention(keep_last=1))
    assert [r[0] for r in index_db(store).execute("SELECT step FROM manifests ORDER BY step")] == [1, 2, 3]
    assert tailor("unpin", "step=1", store=store.root).returncode == 0
    assert tailor("rm", "step=1", store=store.root).returncode == 0
    proc = tailor("gc", store=store.root)
    assert proc.returncode == 0 and "drop 0 manifest(s)" in proc.stdout
    assert_only_live(store)


@pytest.fixture
def first_two_saves(runs: Runs, tmp_path: Path) -> Repository:
    run = runs.get("ten-saves")
    store = Repository.init(tmp_path / "store")
    for step in (1, 2):
        commit_checkpoint(store, as_of_step(run.save_dir, step, tmp_path / f"at{step}"))
    return store


def _blob_of(store: Repository, step: int, *, only_in_step: bool = True) -> tuple[str, str]:
    row = (
        index_db(store)
        .execute(
            "SELECT a.blob, a.path FROM atoms a JOIN manifests m ON m.id=a.manifest JOIN blobs b ON b.hash=a.blob "
            "WHERE m.step=? AND a.kind='exp_avg' AND b.raw_size > 1000 AND a.blob NOT IN "
            "(SELECT blob FROM atoms x JOIN manifests n ON n.id=x.manifest WHERE n.step<>?) LIMIT 1",
            (step, step),
        )
        .fetchone()
    )
    return row["blob"], row["path"]


@pytest.mark.parametrize("fault", ["flip", "truncate", "delete"])
def test_damaged_blob_is_found_and_named(first_two_saves: Repository, fault: str, tmp_path: Path) -> None:
    store = first_two_saves
    digest, path = _blob_of(store, 2)
    file, start, size = blob_object(store, digest)
    file.chmod(0o644)
    data = file.read_bytes()
    at = start + min(40, size // 2)
    if fault == "flip":
        file.write_bytes(data[:at] + bytes([data[at] ^ 1]) + data[at + 1 :])
    elif fault == "truncate":
        file.write_bytes(data[: start + size // 2])
    else:
        file.unlink()
    shallow = tailor("verify", store=store.root)
    deep = tailor("verify", "--deep", store=store.root)
    assert deep.returncode == 3
    assert digest in deep.stderr and "step 2" in deep.stderr and path in deep.stderr and ", layer " in deep.stderr
    assert (shallow.returncode == 0) == (fault == "flip"), "a size check finds truncation and deletion"
    assert tailor("verify", "step=1", "--deep", store=store.root).returncode == 0, "step 1 does not use that blob"
    proc = tailor("checkout", "step=2", "--out", str(tmp_path / "out"), store=store.root)
    assert proc.returncode == 3 and "step 2" in proc.stderr
    # a flipped byte damages that blob only; a cut or deleted pack takes its neighbours with it
    assert digest in proc.stderr or fault != "flip"
    assert not (tmp_path / "out").exists()


def test_newer_format_is_refused_and_unversioned_is_not_a_store(first_two_saves: Repository) -> None:
    root = first_two_saves.root
    first_two_saves.close()
    conn = sqlite3.connect(root / "index.sqlite")
    conn.execute("UPDATE meta SET value='99' WHERE key='format_version'")
    conn.commit()
    with pytest.raises(FormatVersionError, match=r"format version 99.*Upgrade tailorstore"):
        Repository.open(root)
    proc = tailor("log", store=root)
    assert proc.returncode == 2 and "Upgrade tailorstore" in proc.stderr
    conn.execute("DELETE FROM meta WHERE key='format_version'")
    conn.commit()
    conn.close()
    with pytest.raises(FormatVersionError, match="not a tailorstore index"):
        Repository.open(root)


def test_disk_full_during_commit_leaves_store_as_it_was(
    first_two_saves: Repository, runs: Runs, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = first_two_saves
    before = store_state(store.root)
    budget = {"bytes": 200_000}
    real_write = os.write

    def write_until_full(fd: int, data: memoryview) -> int:
        if budget["bytes"] <= 0:
            raise OSError(errno.ENOSPC, "No space left on device")
        budget["bytes"] -= len(data)
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", write_until_full)
    at3 = as_of_step(runs.get("ten-saves").save_dir, 3, tmp_path / "at3")
    with pytest.raises(StoreError, match=r"no space left on the device.*store is as it was"):
        commit_checkpoint(store, at3)
    monkeypatch.undo()
    assert store_state(store.root) == before
    assert verify(store, deep=True).ok
    commit_checkpoint(store, at3)  # and the store goes on working


def test_lock_timeout_is_clear_and_waiting_is_visible(first_two_saves: Repository, runs: Runs, tmp_path: Path) -> None:
    at3 = as_of_step(runs.get("ten-saves").save_dir, 3, tmp_path / "at3")
    with first_two_saves.lock(exclusive=True, timeout=1):
        proc = tailor("commit", str(at3), "--lock-timeout", "1", store=first_two_saves.root)
        with pytest.raises(LockTimeoutError):
            gc(first_two_saves, Retention(), lock_timeout=0.2)
    assert proc.returncode == 4
    assert "waiting for the shared store lock" in proc.stderr and "--lock-timeout" in proc.stderr
    assert index_db(first_two_saves).execute("SELECT count(*) FROM manifests").fetchone()[0] == 2


def test_concurrent_commits_gc_and_readers(runs: Runs, tmp_path: Path) -> None:
    run = runs.get("ten-saves")
    store = Repository.init(tmp_path / "store")
    commit_checkpoint(store, as_of_step(run.save_dir, 1, tmp_path / "at1"))
    dirs = {s: as_of_step(run.save_dir, s, tmp_path / f"at{s}") for s in (2, 3, 4)}
    env = dict(os.environ, TAILOR_STORE=str(store.root))
    procs = [
        subprocess.Popen(
            ["tailor", "commit", str(dirs[s]), "--quiet"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for s in (2, 3)
    ]
    gc_proc = subprocess.Popen(
        ["tailor", "gc", "--keep-last", "10"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    # Readers while commits run: log, show and a checkout of a finished step.
    log = tailor("log", "--json", store=store.root)
    assert log.returncode == 0 and 1 in [s["step"] for s in json.loads(log.stdout)]
    assert tailor("show", "step=1", store=store.root).returncode == 0
    assert tailor("checkout", "step=1", "--out", str(tmp_path / "read1"), store=store.root).returncode == 0
    procs.append(
        subprocess.Popen(
            ["tailor", "commit", str(dirs[4]), "--quiet"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
    )
    for p in [*procs, gc_proc]:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
    assert [r[0] for r in index_db(store).execute("SELECT step FROM manifests ORDER BY step")] == [1, 2, 3, 4]
    assert verify(store, deep=True).ok
    for s in (2, 3, 4):
        out = tmp_path / f"out{s}"
        checkout_step(store, f"step={s}", out)
        assert_same_checkpoint(as_of_step(run.save_dir, s, tmp_path / f"ref{s}"), out)
    gc(store, Retention())
    assert_only_live(store)
