"""I1 and I6 on a leased store (docs/FORMAT.md section 8.1): gc's deletions against a publication that
reuses blobs, each side writing first and reading the other's second (store/gc_notices.py). The
simulation's ``--slip`` seeds 26 and 83 broke this: a host stalled past its lease after its fence,
and a gc deleted a pack a commit had just reused (or the commit published after the gc's deletes).
Played here request by request, through the real CLI and real S3 objects, in each order."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import boto3
import pytest
import zstandard

from tailorstore import Store
from tailorstore.core.errors import LeaseLostError
from tailorstore.core.failpoints import requests_made
from tailorstore.curate.gc import Retention, plan_gc
from tailorstore.store import gc_notices
from tailorstore.store.index.catalogue import Catalogue
from testbed.local_s3 import BUCKET, LocalS3
from tests.conftest import one_line
from tests.system.test_hosts import host_env, run, steps_seen_by_a_new_host


def _dead_after_rm(location: str) -> tuple[set[str], set[str], set[str]]:
    """What a gc planning now would delete (step 3 removed), and what it listed before its sync."""
    with Store.open(location) as store:
        known = gc_notices.publications(store.repo.backend)
        blobs, packs = plan_gc(store.repo, [Retention()]).doomed()
    assert blobs and packs, "step 3's own blobs are dead once it is removed, and their packs emptied or repacked"
    return blobs, packs, known


def test_a_publication_and_a_gc_notice_each_see_the_other(
    s3_location: str, saves: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    location = s3_location
    at3, at6 = saves
    a = host_env(tmp_path / "host-a")
    monkeypatch.setenv("TAILOR_CACHE", a["TAILOR_CACHE"])  # the gc played here is host a's
    assert run(a, "init", location).returncode == 0
    for save in (at3, at6):
        assert run(a, "commit", str(save), "--store", location).returncode == 0
    assert run(a, "rm", "step=3", "--store", location).returncode == 0

    # 1. the publication first: the gc's read after its notice finds it, and gc must stop
    dead, packs, known = _dead_after_rm(location)
    assert run(a, "commit", str(at3), "--store", location).returncode == 0  # reuses the dead blobs' objects
    with Store.open(location) as store:
        backend = store.repo.backend
        notice = gc_notices.announce(backend, dead, packs)
        found = gc_notices.published_since(backend, known, notice)
        new_key = store.repo.manifest(store.repo.resolve("step=3")).object_key
        gc_notices.withdraw(backend, notice)
    assert found == new_key
    assert steps_seen_by_a_new_host(location, tmp_path / "host-b") == [3, 6]

    # 2. the notice first: the publication's read after its put finds it, and it takes itself back
    assert run(a, "rm", "step=3", "--store", location).returncode == 0
    dead, packs, _ = _dead_after_rm(location)
    with Store.open(location) as store:
        notice = gc_notices.announce(store.repo.backend, dead, packs)  # a gc that died after its notice
    committed = run(a, "commit", str(at3), "--store", location)
    assert committed.returncode == 4 and "was taken back: a gc running meanwhile" in committed.stderr, committed.stderr
    assert len(committed.stderr.strip().splitlines()) == 1 and "Traceback" not in committed.stderr
    assert steps_seen_by_a_new_host(location, tmp_path / "host-c") == [6]  # nothing of it is visible

    # the notice blocks only what needs its blobs, until a user clears it
    assert run(a, "commit", str(at3), "--store", location).returncode == 4
    cleared = run(a, "gc", "--clear-notices", "--store", location)
    assert cleared.returncode == 0 and "cleared 1 notice" in cleared.stderr, cleared.stderr
    with Store.open(location) as store:
        assert gc_notices.notice_keys(store.repo.backend) == []
        assert not store.repo.backend.exists(notice.key)
    assert run(a, "commit", str(at3), "--store", location).returncode == 0
    assert run(a, "verify", "--deep", "--store", location).returncode == 0
    assert steps_seen_by_a_new_host(location, tmp_path / "host-d") == [3, 6]


def test_a_publication_after_a_whole_gc_finds_its_objects_gone(
    s3_location: str, saves: tuple[Path, Path], tmp_path: Path
) -> None:
    """The notice is withdrawn once gc's deletes are done, so a publication whose read of ``gc/``
    comes after a whole gc (which listed before its put) must see the deletions themselves."""
    at3, _ = saves
    with Store.init(s3_location) as store:
        store.commit(at3)
        repo = store.repo
        needs = repo.view(Catalogue).referenced_blobs(repo.resolve("step=3"))
        gc_notices.check_publication(repo.backend, needs, "checking", repo.size_lookup(needs))  # all there
        packed = next(b for b in needs if b.pack is not None)
        repo.backend.delete(packed.key())  # what the gc deleted between the put and the read
        with pytest.raises(LeaseLostError, match=f"blob {packed.hash}, which it needs, was deleted"):
            gc_notices.check_publication(repo.backend, needs, "checking", repo.size_lookup(needs))


def test_a_gc_on_s3_leaves_no_notice_and_a_local_store_writes_none(
    s3_location: str, saves: tuple[Path, Path], tmp_path: Path
) -> None:
    at3, at6 = saves
    for location in (s3_location, str(tmp_path / "store")):
        with Store.init(location) as store:
            store.commit(at3)
            store.commit(at6)
            store.remove("step=3")
            before = requests_made().get("gc/put-create", 0)
            plan = store.gc()  # no rules: it drops no step, so its create-only puts are its lease and its notice
            notices = requests_made().get("gc/put-create", 0) - before
            assert plan.dead_blobs or plan.orphan_files or plan.dead_packs or plan.repack
            assert gc_notices.notice_keys(store.repo.backend) == []
            assert notices == (2 if location.startswith("s3://") else 0), (location, notices)


def test_a_strangers_objects_under_gc_are_read_as_hostile(
    s3_server: LocalS3, s3_location: str, saves: tuple[Path, Path], tmp_path: Path
) -> None:
    """Anyone with access to the bucket can put objects under ``gc/``. One whose key is not a
    notice's is ignored; a notice that cannot be read stops a commit with one line (exit 3) and
    changes nothing, until a gc run told to clears it."""
    at3, _ = saves
    a = host_env(tmp_path / "host-a")
    assert run(a, "init", s3_location).returncode == 0
    client = boto3.client("s3", endpoint_url=s3_server.endpoint)
    prefix = s3_location.removeprefix(f"s3://{BUCKET}/")
    client.put_object(Bucket=BUCKET, Key=f"{prefix}/gc/x/1-ODD.json.zst", Body=b"\x28\xb5\x2f\xfd not a frame")
    client.put_object(Bucket=BUCKET, Key=f"{prefix}/gc/readme.txt", Body=b"hello")
    assert run(a, "commit", str(at3), "--store", s3_location).returncode == 0  # neither is a notice
    client.put_object(Bucket=BUCKET, Key=f"{prefix}/gc/1-0123456789abcdef.json.zst", Body=b"\x28\xb5\x2f\xfd junk")
    assert run(a, "rm", "step=3", "--store", s3_location).returncode == 0
    committed = run(a, "commit", str(at3), "--store", s3_location)
    one_line(committed, 3, "gc notice gc/1-0123456789abcdef.json.zst is damaged")
    assert steps_seen_by_a_new_host(s3_location, tmp_path / "host-b") == []
    assert run(a, "gc", "--clear-notices", "--store", s3_location).returncode == 0
    assert run(a, "commit", str(at3), "--store", s3_location).returncode == 0
    assert steps_seen_by_a_new_host(s3_location, tmp_path / "host-c") == [3]


def _notice_body(blobs: set[str], packs: set[str], host: str, pid: int) -> bytes:
    doc = {"tailorstore_gc_notice": 1, "blobs": sorted(blobs), "packs": sorted(packs), "host": host, "pid": pid}
    return zstandard.ZstdCompressor().compress(json.dumps(doc).encode())


def test_a_notice_of_a_gc_that_died_on_this_host_blocks_nothing_and_the_next_gc_deletes_it(
    s3_location: str, saves: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A gc killed between its notice and its withdrawal (CI met it: tests/system/test_s3_faults.py) left a
    notice that failed every later commit of the same blobs until a user ran ``--clear-notices``.
    Where the notice's pid is free on the same host its gc is certainly gone: commits pass over it and
    the next gc deletes it. Another host's notice, or a live process's, still blocks."""
    at3, at6 = saves
    a = host_env(tmp_path / "host-a")
    monkeypatch.setenv("TAILOR_CACHE", a["TAILOR_CACHE"])
    assert run(a, "init", s3_location).returncode == 0
    for save in (at3, at6):
        assert run(a, "commit", str(save), "--store", s3_location).returncode == 0
    assert run(a, "rm", "step=3", "--store", s3_location).returncode == 0
    dead, packs, _ = _dead_after_rm(s3_location)
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(gone.stdout)  # a pid that was this host's and is free now
    here = socket.gethostname()
    with Store.open(s3_location) as store:
        backend = store.repo.backend
        backend.put("gc/11-00000000000000aa.json.zst", _notice_body(dead, packs, here, dead_pid), create_only=True)
        elsewhere = "gc/12-00000000000000bb.json.zst"
        backend.put(elsewhere, _notice_body(dead, packs, "another-host", dead_pid), create_only=True)
        assert [n.key for n in gc_notices.abandoned(backend)] == ["gc/11-00000000000000aa.json.zst"]

    # another host's notice blocks (its gc may only be stalled); taken away, the dead one's does not
    committed = run(a, "commit", str(at3), "--store", s3_location)
    assert committed.returncode == 4 and elsewhere in committed.stderr, committed.stderr
    with Store.open(s3_location) as store:
        store.repo.backend.delete(elsewhere)
    assert run(a, "commit", str(at3), "--store", s3_location).returncode == 0
    assert steps_seen_by_a_new_host(s3_location, tmp_path / "host-b") == [3, 6]

    # the next gc, alone under its lock, deletes the dead gc's notice and nothing else of gc/
    live = "gc/13-00000000000000cc.json.zst"
    with Store.open(s3_location) as store:
        store.repo.backend.put(live, _notice_body(set(), set(), here, os.getpid()), create_only=True)
    assert run(a, "gc", "--store", s3_location).returncode == 0
    with Store.open(s3_location) as store:
        assert gc_notices.notice_keys(store.repo.backend) == [live]
    assert run(a, "verify", "--deep", "--store", s3_location).returncode == 0
