"""Retention tiers (`tailor gc --thin weights|master`) on real DeepSpeed runs, and gc dropping
a step that kept composites inherit from."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import threading
import time
from pathlib import Path

import pytest
import torch
import yaml
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

import tailorstore
from tailorstore import Retention
from tailorstore.core import atom_types as A
from tailorstore.core.policies import PolicySpec
from tailorstore.core.records import AtomRecord, FileRecord
from tailorstore.curate.thinning import thinned_contents
from tailorstore.report.usage import usage
from tailorstore.report.verify import verify
from tailorstore.store.index.catalogue import Catalogue
from tailorstore.store.repo import Repository
from testbed.compare import same_tree, tensors_identical
from tests.conftest import (
    TAILOR_EVERY,
    TAILOR_STEPS,
    TEST_DATA,
    KillClock,
    Runs,
    as_of_step,
    assert_only_live,
    commit_saves,
    index_db,
    store_state,
    tailor,
)

SAVES = list(range(TAILOR_EVERY, TAILOR_STEPS + 1, TAILOR_EVERY))  # 3, 6, ..., 18
OPTIM = "global_step3/bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"
STATES = "global_step3/mp_rank_00_model_states.pt"


# -- pure ----------------------------------------------------------------------------------


def atom(path: str, param: str, kind: str, derived: str | None = None, numel: int = 4) -> AtomRecord:
    return AtomRecord(
        path, 0, 0, numel, "float32", "[4]", param, kind, 0, 0, 16, "block.0", f"{param}{kind}", derived, 0
    )


def file(path: str) -> FileRecord:
    return FileRecord(path, path, "torch", 0, f"skeleton-{path}", 100, 0o644, False, f"container-{path}")


def test_thinned_contents_per_tier() -> None:
    files = [file(STATES), file(OPTIM), file("global_step3/zero_pp_rank_0_mp_rank_00_optim_states.pt")]
    atoms = [
        atom(STATES, "w", A.WEIGHT, derived="round-from-master"),
        atom(STATES, "rope", A.BUFFER),
        atom(STATES, "z3", A.WEIGHT, numel=0),  # ZeRO 3: the model states hold no weight of it
        atom(OPTIM, "w", A.MASTER),
        atom(OPTIM, "w", A.EXP_AVG),
        atom(OPTIM, "w", A.EXP_AVG_SQ),
        atom(OPTIM, "z3", A.MASTER),
        atom(OPTIM, "z3", A.EXP_AVG),
    ]
    master = thinned_contents(files, atoms, "master")
    assert [(a.param, a.kind) for a in master.atoms] == [
        ("w", A.WEIGHT), ("rope", A.BUFFER), ("z3", A.WEIGHT), ("w", A.MASTER), ("z3", A.MASTER),
    ]  # fmt: skip
    assert master.materialize == [] and master.atoms[0].derived == "round-from-master"
    assert [f.path for f in master.files] == [STATES, OPTIM]  # the optimizer file without atoms goes
    assert "wweight" not in master.hashes() and "wmaster" in master.hashes()

    weights = thinned_contents(files, atoms, "weights")
    assert [(a.param, a.kind) for a in weights.atoms] == [
        ("w", A.WEIGHT), ("rope", A.BUFFER), ("z3", A.WEIGHT), ("z3", A.MASTER),
    ]  # fmt: skip
    assert [(a.param, a.kind) for a in weights.materialize] == [("w", A.WEIGHT)]
    assert all(a.derived is None for a in weights.stored_atoms())
    assert {"wweight", "z3master", f"skeleton-{OPTIM}", f"container-{STATES}"} <= weights.hashes()
    assert "wmaster" not in weights.hashes() and "wexp_avg" not in weights.hashes()


# -- real runs -----------------------------------------------------------------------------


def export(store: Repository, ref: str, out: Path, dtype: str) -> bytes:
    """Through the API: the CLI's export is tested in test_export, here only the bytes matter."""
    with tailorstore.Store.open(store.root) as api:
        api.export(ref, out, dtype=dtype)
    return (out / "model.safetensors").read_bytes()


def kinds_of(store: Repository, step: int) -> set[str]:
    return {
        r[0]
        for r in index_db(store).execute(
            "SELECT DISTINCT a.kind FROM atoms a JOIN manifests m ON m.id=a.manifest"
            " WHERE m.step=? AND m.origin='commit'",
            (step,),
        )
    }


