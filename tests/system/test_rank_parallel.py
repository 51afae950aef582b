"""Rank-parallel commit on 2 real ranks (torchrun, gloo): each rank writes its own files' blobs,
rank 0 finalizes one manifest, and the result equals a single-process commit of the same save:
the same file and atom rows (derived bf16 weights included, though their masters are spread
over both ranks' files), the same blobs, every blob written once."""

from __future__ import annotations

import json
from dataclasses import astuple
from pathlib import Path

import pytest

from tailorstore import Store
from tailorstore.ingest.rank_share import Survey, checked_weights, owner_of, writers
from tailorstore.store.index.catalogue import Catalogue
from testbed.compare import same_tree
from testbed.runs import torchrun
from tests.conftest import Runs, as_of_step, manifest_rows


def _rows(store: Store) -> tuple[list, list, set[str]]:
    (manifest,) = [m.manifest for m in store.log()]
    index = store.repo.view(Catalogue)
    files = sorted(astuple(f) for f in index.files(manifest))
    atoms = sorted(astuple(a) for a in index.atoms(manifest))
    return files, atoms, index.blob_hashes()


def test_two_ranks_commit_what_one_process_commits(runs: Runs, tmp_path: Path) -> None:
    save = as_of_step(runs.get("zero2-bf16").save_dir, 6, tmp_path / "save")
    with Store.init(tmp_path / "single") as single:
        single.commit(save)
        files, atoms, blobs = _rows(single)
    Store.init(tmp_path / "parallel").close()
    out = tmp_path / "result.json"
    torchrun("testbed.rank_commit", [str(tmp_path / "parallel"), str(out), str(save)])
    results = [json.loads(Path(f"{out}.rank{r}").read_text())[0] for r in (0, 1)]
    assert results[0] == results[1], "every rank returns the same result"
    parts = results[0]["parts"]
    assert all(p is not None and p["files"] > 0 for p in parts), "both ranks wrote files"

    with Store.open(tmp_path / "parallel") as parallel:
        p_files, p_atoms, p_blobs = _rows(parallel)
        assert p_files == files
        assert p_atoms == atoms
        assert p_blobs == blobs
        assert sum(p["new_blobs"] for p in parts) == len(blobs), "a blob two ranks hold was written twice"
        derived = [a for a in p_atoms if a[13] is not None]
        assert derived and all(a[7] == "weight" for a in derived)
        assert parallel.verify(deep=True).ok
        parallel.checkout(6, tmp_path / "restored")
    assert same_tree(tmp_path / "restored", save)


def test_ownership_and_derivation_rules() -> None:
    assert owner_of("global_step6/bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt") == 1
    assert owner_of("global_step6/zero_pp_rank_2_mp_rank_00_model_states.pt") == 2
    assert owner_of("global_step6/mp_rank_00_model_states.pt") == 0
    assert owner_of("rng_state_1.pth") == 1 and owner_of("latest") == 0 and owner_of("model.safetensors") == 0
    a = Survey(0, [], {"x", "y"}, {("m", "w"): [(0, 4, True)], ("m", "v"): [(0, 2, True)]}, {("m", "w"): 10})
    b = Survey(1, [], {"y", "z"}, {("m", "w"): [(4, 6, True)], ("m", "v"): [(2, 2, False)]}, {("m", "v"): 4})
    assert writers([b, a]) == {0: frozenset(), 1: frozenset({"y"})}
    # under a plan: rank 0 holds y only in a layer the plan inherits, so rank 1 writes it itself
    a.new_layers, b.new_layers = {"x": {"L1"}, "y": {"L2"}}, {"y": {"L2", "L1"}, "z": {""}}
    assert writers([a, b], frozenset({"L1"})) == {0: frozenset(), 1: frozenset()}
    assert writers([a, b], frozenset({"L2"})) == {0: frozenset(), 1: frozenset({"y"})}
    assert checked_weights([a, b]) == frozenset({("m", "w")}), "v has a range that differs"
    gap = Survey(1, [], set(), {("m", "w"): [(5, 5, True)]}, {})
    assert checked_weights([a, gap]) == frozenset(), "a range no rank covered is not derived"


@pytest.mark.parametrize(
    ("policy", "params"),
    [
        ("parity", {}),
        ("filter", {"keep_first": 1, "keep_last": 1, "every": 2}),
        ("adaptive", {"threshold": 0.02}),
        ("budget", {"fraction": 0.4}),
    ],
)
def test_every_policy_commits_rank_parallel_what_one_process_commits(
    runs: Runs, tmp_path: Path, policy: str, params: dict[str, float]
) -> None:
    """The plan is decided once from both ranks' surveys (and their measured changes): each step's
    manifest (files, atoms, layers with their sources and changes, policy) equals a single-process
    commit of the same saves with the same policy, and the composite step checks out bit for bit."""
    run = runs.get("zero2-bf16")
    saves = [as_of_step(run.save_dir, step, tmp_path / f"at{step}") for step in (3, 6)]
    with Store.init(tmp_path / "single") as single:
        for save in saves:
            single.commit(save, policy=policy, **params)
        expected = {step: manifest_rows(single, step) for step in (3, 6)}
        new_bytes = {s.step: s.new_bytes for s in single.log()}
    Store.init(tmp_path / "parallel").close()
    args = [str(tmp_path / "parallel"), str(tmp_path / "out.json"), *map(str, saves), "--policy", policy]
    args += [f"--param={k}={v}" for k, v in params.items()]
    torchrun("testbed.rank_commit", args)
    with Store.open(tmp_path / "parallel") as parallel:
        for step in (3, 6):
            assert manifest_rows(parallel, step) == expected[step], step
        # a blob both ranks hold (the optimizer's step) is written and counted once
        assert {s.step: s.new_bytes for s in parallel.log()} == new_bytes
        assert not expected[6]["exact"] or policy == "adaptive", "the second step inherits something"
        assert parallel.verify(deep=True).ok
        parallel.checkout(6, tmp_path / "parallel-out")
    with Store.open(tmp_path / "single") as single:
        single.checkout(6, tmp_path / "single-out")
    assert same_tree(tmp_path / "parallel-out", tmp_path / "single-out"), "the same composite, byte for byte"
