"""Rank-parallel commit on 2 real ranks (torchrun, gloo): each rank writes its own files' blobs,
rank 0 finalizes one manifest, and the result equals a single-process commit of the same save:
the same file and atom rows (derived bf16 weights included, though their masters are spread
over both ranks' files), the same blobs, every blob written once."""

from __future__ import annotations

import json
from dataclasses import astuple
from pathlib import Path

from conftest import Runs, as_of_step

from tailorstore import Store
from tailorstore.ingest.rank_share import Survey, checked_weights, owner_of, writers
from testbed.compare import same_tree
from testbed.runs import torchrun


def _rows(store: Store) -> tuple[list, list, set[str]]:
    (manifest,) = [m.manifest for m in store.log()]
    index = store.repo.catalogue
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
    torchrun("testbed.rank_commit", [str(tmp_path / "parallel"), str(save), str(out)])
    results = [json.loads(Path(f"{out}.rank{r}").read_text()) for r in (0, 1)]
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
    assert checked_weights([a, b]) == frozenset({("m", "w")}), "v has a range that differs"
    gap = Survey(1, [], set(), {("m", "w"): [(5, 5, True)]}, {})
    assert checked_weights([a, gap]) == frozenset(), "a range no rank covered is not derived"
