"""A store on S3 (a real local S3 server: moto on 127.0.0.1) with real DeepSpeed saves:
every command, hosts with separate caches, a rebuilt index, damaged objects and a server
that stops in the middle of a commit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import boto3
import pytest

from tailorstore.access.model_tensors import model_view
from tailorstore.api import Store
from tailorstore.core.errors import CorruptStoreError
from tailorstore.curate.gc import Retention, gc
from tailorstore.curate.refs import remove, tag
from tailorstore.ingest.commit import commit_checkpoint
from tailorstore.ingest.deletion import check_blobs_present
from tailorstore.report.verify import verify
from tailorstore.restore.checkout import checkout_step
from tailorstore.restore.export import export_step
from tailorstore.store.index.catalogue import Catalogue
from tailorstore.store.packs.pack_spans import plan_spans
from tailorstore.store.repo import Repository
from testbed.compare import same_tree
from testbed.local_s3 import BUCKET, CuttableLink, LocalS3
from tests.conftest import Runs, as_of_step, index_db, tailor


def test_every_command_works_on_an_s3_store(s3_server: LocalS3, s3_location: str, runs: Runs, tmp_path: Path) -> None:
    save = runs.get("zero2-bf16").save_dir
    at3 = as_of_step(save, 3, tmp_path / "at3")
    at6 = as_of_step(save, 6, tmp_path / "at6")

    def ok(*args: str) -> str:
        proc = tailor(*args, store=s3_location)  # type: ignore[arg-type]
        assert proc.returncode == 0, proc.stderr
        assert "Traceback" not in proc.stderr
        return proc.stdout

    ok("init", s3_location)
    ok("commit", str(at3), "--tag", "warm")
    ok("commit", str(at6))
    log = json.loads(ok("log", "--json"))
    assert [(s["step"], s["tag"]) for s in log] == [(3, "warm"), (6, None)]
    assert "block.0" in ok("show", "tag=warm")
    assert "block.0" in ok("diff", "step=3", "step=6")
    spec = tmp_path / "spec.yaml"
    spec.write_text("base: {step: 6}\nslices:\n  - sources: [{step: 3, layer_range: [0, 2]}]\n")
    ok("merge", str(spec), "--tag", "mixed")
    ok("checkout", "latest", "--out", str(tmp_path / "out6"))
    assert same_tree(tmp_path / "out6" / "global_step6", at6 / "global_step6")
    assert "ok" in ok("verify", "--deep")
    ok("untag", "warm")
    ok("gc", "--keep-last", "1")
    assert [s["step"] for s in json.loads(ok("log", "--json"))] == [6, 6]  # step 6 and the tagged merge
    assert "ok" in ok("verify", "--deep")
    assert "smaller" in ok("du")

    objects = s3_server.objects(s3_location)
    manifests = sorted(k for k in objects if k.startswith("manifests/") and k.endswith(".json.zst"))
    assert len(manifests) == 2 and any("step-00000000000000000006-v1" in k for k in manifests)
    assert objects["refs/tags/mixed"].split(b"\n")[0].decode() in manifests  # its key, then its write's token
    assert sum(k.startswith(("blobs/", "packs/")) for k in objects) >= 2
    assert len(objects) < 40, "small blobs share pack objects: one request each would be hundreds"
    cache = Path(os.environ["TAILOR_CACHE"])
    assert not any(p.name.startswith("blobs") for p in cache.rglob("*")), "no blob is kept locally"


def test_hosts_with_separate_caches_see_each_others_commits(
    s3_location: str, runs: Runs, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    save = runs.get("zero2-bf16").save_dir
    host_a, host_b = tmp_path / "cache-a", tmp_path / "cache-b"
    monkeypatch.setenv("TAILOR_CACHE", str(host_a))
    Repository.init(s3_location).close()
    with Repository.open(s3_location) as a:
        commit_checkpoint(a, as_of_step(save, 3, tmp_path / "at3"))

    monkeypatch.setenv("TAILOR_CACHE", str(host_b))  # a new host: its index is built from the manifest objects
    with Repository.open(s3_location) as b:
        assert [r["step"] for r in index_db(b).execute("SELECT step FROM manifests")] == [3]
        commit_checkpoint(b, as_of_step(save, 6, tmp_path / "at6"))
        tag(b, "step=6", "best")

    monkeypatch.setenv("TAILOR_CACHE", str(host_a))
    with Repository.open(s3_location) as a:
        rows = (
            index_db(a)
            .execute("SELECT step, name FROM manifests LEFT JOIN tags ON tags.manifest=manifests.id ORDER BY step")
            .fetchall()
        )
        assert [(r["step"], r["name"]) for r in rows] == [(3, None), (6, "best")]
        gc(a, Retention(keep_last=1))
        out = tmp_path / "out"
        checkout_step(a, "tag=best", out)
    assert same_tree(out / "global_step6", save / "global_step6")

    monkeypatch.setenv("TAILOR_CACHE", str(host_b))
    with Repository.open(s3_location) as b:  # host a's gc dropped step 3: host b's index follows
        assert [r["step"] for r in index_db(b).execute("SELECT step FROM manifests")] == [6]
        assert verify(b, deep=True).ok

    for f in host_b.rglob("index.sqlite*"):
        f.unlink()
    manifests, blobs = Repository.rebuild_index(s3_location)
    assert manifests == 1 and blobs > 100
    with Repository.open(s3_location) as b:
        assert verify(b, deep=True).ok
        assert [r["name"] for r in index_db(b).execute("SELECT name FROM tags")] == ["best"]


def test_missing_or_altered_objects_are_found_and_never_checked_out(
    s3_server: LocalS3, s3_location: str, runs: Runs, tmp_path: Path
) -> None:
    save = runs.get("zero2-bf16").save_dir
    Repository.init(s3_location).close()
    with Repository.open(s3_location) as store:
        commit_checkpoint(store, as_of_step(save, 6, tmp_path / "at6"))
        rows = [
            store.blob(r["blob"])
            for r in index_db(store).execute(
                "SELECT a.blob FROM atoms a JOIN blobs b ON b.hash=a.blob WHERE a.derived IS NULL"
                " ORDER BY b.pack IS NULL DESC, b.pack, b.pack_offset"
            )
        ]
    altered = rows[len(rows) // 2]
    assert altered is not None
    client = boto3.client("s3", endpoint_url=s3_server.endpoint)
    key = f"{s3_location.split(f's3://{BUCKET}/')[1]}/{altered.key()}"
    original = client.get_object(Bucket=BUCKET, Key=key)["Body"].read()
    body = bytearray(original)
    body[(altered.pack_offset or 0) + altered.stored_size // 2] ^= 0xFF
    client.put_object(Bucket=BUCKET, Key=key, Body=bytes(body))

    def refused(out: Path) -> str:
        with Repository.open(s3_location) as store:
            report = verify(store, deep=True)
            assert not report.ok
            with pytest.raises(CorruptStoreError):
                checkout_step(store, "step=6", out)
        assert not out.exists()
        proc = tailor("checkout", "step=6", "--out", str(out), store=s3_location)  # type: ignore[arg-type]
        assert proc.returncode == 3 and "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
        assert not out.exists()
        return "\n".join(report.problems)

    held = f"in pack {altered.pack} at byte {altered.pack_offset}" if altered.pack else f"the object {altered.key()}"
    assert f"blob {altered.hash} ({held}" in refused(tmp_path / "out1"), "the altered blob is named, and where it is"
    client.delete_object(Bucket=BUCKET, Key=key)  # now the object holding it is gone altogether
    missing = refused(tmp_path / "out2")
    assert f"blob {altered.hash} ({held}" in missing and "file missing" in missing
    client.put_object(Bucket=BUCKET, Key=key, Body=original)
    with Repository.open(s3_location) as store:
        assert verify(store, deep=True).ok


def test_reading_from_s3_costs_one_request_per_loose_blob_and_per_span_of_a_pack(
    s3_server: LocalS3, s3_location: str, runs: Runs, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On S3 a request is a round trip. A checkout asks for no object's size (the index knows
    it), reads each loose blob with one GET however large, and each pack's wanted blobs with one
    GET per span of neighbours, not one per blob; export, which reads the masters only, too.
    Counted at a relay between the client and the server."""
    save = runs.get("zero2-bf16").save_dir
    at6 = as_of_step(save, 6, tmp_path / "at6")
    (at6 / "global_step6" / "big.bin").write_bytes(os.urandom(70 << 20))  # a loose blob above a GET window
    Repository.init(s3_location).close()
    with Repository.open(s3_location) as store:
        manifest = commit_checkpoint(store, at6).manifest
        needed = store.view(Catalogue).referenced_blobs(manifest)
        view = model_view(store, manifest)  # what export reads: masters, buffers, frozen weights
        exported_rows = [store.blob(a.blob) for t in view.tensors for a in t.atoms if a.derived is None]
    loose = [r for r in needed if r.pack is None]
    packed = [r for r in needed if r.pack is not None]
    spans = {id(span) for span in plan_spans(packed).values()}
    export_spans = {id(span) for span in plan_spans(r for r in exported_rows if r is not None).values()}
    assert len(packed) > 50 and 1 <= len(spans) <= 3 and len(loose) >= 1

    link = CuttableLink(s3_server.port)
    monkeypatch.setenv("AWS_ENDPOINT_URL", link.endpoint)
    with Repository.open(s3_location) as store:
        link.reset_counts()
        checkout_step(store, "step=6", tmp_path / "out")
        asked = dict(link.requests)
        link.reset_counts()
        model_view(store, manifest)  # export's plan: it reads the skeleton of the model-states file
        planning = link.requests["GET packs"]
        link.reset_counts()
        export_step(store, "step=6", tmp_path / "export", dtype="fp32")
        exported = dict(link.requests)
    assert same_tree(tmp_path / "out" / "global_step6", at6 / "global_step6")
    big = max(loose, key=lambda r: r.stored_size)
    windows = -(-big.stored_size // (64 << 20))  # a GET carries 64 MiB at most (one timeout's worth)
    assert not any(k.startswith("HEAD") for k in asked), asked
    assert asked.get("GET blobs", 0) == len(loose) + windows - 1, asked
    assert asked.get("GET packs", 0) == len(spans), f"{len(packed)} packed blobs: {asked}"
    assert not any(k.startswith("HEAD") for k in exported), exported
    assert planning == 1 and exported.get("GET packs", 0) == planning + len(export_spans), exported
    assert len(export_spans) < len(exported_rows) / 10


def test_verify_and_gc_take_sizes_from_listings_not_a_request_per_blob(
    s3_server: LocalS3, s3_location: str, runs: Runs, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`tailor verify` and gc's plan need the size of every object; a HEAD each would cost a
    round trip per blob. They list blobs/ and packs/ instead, and still catch a pack cut short."""
    save = runs.get("zero2-bf16").save_dir
    Repository.init(s3_location).close()
    with Repository.open(s3_location) as store:
        commit_checkpoint(store, as_of_step(save, 3, tmp_path / "at3"))
        commit_checkpoint(store, as_of_step(save, 6, tmp_path / "at6"))
        blobs = index_db(store).execute("SELECT count(*) FROM blobs").fetchone()[0]
        store.backend.put(f"blobs/ff/{'f' * 32}", b"o" * 1234)  # an orphan, as a killed commit leaves
    assert blobs > 50

    link = CuttableLink(s3_server.port)
    monkeypatch.setenv("AWS_ENDPOINT_URL", link.endpoint)
    with Repository.open(s3_location) as store:
        link.reset_counts()
        report = verify(store)
        checked = dict(link.requests)
        link.reset_counts()
        plan = gc(store, Retention(), dry_run=True)
        planned = dict(link.requests)
    assert report.ok and report.blobs_checked == blobs, report.problems
    assert any("1 orphan blob" in note for note in report.notes), report.notes
    assert plan.orphan_files == ["f" * 32] and plan.freed_bytes >= 1234
    for asked in (checked, planned):
        assert not any(k.startswith("HEAD") for k in asked), asked
        assert sum(asked.values()) < 20, asked

    client = boto3.client("s3", endpoint_url=s3_server.endpoint)
    prefix = s3_location.removeprefix(f"s3://{BUCKET}/")
    pack = next(k for k in s3_server.keys(s3_location) if k.startswith("packs/"))
    body = client.get_object(Bucket=BUCKET, Key=f"{prefix}/{pack}")["Body"].read()
    client.put_object(Bucket=BUCKET, Key=f"{prefix}/{pack}", Body=body[: len(body) // 2])
    with Repository.open(s3_location) as store:
        problems = verify(store).problems
    assert problems and all("truncated" in p or "missing" in p for p in problems), problems


def test_gc_deletes_many_objects_in_a_few_requests(
    s3_server: LocalS3, s3_location: str, runs: Runs, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A gc that frees thousands of blobs must not cost a DELETE each: S3 takes up to 1,000 keys
    in one DeleteObjects request."""
    save = runs.get("zero2-bf16").save_dir
    Repository.init(s3_location).close()
    orphans = [f"{i:032x}" for i in range(1, 41)]
    with Repository.open(s3_location) as store:
        commit_checkpoint(store, as_of_step(save, 3, tmp_path / "at3"))
        commit_checkpoint(store, as_of_step(save, 6, tmp_path / "at6"))
        for name in orphans:  # what killed commits leave behind
            store.backend.put(f"blobs/{name[:2]}/{name}", b"orphan")
    link = CuttableLink(s3_server.port)
    monkeypatch.setenv("AWS_ENDPOINT_URL", link.endpoint)
    with Repository.open(s3_location) as store:
        link.reset_counts()
        plan = gc(store, Retention(keep_last=1))
        asked = dict(link.requests)
        assert verify(store, deep=True).ok
        assert [m.step for m in store.view(Catalogue).manifests()] == [6]
    assert sorted(plan.orphan_files) == orphans and plan.dead_blobs
    assert not any(k.startswith("DELETE blobs") or k.startswith("DELETE packs") for k in asked), asked
    # obstore deletes through DeleteObjects (a POST), even one key: one for the dropped manifest and
    # its pin, one for the 40 orphans and the dead blobs' objects, one for gc's notice once they are gone
    # (store/gc_notices.py), one for the lease (was 44); and the probe's object of this endpoint, new
    # to this host (store/backends/conditional.py)
    assert asked.get("POST ", 0) <= 4 + bool(asked.get("PUT probe")), asked
    assert not any(k.endswith(name) for k in s3_server.keys(s3_location) for name in orphans)


def test_delete_after_commit_checks_the_blobs_with_a_listing_not_a_head_each(
    s3_server: LocalS3, s3_location: str, runs: Runs, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before a committed save is deleted every blob it needs is checked in the bucket; for a
    store of fewer than a thousand loose blobs per new one, one listing does it."""
    at6 = as_of_step(runs.get("zero2-bf16").save_dir, 6, tmp_path / "at6")
    for i in range(6):  # loose blobs (above the pack limit) beside the packed ones
        (at6 / "global_step6" / f"extra{i}.bin").write_bytes(os.urandom(2 << 20))
    link = CuttableLink(s3_server.port)
    monkeypatch.setenv("AWS_ENDPOINT_URL", link.endpoint)
    with Store.init(s3_location) as store:
        link.reset_counts()
        result = store.commit(at6, delete_after_commit=True)
        asked = dict(link.requests)
        loose = [r for r in store.repo.view(Catalogue).referenced_blobs(result.manifest) if r.pack is None]
    assert not (at6 / "global_step6").exists() and len(loose) >= 6
    # one HEAD of its own lease, just before the manifest is recorded (fencing), and none per blob
    assert asked.get("HEAD locks") == 1 and not any(k.startswith("HEAD b") for k in asked), asked

    client = boto3.client("s3", endpoint_url=s3_server.endpoint)
    prefix = s3_location.removeprefix(f"s3://{BUCKET}/")
    client.delete_object(Bucket=BUCKET, Key=f"{prefix}/{loose[0].key()}")
    with Store.open(s3_location) as store, pytest.raises(CorruptStoreError, match=loose[0].hash):
        check_blobs_present(store.repo, result.manifest)


def test_the_relay_closes_the_connections_its_clients_are_done_with(s3_server: LocalS3) -> None:
    """The counting relay of the S3 tests and benchmarks must not keep a socket pair per finished
    connection: a long benchmark opens thousands."""
    link = CuttableLink(s3_server.port)
    for _ in range(5):
        client = boto3.client("s3", endpoint_url=link.endpoint)
        client.list_objects_v2(Bucket=BUCKET, MaxKeys=1)
        client.close()
    deadline = time.monotonic() + 30
    while link._sockets and time.monotonic() < deadline:
        time.sleep(0.05)
    assert link.requests["GET "] == 5 and link._sockets == []


def test_server_gone_mid_commit_is_one_clear_error_and_publishes_nothing(
    s3_server: LocalS3, s3_location: str, runs: Runs, tmp_path: Path
) -> None:
    """A `tailor commit` talks to the server through a link that is cut while it uploads."""
    save = runs.get("zero2-bf16").save_dir
    Repository.init(s3_location).close()
    with Repository.open(s3_location) as store:
        commit_checkpoint(store, as_of_step(save, 3, tmp_path / "at3"))
    before = set(s3_server.keys(s3_location))
    link = CuttableLink(s3_server.port)
    at6 = as_of_step(save, 6, tmp_path / "at6")
    big = at6 / "global_step6" / "big.bin"  # enough bytes that the cut lands mid-upload
    big.write_bytes(os.urandom(24 << 20))
    proc = subprocess.Popen(
        [sys.executable, "-m", "tailorstore.cli.app", "commit", str(at6), "--store", s3_location],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "AWS_ENDPOINT_URL": link.endpoint,
             "TAILOR_S3_RETRY_SECONDS": "5", "TAILOR_S3_TIMEOUT_SECONDS": "5"},  # fail fast on a dead link
    )  # fmt: skip
    deadline = time.monotonic() + 120

    def uploading() -> bool:  # the first new blob or pack is up (not the server's conditional-write probe)
        return any(k.startswith(("blobs/", "packs/")) for k in set(s3_server.keys(s3_location)) - before)

    while not uploading() and time.monotonic() < deadline:
        time.sleep(0.01)  # the upload is under way
    link.cut()
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 5, stderr  # a backend's failure (exit 5), not bad input
    assert "Traceback" not in stderr and len(stderr.strip().splitlines()) == 1, stderr
    assert s3_location in stderr and "reachable" in stderr

    after = set(s3_server.keys(s3_location))
    # blobs and packs gc takes, a lease that expires, a probe object gc takes once it is old
    unexpected = [k for k in after - before if not k.startswith(("blobs/", "packs/", "locks/", "probe/"))]
    assert not unexpected, "no manifest or ref of step 6"
    with Repository.open(s3_location) as store:
        assert [r["step"] for r in index_db(store).execute("SELECT step FROM manifests")] == [3]
        assert verify(store, deep=True).ok
        commit_checkpoint(store, at6)  # and the store goes on working
        assert verify(store, deep=True).ok


def test_a_host_reading_after_another_hosts_repack_finds_the_moved_blobs(
    s3_location: str, runs: Runs, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Host a's gc repacks the pack host b's cache names for step 3's blobs. Host b then only
    reads (an open takes no lock): its rows naming the gone pack are placed again from the new
    pack's trailer, and its checkout of step 3 is whole."""
    save = runs.get("zero2-bf16").save_dir
    host_a, host_b = tmp_path / "cache-a", tmp_path / "cache-b"
    merged = as_of_step(save, 6, tmp_path / "both")  # global_step3 beside global_step6: one commit, one pack
    (merged / "extra").mkdir()
    for f in (save / "global_step3").iterdir():
        (merged / "extra" / f.name).write_bytes(f.read_bytes())
    monkeypatch.setenv("TAILOR_CACHE", str(host_a))
    Repository.init(s3_location).close()
    with Repository.open(s3_location) as a:
        commit_checkpoint(a, merged)
        commit_checkpoint(a, as_of_step(save, 3, tmp_path / "at3"))
    monkeypatch.setenv("TAILOR_CACHE", str(host_b))
    with Repository.open(s3_location) as b:
        before = {r["pack"] for r in index_db(b).execute("SELECT pack FROM blobs WHERE pack IS NOT NULL")}
    monkeypatch.setenv("TAILOR_CACHE", str(host_a))
    with Repository.open(s3_location) as a:
        remove(a, "step=6")
        assert gc(a, Retention()).repack
    monkeypatch.setenv("TAILOR_CACHE", str(host_b))
    with Repository.open(s3_location) as b:
        after = {r["pack"] for r in index_db(b).execute("SELECT pack FROM blobs WHERE pack IS NOT NULL")}
        assert after - before, "step 3's blobs now name the pack the repack wrote"
        out = tmp_path / "out"
        checkout_step(b, "step=3", out)
        assert verify(b, deep=True).ok
    assert same_tree(out / "global_step3", save / "global_step3")


@pytest.mark.slow
def test_the_ranks_of_a_node_opening_one_fresh_cache_at_once_all_open_the_store(
    s3_server: LocalS3, s3_location: str, tmp_path: Path
) -> None:
    """Every rank of a node opens the store (the DCP writer and reader do) with the node's one
    cache: the index used to be created in place, so a rank read the file another was filling
    ("no such table: meta", exit 3) or created its tables twice (a bare sqlite3 traceback); 5 of 24
    processes failed that way. Six processes, four rounds, each round a fresh cache."""
    Store.init(s3_location).close()
    for round_ in range(4):
        cache = tmp_path / f"cache-{round_}"
        start = time.time() + 1.5  # every process past its imports, then all at once
        code = (
            f"import time; time.sleep(max(0.0, {start} - time.time())); "
            f"from tailorstore import Store; Store.open({s3_location!r}).close()"
        )
        env = {**os.environ, "TAILOR_CACHE": str(cache)}
        procs = [
            subprocess.Popen([sys.executable, "-c", code], env=env, stderr=subprocess.PIPE, text=True) for _ in range(6)
        ]
        failed = [err for p in procs for _, err in [p.communicate()] if p.returncode]
        assert failed == [], failed
        # Nothing of the build is left beside it. SQLite's own -wal and -shm may stay: when two
        # last connections close at once, neither can fold the log in, and the next open does.
        names = {p.name for p in next(cache.iterdir()).iterdir()} - {"index.sqlite-wal", "index.sqlite-shm"}
        assert names == {"index.sqlite"}