def test_thin_to_weights_keeps_every_step_exportable_and_the_last_resumable(runs: Runs, tmp_path: Path) -> None:
    store, save_dir = commit_saves(runs, "tailor-zero2", tmp_path, SAVES)
    before_export = {s: export(store, f"step={s}", tmp_path / f"exp{s}", "bf16") for s in (3, 12)}
    raw_before = sum(p.stat().st_size for p in store.root.rglob("*") if p.is_file())

    state = store_state(store.root)
    proc = tailor("gc", "--keep-last", "2", "--thin", "weights", "--dry-run", "--json", store=store.root)
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout)
    assert plan["thin"] == [[m, s, "weights"] for m, s in zip([1, 2, 3, 4], [3, 6, 9, 12], strict=True)]
    assert plan["drop"] == []
    assert plan["freed_by_tier"]["weights"] > 0 and plan["thin_weight_bytes"] > 0
    assert store_state(store.root) == state, "a dry run changes nothing"

    saved = usage(store).raw_bytes
    proc = tailor("gc", "--keep-last", "2", "--thin", "weights", store=store.root)
    assert proc.returncode == 0, proc.stderr
    assert "thin 4 manifest(s) (steps 3, 6, 9, 12) to weights" in proc.stdout
    store = Repository.open(store.root)
    assert_only_live(store)
    after = usage(store)  # the ratio is against the saves, not against what thinning kept of them
    assert after.saved_bytes == saved > after.raw_bytes
    assert after.ratio == pytest.approx(saved / after.stored_bytes)
    for step in (3, 6, 9, 12):  # exactly the tier's atoms: the weights, stored now, nothing of the optimizer
        assert kinds_of(store, step) == {A.WEIGHT}
        assert (
            index_db(store)
            .execute(
                "SELECT count(*) FROM atoms a JOIN manifests m ON m.id=a.manifest"
                " WHERE m.step=? AND a.derived IS NOT NULL",
                (step,),
            )
            .fetchone()[0]
            == 0
        )
    assert {A.MASTER, A.EXP_AVG, A.EXP_AVG_SQ, A.WEIGHT} <= kinds_of(store, 15)
    after = sum(p.stat().st_size for p in store.root.rglob("*") if p.is_file())
    assert after < 0.6 * raw_before

    log = tailor("log", store=store.root).stdout
    assert log.count("thinned to weights") == 4
    assert (
        "thinned to weights (exports and averages; does not resume)"
        in tailor("show", "step=9", store=store.root).stdout
    )
    with tailorstore.Store.open(store.root) as api:
        assert api.verify(deep=True).ok
    for s, data in before_export.items():  # the weights both keep: bit for bit
        assert export(store, f"step={s}", tmp_path / f"again{s}", "bf16") == data

    proc = tailor("checkout", "step=9", "--out", str(tmp_path / "refused"), store=store.root)
    assert proc.returncode == 2 and "thinned to weights" in proc.stderr and "export" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and not (tmp_path / "refused").exists()
    with tailorstore.Store.open(store.root) as api:
        for name, write in (("universal", api.checkout_universal), ("resharded", api.checkout)):
            extra = {"world_size": 1} if name == "resharded" else {}
            with pytest.raises(tailorstore.ThinnedStepError, match="thinned to weights"):
                write(9, tmp_path / name, **extra)
            assert not (tmp_path / name).exists()
        api.checkout(18, tmp_path / "resumable")
    assert same_tree(tmp_path / "resumable", as_of_step(save_dir, 18, tmp_path / "orig18"))

    # a rebuilt index (another host) reads the tiers from the manifest objects
    assert tailorstore.Store.rebuild_index(store.root)
    with tailorstore.Store.open(store.root) as api:
        assert [s.step for s in api.log() if s.tier == "weights"] == [3, 6, 9, 12]
        with pytest.raises(tailorstore.ThinnedStepError):
            api.checkout(9, tmp_path / "x")
        # thinning again finds nothing to do
        again = api.gc(Retention(keep_last=2, thin="weights"))
        assert again.thin == [] and again.drop == []
    spec = tmp_path / "mix.yaml"
    spec.write_text(
        yaml.safe_dump({"base": {"step": 18}, "slices": [{"sources": [{"step": 9, "layer_range": [0, 2]}]}]})
    )
    proc = tailor("merge", str(spec), "--tag", "mix", store=store.root)
    assert proc.returncode == 2 and "thinned to weights" in proc.stderr

    # an average over thinned steps takes their bf16 weights, widened exactly
    spec = tmp_path / "avg.yaml"
    spec.write_text(yaml.safe_dump({"method": "sma", "steps": [9, 12, 15, 18]}))
    with tailorstore.Store.open(store.root) as api:
        api.merge(spec, tag="avg")
        api.checkout("tag=avg", tmp_path / "avg")
    expected: dict[str, torch.Tensor] = {}
    for step in (9, 12, 15, 18):
        if step in (9, 12):
            states = torch.load(save_dir / f"global_step{step}" / "mp_rank_00_model_states.pt", weights_only=False)
            values = {k: v.float() for k, v in states["module"].items()}
        else:
            values = get_fp32_state_dict_from_zero_checkpoint(str(save_dir), tag=f"global_step{step}")
        for name, tensor in values.items():
            expected[name] = expected.get(name, torch.zeros(tensor.shape, dtype=torch.float64)) + 0.25 * tensor.double()
    got = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path / "avg"))
    assert sorted(got) == sorted(expected)
    assert all(tensors_identical(got[k], v.float()) for k, v in expected.items())


