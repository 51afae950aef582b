"""The archive tier (`tailor gc --thin archive`): weights quantized against the previous archived
step, on a real 10-save DeepSpeed run, chains read back and refused in a store, and the grid a run
carries. The codec's own bound and hostile descriptors are tests/unit/store/test_archive_codec.py."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
import zstandard
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
from safetensors.torch import load_file

import tailorstore
from tailorstore import Retention
from tailorstore.core.errors import CorruptStoreError
from tailorstore.curate.archiving import ARCHIVE_FROM, KEYFRAME_EVERY
from tailorstore.store import archive_codec
from tailorstore.store.index.catalogue import Catalogue, CatalogueEdit
from tailorstore.store.repo import Repository
from testbed.local_s3 import LocalS3
from tests.conftest import Runs, as_of_step, commit_saves, index_db, store_state, tailor

STEPS = list(range(1, 11))  # the ten-saves run: a save at every step


def exported(store: Path | str, step: int, out: Path) -> dict[str, torch.Tensor]:
    with tailorstore.Store.open(store) as api:
        api.export(f"step={step}", out, dtype="bf16")
    return load_file(out / "model.safetensors")


def bound(exact: torch.Tensor) -> torch.Tensor:
    """The documented bound, per element: half a grid step of its group (1/(2 levels) of the group's
    largest magnitude, and a hair for FP32 arithmetic), plus half a bf16 unit of the reconstruction."""
    x = exact.float().flatten()
    pad = (-x.numel()) % archive_codec.GROUP
    groups = torch.nn.functional.pad(x.abs(), (0, pad)).view(-1, archive_codec.GROUP).amax(dim=1)
    half_step = (groups / archive_codec.DEFAULT_LEVELS * 0.5 * (1 + 2**-10)).repeat_interleave(archive_codec.GROUP)
    half = half_step[: x.numel()]
    return half + (x.abs() + half) * 2**-8 + 1e-30  # half a bf16 unit of the reconstruction, |y| <= |x| + half


def archived_blobs(store: Repository, step: int) -> list[archive_codec.ArchiveSpec]:
    rows = index_db(store).execute(
        "SELECT b.codec, b.raw_size FROM atoms a JOIN manifests m ON m.id=a.manifest JOIN blobs b ON b.hash=a.blob"
        " WHERE m.step=? AND b.codec LIKE '%archive-delta%'",
        (step,),
    )
    return [archive_codec.parse(r[0], r[1], "test") for r in rows]


@pytest.mark.slow
def test_an_archive_chain_of_ten_steps(runs: Runs, tmp_path: Path) -> None:
    repo, save_dir = commit_saves(runs, "ten-saves", tmp_path, STEPS)
    root = repo.root
    exact = {s: exported(root, s, tmp_path / f"exact{s}") for s in STEPS}
    before = sum(p.stat().st_size for p in root.rglob("*") if p.is_file())

    # the dry run names the weights it archives (it said only the norms' bytes, then wrote megabytes)
    dry = tailor("gc", "--keep-last", "1", "--thin", "archive", "--dry-run", "--json", store=root)
    assert dry.returncode == 0, dry.stderr
    planned = json.loads(dry.stdout)
    raw = sum(s["raw_bytes"] for s in json.loads(tailor("log", "--json", store=root).stdout) if s["step"] < 10)
    assert 1 << 20 < planned["archive_weight_bytes"] < raw, (planned["archive_weight_bytes"], raw)
    assert planned["written_bytes"] is None
    proc = tailor("gc", "--keep-last", "1", "--thin", "archive", store=root)
    assert proc.returncode == 0, proc.stderr
    assert "thin 9 manifest(s) (steps 1, 2, 3, 4, 5, 6, 7, 8, 9) to archive" in proc.stdout
    assert "archive " in proc.stdout and "less what it writes" in proc.stdout
    after = sum(p.stat().st_size for p in root.rglob("*") if p.is_file())
    assert after < before / 2, (before, after)
    store = Repository.open(root)
    record = store.manifest(store.resolve("step=5"))
    doc = json.loads(zstandard.ZstdDecompressor().decompress((root / str(record.object_key)).read_bytes()))
    assert doc["tailorstore_manifest"] == 4 and doc["manifest"]["tier"] == "archive"  # older readers refuse it
    listed = {row[0] for row in doc["blobs"]["rows"]}
    chains = {s: archived_blobs(store, s) for s in STEPS}
    assert {h for spec in chains[5] for h in spec.bases} <= listed, "the object lists its chains' links"
    assert chains[10] == [], "the kept step stays whole"
    assert all(chains[s] for s in STEPS[:-1]), "every thinned step holds archived weights"
    assert all(not spec.bases for spec in chains[1]), "the first archived step is a keyframe"
    lengths = [len(spec.bases) for s in STEPS[:-1] for spec in chains[s]]
    assert max(lengths) >= 3, "later steps are residuals on a chain"
    assert max(lengths) < KEYFRAME_EVERY, "a chain never grows past the keyframe interval"

    worst = 0.0
    for s in STEPS:  # each step's export within the bound of its exact weights
        got = exported(root, s, tmp_path / f"arch{s}")
        assert got.keys() == exact[s].keys()
        for name, x in exact[s].items():
            y = got[name]
            if s == 10 or x.numel() < ARCHIVE_FROM:
                assert torch.equal(x, y), (s, name)  # whole, or too small to archive: exact
                continue
            err = (x.float() - y.float()).abs().flatten()
            assert (err <= bound(x)).all(), (s, name, float(err.max()))
            worst = max(worst, float(err.max() / x.float().abs().max()))
    assert 0 < worst <= 1 / (2 * archive_codec.DEFAULT_LEVELS) + 2**-8, worst
    with tailorstore.Store.open(root) as api:  # fp32 export: the same weights, widened exactly
        api.export("step=5", tmp_path / "fp32", dtype="fp32")
    wide = load_file(tmp_path / "fp32" / "model.safetensors")
    narrow = exported(root, 5, tmp_path / "bf16-again")
    assert all(wide[n].dtype == torch.float32 and torch.equal(wide[n], narrow[n].float()) for n in narrow)

    with tailorstore.Store.open(root) as api:
        assert api.verify(deep=True).ok
    # gc drops the odd steps; the even ones' chains run through them and must stay
    kept = {s: exported(root, s, tmp_path / f"kept{s}") for s in (2, 4, 6, 8)}
    proc = tailor("gc", "--keep-last", "1", "--keep-every", "2", store=root)
    assert proc.returncode == 0, proc.stderr
    assert [m.step for m in Repository.open(root).view(Catalogue).manifests()] == [2, 4, 6, 8, 10]
    with tailorstore.Store.open(root) as api:
        report = api.verify(deep=True)
        assert report.ok, report.problems
    for s, tensors in kept.items():
        again = exported(root, s, tmp_path / f"again{s}")
        assert all(torch.equal(tensors[n], again[n]) for n in tensors), s

    # an average over archived steps takes their weights as they read back, widened exactly
    spec = tmp_path / "avg.yaml"
    spec.write_text(yaml.safe_dump({"method": "sma", "steps": [6, 8, 10]}))
    with tailorstore.Store.open(root) as api:
        api.merge(spec, tag="avg")
        api.checkout("tag=avg", tmp_path / "avg")
    got = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path / "avg"))
    last = get_fp32_state_dict_from_zero_checkpoint(str(save_dir), tag="global_step10")
    for name, value in got.items():
        expected = (kept[6][name].double() + kept[8][name].double() + last[name].double()) / 3
        assert torch.allclose(value.double(), expected, rtol=1e-6, atol=1e-9), name

    # checkout of an archived step is refused, and writes nothing
    out = tmp_path / "refused"
    proc = tailor("checkout", "step=6", "--out", str(out), store=root)
    assert proc.returncode == 2 and "thinned to archive" in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and not out.exists()

    # a damaged keyframe: verify names it, and a step built on it refuses to export (exit 3)
    store = Repository.open(root)
    spec = max(archived_blobs(store, 8), key=lambda x: len(x.bases))
    keyframe = store.blob(spec.bases[0])
    assert keyframe is not None
    target = root / keyframe.key()
    data = bytearray(target.read_bytes())
    at = (keyframe.pack_offset or 0) + keyframe.stored_size // 2
    data[at] ^= 0xFF
    target.chmod(0o644)
    target.write_bytes(bytes(data))
    state = store_state(root)
    proc = tailor("verify", "--deep", store=root)
    assert proc.returncode == 3 and keyframe.hash in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    proc = tailor("export", "step=8", "--out", str(tmp_path / "damaged"), store=root)
    assert proc.returncode == 3, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and keyframe.hash in errors[0] and "damaged" in errors[0], proc.stderr
    assert not (tmp_path / "damaged" / "model.safetensors").exists()
    assert store_state(root) == state


def _chain_store(tmp_path: Path) -> tuple[Repository, list[str], np.ndarray]:
    """A real store holding a keyframe and two residuals on it (big enough to be loose blobs)."""
    from tailorstore.store.packs.writer import BlobWriter

    store = Repository.init(tmp_path / "store")
    writer = BlobWriter(store)
    rng = np.random.default_rng(1)
    x = rng.standard_normal(300_000).astype(np.float32)
    names: list[str] = []
    base: bytearray | None = None
    for _ in range(3):
        x = x + rng.standard_normal(x.size).astype(np.float32) * 1e-3
        out = archive_codec.encode(memoryview(x.tobytes()), "float32", base and memoryview(base), tuple(names))
        assert out is not None
        names.append(writer.add_encoded(out.raw, out.payload, out.spec.descriptor()))
        base = out.raw
    blobs = writer.finish()
    with store.transaction(CatalogueEdit) as index:
        index.add_packs(writer.new_packs())
        index.upsert_blobs(blobs)
    return store, names, x


def test_a_chain_reads_back_and_a_hostile_chain_is_refused(tmp_path: Path) -> None:
    store, names, x = _chain_store(tmp_path)
    row = store.blob(names[-1])
    assert row is not None and json.loads(row.codec)["bases"] == names[:-1]
    got = np.frombuffer(store.read_blob(names[-1], "test"), dtype=np.float32)
    assert np.abs(got - x).max() <= np.abs(x).max() / (2 * archive_codec.DEFAULT_LEVELS) * 1.01

    db = index_db(store)
    keyframe = json.loads(store.blob(names[0]).codec)  # type: ignore[union-attr]
    for hostile in (
        {**keyframe, "bases": [names[2]]},  # a loop: the keyframe built on its own descendant
        {**keyframe, "bases": [names[1], names[0]]},
    ):
        db.execute("UPDATE blobs SET codec=? WHERE hash=?", (json.dumps(hostile), names[0]))
        with pytest.raises(CorruptStoreError, match="chain"):
            Repository.open(store.root).read_blob(names[2], "test")
    db.execute("UPDATE blobs SET codec=? WHERE hash=?", (json.dumps(keyframe), names[0]))
    db.execute("DELETE FROM blobs WHERE hash=?", (names[1],))
    with pytest.raises(CorruptStoreError, match="does not hold"):
        Repository.open(store.root).read_blob(names[2], "test")


def test_a_malformed_archive_descriptor_does_not_break_the_index_queries(tmp_path: Path) -> None:
    store, names, _ = _chain_store(tmp_path)
    index_db(store).execute("UPDATE blobs SET codec=? WHERE hash=?", ('{"id": "archive-delta", "bases": [', names[2]))
    store = Repository.open(store.root)
    assert {b.hash for b in store.view(Catalogue).blobs_unused_by([])} == set(names)  # no manifest keeps any
    with pytest.raises(CorruptStoreError):
        store.read_blob(names[2], "test")


def test_the_archive_grid_is_checked_and_carried_by_a_run(tmp_path: Path) -> None:
    from tailorstore.core.errors import StoreError
    from tailorstore.curate.archiving import ArchiveGrid
    from tailorstore.curate.gc import Retention

    with pytest.raises(StoreError, match="archive"):
        Retention(keep_last=3, thin="weights", archive_levels=31, keyframe_every=16)  # a grid without the archive tier
    for levels, every in ((0, 8), (127, 0), (127, 65), (True, 8)):
        with pytest.raises(StoreError):
            ArchiveGrid(levels, every)
    root = tmp_path / "store"
    tailorstore.Store.init(root).close()
    proc = tailor("run", "retention", "--keep-last", "3", "--thin", "archive", "--archive-levels", "31",
                  "--keyframe-every", "16", store=root)  # fmt: skip
    assert proc.returncode == 0 and "31 levels, a keyframe every 16" in proc.stdout, proc.stdout + proc.stderr
    with tailorstore.Store.open(root) as api:
        rules = api.retention()
    assert rules is not None and rules.grid == ArchiveGrid(31, 16)
    proc = tailor("run", "retention", "--archive-levels", "15", store=root)  # alone: refused, never ignored
    assert proc.returncode == 2 and "--thin archive" in proc.stderr, proc.stdout + proc.stderr
    proc = tailor("gc", "--keep-last", "3", "--thin", "archive", "--archive-levels", "0", store=root)
    assert proc.returncode == 2 and "--archive-levels" in proc.stderr and len(proc.stderr.splitlines()) == 1


@pytest.mark.slow
def test_an_archive_on_s3_reads_back_after_an_index_rebuild(runs: Runs, s3_server: LocalS3, tmp_path: Path) -> None:
    """On S3 the archived chains live in the manifest objects' blob rows: once the steps that first
    stored a chain's links are dropped, a host whose index is rebuilt from the objects still
    exports the same bytes as the POSIX store archived the same way."""
    save_dir = runs.get("five-saves-wide").save_dir  # its weights are loose blobs, listed by no pack
    local = tmp_path / "posix"
    location = s3_server.new_location()
    steps = {step: as_of_step(save_dir, step, tmp_path / f"at{step}") for step in range(1, 6)}
    for where in (local, location):
        with tailorstore.Store.init(where) as api:
            for folder in steps.values():
                api.commit(folder)
            api.gc(Retention(keep_last=1, thin="archive"))
            api.gc(Retention(keep_last=1, keep_every=2))  # steps 1 and 3 go: step 4's chain runs through their blobs
    expected = exported(local, 4, tmp_path / "posix-export")
    tailorstore.Store.rebuild_index(location)
    got = exported(location, 4, tmp_path / "s3-export")
    assert got.keys() == expected.keys() and all(torch.equal(got[n], expected[n]) for n in got)
    with tailorstore.Store.open(location) as api:
        assert api.verify(deep=True).ok
        assert [(s.step, s.tier) for s in api.log()] == [(2, "archive"), (4, "archive"), (5, None)]


def _poison(tag_dir: Path) -> None:
    """A diverged training's save: the first element of the embedding NaN, in rank 0's FP32 master
    and, rounded as DeepSpeed rounds it, in the bf16 weight (so the weight is still derived)."""
    optim = tag_dir / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"
    state = torch.load(optim, weights_only=False)
    with torch.no_grad():  # DeepSpeed saves the partition as a leaf that requires grad
        state["optimizer_state_dict"]["single_partition_of_fp32_groups"][0][0] = float("nan")
    torch.save(state, optim)
    model = tag_dir / "mp_rank_00_model_states.pt"
    states = torch.load(model, weights_only=False)
    with torch.no_grad():
        states["module"]["model.embed_tokens.weight"].view(torch.int16)[0, 0] = -1  # 0xFFFF: NaN as copy_ rounds it
    torch.save(states, model)


@pytest.mark.slow
def test_a_derived_weight_that_cannot_be_archived_is_kept_exact(runs: Runs, tmp_path: Path) -> None:
    """A weight holding a NaN is not archived; derived from its master, which the tier drops, it is
    stored as it is, so the step still exports it bit for bit (it failed to rebuild before)."""
    save_dir = runs.get("ten-saves").save_dir
    root = tmp_path / "store"
    first = as_of_step(save_dir, 1, tmp_path / "at1")
    _poison(first / "global_step1")
    with tailorstore.Store.init(root) as api:
        api.commit(first)
        api.commit(as_of_step(save_dir, 2, tmp_path / "at2"))
    store = Repository.open(root)
    name = "model.embed_tokens.weight"
    derived = index_db(store).execute(
        "SELECT a.derived FROM atoms a JOIN manifests m ON m.id=a.manifest WHERE m.step=1 AND a.param=? AND a.kind=?",
        (name, "weight"),
    )
    assert [r[0] for r in derived] == ["round-from-master"], "the poisoned weight is derived, as the test needs"
    before = exported(root, 1, tmp_path / "before")
    with tailorstore.Store.open(root) as api:
        api.gc(Retention(keep_last=1, thin="archive"))
        assert api.verify(deep=True).ok
    codecs = index_db(Repository.open(root)).execute(
        "SELECT a.derived, b.codec FROM atoms a JOIN manifests m ON m.id=a.manifest JOIN blobs b ON b.hash=a.blob"
        " WHERE m.step=1 AND a.param=? AND a.kind=?",
        (name, "weight"),
    )
    assert [(d, "archive-delta" in c) for d, c in codecs] == [(None, False)], "stored exact, not archived"
    after = exported(root, 1, tmp_path / "after")
    assert torch.isnan(after[name][0, 0].float())
    assert torch.equal(after[name].view(torch.int16), before[name].view(torch.int16))
    assert any("archive-delta" in r[0] for r in index_db(Repository.open(root)).execute("SELECT codec FROM blobs"))
