"""Where a blob lives comes from the packs' trailers, never from a manifest object (attack
finding 3). A copy of a step's manifest planted under another step, with every ``blobs`` row set
to ``pack: null``, was imported first by an index rebuild or a new host's first open; its rows
kept the real pack from placing them, and a plain ``tailor gc`` deleted the real pack as empty:
the step was lost on every host, even after the impostor was removed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import zstandard

from tailorstore.store.backends.base import Backend
from tailorstore.store.backends.location import resolve
from tests.conftest import TEST_DATA, copy_tree, one_line, tailor
from tests.system.test_hosts import host_env, run


def _plant_impostor(backend: Backend, real_key: str, step: int) -> str:
    doc = json.loads(zstandard.ZstdDecompressor().decompress(backend.get(real_key), max_output_size=1 << 30))
    doc["manifest"]["step"] = step
    doc["manifest"]["created_at"] = doc["manifest"]["created_at"] - 3600  # imported before the real one
    columns = doc["blobs"]["columns"]
    for row in doc["blobs"]["rows"]:
        row[columns.index("pack")] = None
        row[columns.index("pack_offset")] = None
    key = real_key.rsplit("/", 1)[0] + f"/step-{step:020d}-v1.json.zst"
    backend.put(key, zstandard.ZstdCompressor().compress(json.dumps(doc).encode()), create_only=True)
    return key


@pytest.mark.parametrize("where", ["posix", "s3"])
def test_a_planted_manifest_that_calls_packed_blobs_loose_loses_no_pack(
    where: str, request: pytest.FixtureRequest, saves: tuple[Path, Path], tmp_path: Path
) -> None:
    location = request.getfixturevalue("s3_location") if where == "s3" else str(tmp_path / "store")
    at3, _ = saves
    a = host_env(tmp_path / "host-a")
    assert run(a, "init", location).returncode == 0
    assert run(a, "commit", str(at3), "--store", location).returncode == 0
    backend = resolve(location).backend
    real = next(k for k in backend.list("manifests/") if "step-00000000000000000003" in k)
    impostor = _plant_impostor(backend, real, 99)
    assert list(backend.list("packs/"))  # step 3's small tensors are in packs

    # a new host's first open (S3) or an index rebuild imports the impostor first; then a plain gc
    b = host_env(tmp_path / "host-b")
    assert run(b, "index", "rebuild", "--store", location).returncode == 0
    # the packs' trailers placed the blobs at once: the impostor's rows moved nothing
    placed = run(b, "verify", "--deep", "--store", location)
    assert placed.returncode == 0, placed.stdout + placed.stderr
    collected = run(b, "gc", "--store", location)
    assert collected.returncode == 0, collected.stderr
    # the impostor removed, the real step still checks out byte for byte, on a host that never saw it
    backend.delete(impostor)
    c = host_env(tmp_path / "host-c")
    assert run(c, "index", "rebuild", "--store", location).returncode == 0
    checked = run(c, "verify", "--deep", "--store", location)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    out = tmp_path / "out"
    done = run(c, "checkout", "step=3", "--out", str(out), "--store", location)
    assert done.returncode == 0, done.stderr
    for path in (at3 / "global_step3").iterdir():
        assert (out / "global_step3" / path.name).read_bytes() == path.read_bytes(), path.name


def test_a_manifest_that_claims_zero3_for_a_zero2_step_is_named_damaged(
    saves: tuple[Path, Path], tmp_path: Path
) -> None:
    """Regression: ``checkout --world-size 1`` of such a step gave a
    ``KeyError: 'optimizer_state_dict'`` traceback; it is one line now, exit 3."""
    location = str(tmp_path / "store")
    at3, _ = saves
    a = host_env(tmp_path / "host-a")
    assert run(a, "init", location).returncode == 0
    assert run(a, "commit", str(at3), "--store", location).returncode == 0
    backend = resolve(location).backend
    key = next(iter(backend.list("manifests/")))
    doc = json.loads(zstandard.ZstdDecompressor().decompress(backend.get(key), max_output_size=1 << 30))
    assert doc["manifest"]["zero_stage"] == 2
    doc["manifest"]["zero_stage"] = 3
    backend.put(key, zstandard.ZstdCompressor().compress(json.dumps(doc).encode()))
    assert run(a, "index", "rebuild", "--store", location).returncode == 0
    done = run(a, "checkout", "step=3", "--world-size", "1", "--out", str(tmp_path / "out"), "--store", location)
    assert done.returncode == 3, (done.returncode, done.stderr)
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "says ZeRO-3" in done.stderr
    assert not (tmp_path / "out").exists()


def test_a_manifest_object_copied_under_another_steps_name_is_refused(small_store: Path, tmp_path: Path) -> None:
    """A fifth-round attack (medium): two manifest objects swapped in the bucket, or one copied under
    another step's name, were imported as the step the name says with the content of the other (a
    tag then checked out the other step's bytes with exit 0; a copy broke the index with a UNIQUE
    constraint and the advice to rebuild it). A host that imports an object whose name and content
    disagree now refuses it, naming it, with one line and exit 3; removing the copy heals the store."""
    store = copy_tree(small_store, tmp_path / "store")
    backend = resolve(str(store)).backend
    real = next(k for k in backend.list("manifests/") if k.endswith("-v1.json.zst"))
    copy = real.rsplit("/", 1)[0] + f"/step-{99:020d}-v1.json.zst"
    backend.put(copy, backend.get(real), create_only=True)
    rebuilt = tailor("index", "rebuild", store=store)
    one_line(rebuilt, 3, copy, "where its name says step 99", "behind the store's back")
    backend.delete(copy)
    assert tailor("index", "rebuild", store=store).returncode == 0
    assert tailor("verify", "--deep", store=store).returncode == 0


@pytest.mark.slow  # seconds: the fast tier keeps its minute
def test_gc_deletes_nothing_while_a_tag_object_names_no_manifest(small_store: Path, tmp_path: Path) -> None:
    """A fifth-round attack (medium: whoever can overwrite a tag object can also point it at another
    step, which unprotects the first as quietly): a tag object whose bytes name no manifest object
    (damaged, or written by hand) was dropped without a word at the next sync, so the step it kept
    was dropped by the next ``gc --keep-last 1`` with exit 0. Now each command warns of it once, and
    gc refuses (exit 3, one error line, nothing deleted) until the tag is set again."""
    store = copy_tree(small_store, tmp_path / "store")
    first = tailor("log", store=store).stdout.strip().splitlines()[1].split()[2]  # id, digest, step
    checkpoint = TEST_DATA / "format1" / "checkpoint"
    assert tailor("commit", str(checkpoint), "--step", "99", store=store).returncode == 0
    assert tailor("tag", first, "keep", store=store).returncode == 0
    (store / "refs" / "tags" / "keep").write_bytes(b"\x00not a manifest key")
    refused = tailor("gc", "--keep-last", "1", store=store)
    assert refused.returncode == 3, refused.stderr
    errors = [line for line in refused.stderr.strip().splitlines() if not line.startswith("warning: ")]
    assert len(errors) == 1 and "keep" in errors[0] and "deletes nothing" in errors[0], refused.stderr
    assert "tag object refs/tags/keep is damaged" in refused.stderr
    assert [row.split()[2] for row in tailor("log", store=store).stdout.strip().splitlines()[1:]] == [first, "99"]
    assert tailor("tag", first, "keep", "--force", store=store).returncode == 0
    assert tailor("gc", "--keep-last", "1", store=store).returncode == 0
    assert [row.split()[2] for row in tailor("log", store=store).stdout.strip().splitlines()[1:]] == [first, "99"]


def test_a_part_object_copied_under_another_steps_name_is_refused(tmp_path: Path) -> None:
    """The same attack on parts (medium): a part of step 3 copied under step 99's folder was
    finalized as step 99 with step 3's content, exit 0. A part whose content names another step
    than its key is damage, named, and nothing is recorded."""
    store = tmp_path / "store"
    assert tailor("init", str(store)).returncode == 0
    folder = TEST_DATA / "format1" / "checkpoint" / "global_step3"
    assert tailor("commit", str(folder), "--part", store=store).returncode == 0
    (part,) = (store / "parts" / "main").rglob("*.json.zst")
    copy = store / "parts" / "main" / f"step-{99:020d}" / part.name
    copy.parent.mkdir()
    copy.write_bytes(part.read_bytes())
    one_line(tailor("finalize", "step=99", store=store), 3, "holds step 3 where its name says step 99")
    assert tailor("log", store=store).stdout.strip().splitlines()[1:] == []
    copy.unlink()
    assert tailor("finalize", "step=3", store=store).returncode == 0