@pytest.mark.parametrize(("name", "tier"), [("tailor-zero2", "master"), ("tailor-zero3", "weights")])
def test_thin_keeps_the_fp32_master_where_it_is_the_only_copy(runs: Runs, tmp_path: Path, name: str, tier: str) -> None:
    """`master` keeps the FP32 master (and the weights derived from it); ZeRO 3 saves hold no weights
    in their model states, so `weights` keeps their masters. Either way fp32 export is unchanged."""
    store, _ = commit_saves(runs, name, tmp_path, SAVES)
    before = export(store, "step=6", tmp_path / "before", "fp32")
    # the run carries the retention; `tailor gc` without rules applies it (keeps 9 and 18 whole)
    proc = tailor("run", "retention", "--keep-every", "9", "--thin", tier, store=store.root)
    assert proc.returncode == 0 and f"thin the rest to {tier}" in proc.stdout, proc.stderr
    assert tailorstore.Store.rebuild_index(store.root)  # the rules are in the store, not the cache
    assert f"thin the rest to {tier}" in tailor("run", "retention", store=store.root).stdout
    proc = tailor("gc", store=store.root)
    assert proc.returncode == 0, proc.stderr
    store = Repository.open(store.root)
    assert_only_live(store)
    thinned = [r[0] for r in index_db(store).execute("SELECT step FROM manifests WHERE tier=? ORDER BY step", (tier,))]
    assert thinned == [3, 6, 12, 15]
    assert kinds_of(store, 6) & {A.EXP_AVG, A.EXP_AVG_SQ} == set() and A.MASTER in kinds_of(store, 6)
    with tailorstore.Store.open(store.root) as api:
        assert api.verify(deep=True).ok
        with pytest.raises(tailorstore.ThinnedStepError):
            api.checkout(6, tmp_path / "x")
    assert export(store, "step=6", tmp_path / "after", "fp32") == before


def test_gc_dropping_the_source_of_a_kept_composite(runs: Runs, tmp_path: Path) -> None:
    """Parity composites inherit layers from the steps before them; gc drops those steps. The next
    tailored commit, an index rebuild (a new host) and checkout all still work."""
    store, save_dir = commit_saves(runs, "tailor-zero2", tmp_path, SAVES, PolicySpec("parity"))
    store.close()
    assert tailor("rm", "step=18", store=store.root).returncode == 0
    assert tailor("gc", "--keep-last", "1", store=store.root).returncode == 0  # keeps 15, which inherits from 12
    proc = tailor("commit", str(as_of_step(save_dir, 18, tmp_path / "again18")), "--policy", "parity", store=store.root)
    assert proc.returncode == 0, proc.stderr
    assert tailor("index", "rebuild", store=store.root).returncode == 0
    for step in (15, 18):
        out = tmp_path / f"out{step}"
        proc = tailor("checkout", f"step={step}", "--out", str(out), store=store.root)
        assert proc.returncode == 0, proc.stderr
    assert tailor("verify", "--deep", store=store.root).returncode == 0


def test_gc_deletes_superseded_versions_of_a_manifest_object(tmp_path: Path) -> None:
    """A thinning (or `--force`) killed after it put a step's new version leaves the old one behind;
    readers take the newest, and gc deletes the old."""
    checkpoint = TEST_DATA / "format1" / "checkpoint"
    store = tmp_path / "store"
    assert tailor("init", str(store)).returncode == 0
    assert tailor("commit", str(checkpoint), store=store).returncode == 0
    (current,) = (store / "manifests" / "main").iterdir()
    assert current.name.endswith("-v1.json.zst")
    stale = current.with_name(current.name.replace("-v1.", "-v0."))
    stale.write_bytes(current.read_bytes())
    plan = json.loads(tailor("gc", "--dry-run", "--json", store=store).stdout)
    assert plan["superseded"] == [f"manifests/main/{stale.name}"] and stale.exists()
    proc = tailor("gc", store=store)
    assert proc.returncode == 0 and "1 superseded manifest object" in proc.stdout
    assert not stale.exists() and current.exists()
    assert "exact" in tailor("log", store=store).stdout


def test_a_gc_killed_while_it_thins_leaves_every_step_whole_or_thinned(runs: Runs, tmp_path: Path) -> None:
    """SIGKILL `tailor gc --keep-last 2 --thin weights` at random moments: each step is whole or
    thinned (never half), the store verifies deep, what a step keeps exports unchanged, the kept
    steps check out byte for byte, and a gc run to the end then leaves exactly the live blobs."""
    store, save_dir = commit_saves(runs, "tailor-zero2", tmp_path, SAVES)
    store.close()
    with tailorstore.Store.open(store.root) as api:
        api.export(6, tmp_path / "before6")
    reference = {6: (tmp_path / "before6" / "model.safetensors").read_bytes()}
    original18 = as_of_step(save_dir, 18, tmp_path / "orig18")
    rng = random.Random(20261123)
    clock: KillClock | None = None
    landed = 0
    for attempt in range(4):
        root = shutil.copytree(store.root, tmp_path / f"try{attempt}")
        began = time.perf_counter()
        proc = subprocess.Popen(
            ["tailor", "gc", "--keep-last", "2", "--thin", "weights"],
            env={**os.environ, "TAILOR_STORE": str(root)},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        if clock is None:  # the first run goes to the end: it measures the span
            assert proc.wait(timeout=300) == 0
            clock = KillClock(time.perf_counter() - began, rng, 0.3, 1.0)
        else:
            landed += clock.kill(proc, began)
        with tailorstore.Store.open(root) as api:
            assert api.verify(deep=True).ok
            tiers = {s.step: s.tier for s in api.log()}
            assert tiers[15] is None and tiers[18] is None and {tiers[s] for s in (3, 6, 9, 12)} <= {None, "weights"}
            for s, data in reference.items():
                api.export(s, tmp_path / f"x{attempt}-{s}")
                assert (tmp_path / f"x{attempt}-{s}" / "model.safetensors").read_bytes() == data
            api.checkout(18, tmp_path / f"co{attempt}")
            assert same_tree(tmp_path / f"co{attempt}", original18)
            api.gc(Retention(keep_last=2, thin="weights"))
            assert {s.step: s.tier for s in api.log()} == {
                3: "weights",
                6: "weights",
                9: "weights",
                12: "weights",
                15: None,
                18: None,
            }
        with Repository.open(root) as repo:
            assert_only_live(repo)
    assert landed >= 2, landed


def test_background_commits_beside_a_thinning_gc_lose_nothing(runs: Runs, tmp_path: Path) -> None:
    """What found a data-loss race (FORMAT.md 3.3): a training process commits every save in the
    background (each commit opens the store anew, without the lock) while `tailor gc` thins and
    repacks beside it in its own processes, again and again, and a reader opens the store in a loop.
    Afterwards every step is whole or thinned, `verify --deep` passes, and nothing but live objects
    is left. The race needs an open to fall within a few statements of a repack: on the code before
    the fix this test failed 1 run in 11 (the deterministic tests in test_packs.py fail every time)."""
    save = runs.get("ten-saves").save_dir
    root = tmp_path / "store"
    steps = [as_of_step(save, s, tmp_path / f"at{s}") for s in range(1, 11)]
    stop = threading.Event()
    collected: list[subprocess.CompletedProcess[str]] = []
    opened = 0

    def collector() -> None:
        while not stop.is_set():
            collected.append(tailor("gc", "--json", store=root))

    def reader() -> None:  # a user's `tailor log` meanwhile: each open syncs without the lock
        nonlocal opened
        while not stop.is_set():
            with Repository.open(root):
                opened += 1

    with tailorstore.Store.init(root) as store:
        store.set_retention(Retention(keep_last=2, thin="weights"))
        beside = [threading.Thread(target=collector), threading.Thread(target=reader)]
        for t in beside:
            t.start()
        try:
            rounds = 0
            while rounds < 2 or (len(collected) < 3 and rounds < 8):  # until gc has run beside the commits
                for i, path in enumerate(steps):
                    store.commit_async(path, step=100 * rounds + i + 1)
                store.flush()
                rounds += 1
        finally:
            stop.set()
            for t in beside:
                t.join()
    assert all(p.returncode == 0 for p in collected), [p.stderr for p in collected if p.returncode][:1]
    assert len(collected) >= 3 and opened >= 10, "gc and readers ran beside the commits"
    assert tailor("gc", store=root).returncode == 0
    with Repository.open(root) as repo:
        tiers = {m.step: m.tier for m in repo.view(Catalogue).manifests()}
        assert len(tiers) == 10 * rounds and list(tiers.values()).count(None) == 2
        report = verify(repo, deep=True)
        assert report.ok, report.problems[:3]
        assert_only_live(repo)
