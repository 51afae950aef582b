"""`tailor checkout --format universal`: DeepSpeed's universal checkpoint written from the store,
checked tensor for tensor against `ds_to_universal --inject_missing_state` on the same real saves.
tests/system/test_reshard.py loads it with DeepSpeed's `load_universal` at another world size."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import tailorstore
from tailorstore.store.index.catalogue import Catalogue
from tests.conftest import HFRun, Runs, as_of_step, commit_and_reset_reads, edit_atoms, tailor


def ds_to_universal(tag_dir: Path, out: Path) -> Path:
    """DeepSpeed's own conversion of one tag folder into ``out/<tag>`` (plus ``out/latest_universal``)."""
    subprocess.run(
        [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(tag_dir),
         "--output_folder", str(out / tag_dir.name), "--inject_missing_state"],
        check=True, capture_output=True, timeout=600, env={**os.environ, "DS_ACCELERATOR": "cpu"},
    )  # fmt: skip
    return out


def same(x: Any, y: Any) -> bool:
    """Equal trees: tensors bit for bit (dtype and shape too), objects by their attributes."""
    if isinstance(x, torch.Tensor):
        return isinstance(y, torch.Tensor) and x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)
    if isinstance(x, dict):
        return isinstance(y, dict) and set(x) == set(y) and all(same(x[k], y[k]) for k in x)
    if isinstance(x, list | tuple):
        return type(x) is type(y) and len(x) == len(y) and all(same(a, b) for a, b in zip(x, y, strict=True))
    if hasattr(x, "__dict__") and not isinstance(x, type):
        return type(x).__name__ == type(y).__name__ and same(vars(x), vars(y))
    return x == y


def assert_same_universal(ours: Path, theirs: Path, tag: str) -> None:
    mine = sorted(p.relative_to(ours) for p in (ours / tag / "zero").rglob("*.pt"))
    ref = sorted(p.relative_to(theirs) for p in (theirs / tag / "zero").rglob("*.pt"))
    assert mine == ref, set(mine) ^ set(ref)
    for rel in ref:
        a, b = torch.load(ours / rel, weights_only=False), torch.load(theirs / rel, weights_only=False)
        assert same(a, b), rel
    assert (ours / "latest_universal").read_text() == (theirs / "latest_universal").read_text() == tag
    for states in (theirs / tag).glob("*model_states.pt"):
        assert (ours / tag / states.name).read_bytes() == states.read_bytes(), states.name


@pytest.mark.parametrize(
    "run", ["zero2-fp32", "zero2-bf16-odd-two-groups", "zero3-bf16-odd-per-layer", "zero3-bf16-tied"]
)
def test_universal_equals_ds_to_universal(runs: Runs, tmp_path: Path, run: str) -> None:
    save = runs.get(run).save_dir
    with tailorstore.Store.init(tmp_path / "store") as store:
        store.commit(as_of_step(save, 3, tmp_path / "at3"))
        result = store.checkout_universal(3, tmp_path / "ours")
    assert result.tag == "global_step3" and result.params > 0
    theirs = ds_to_universal(save / "global_step3", tmp_path / "theirs")
    assert_same_universal(tmp_path / "ours", theirs, "global_step3")


def test_hf_trainer_checkpoint(hf_run: HFRun, tmp_path: Path, blob_reads: dict[str, int]) -> None:
    """An HF Trainer checkpoint-N: the universal folder sits beside the Trainer's own files. The
    weights of its model.safetensors, like the model states', are rounded from the masters fp32.pt
    streams: each master is read once."""
    reads = blob_reads  # conftest: each blob's stream count
    checkpoint = hf_run.output_dir / "checkpoint-6"
    with tailorstore.Store.init(tmp_path / "store") as store:
        masters, derived = commit_and_reset_reads(store, checkpoint, reads)
        store.checkout_universal("latest", tmp_path / "ours")
    assert "model.safetensors" in derived and masters <= set(reads)
    assert {h: n for h, n in reads.items() if h in masters and n != 1} == {}
    ours = tmp_path / "ours"
    for name in ("config.json", "trainer_state.json", "model.safetensors"):
        assert (ours / name).read_bytes() == (checkpoint / name).read_bytes(), name
    theirs = ds_to_universal(checkpoint / "global_step6", tmp_path / "theirs")
    assert_same_universal(ours, theirs, "global_step6")


def test_what_cannot_be_written_is_refused_before_writing(runs: Runs, tmp_path: Path) -> None:
    store = tmp_path / "store"
    with tailorstore.Store.init(store) as st:
        st.commit(as_of_step(runs.get("zero0-bf16").save_dir, 3, tmp_path / "z0"))
    cases = [
        (store, ["--format", "universal"], "ZeRO-0"),
        (store, ["--format", "sideways"], "--format sideways"),
    ]
    for where, extra, says in cases:
        out = tmp_path / "out"
        proc = tailor("checkout", "step=3", "--out", str(out), *extra, store=where)
        assert proc.returncode == 2 and says in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
        assert not out.exists() and not list(tmp_path.glob(".out.tailor-partial-*"))


def test_a_step_missing_one_of_its_adam_moments_is_refused_as_damaged(runs: Runs, tmp_path: Path) -> None:
    """A step with no moments at all was saved before the first optimizer step and converts; one
    that holds exp_avg but no exp_avg_sq for a parameter is a damaged index: exit 3, nothing written."""
    store = tmp_path / "store"
    with tailorstore.Store.init(store) as st:
        st.commit(as_of_step(runs.get("zero2-bf16").save_dir, 3, tmp_path / "at3"))
        param = st.repo.view(Catalogue).atoms(1, kind="exp_avg_sq")[0].param
        assert edit_atoms(st.repo, lambda _, a: None if (a.param, a.kind) == (param, "exp_avg_sq") else a)
    out = tmp_path / "out"
    proc = tailor("checkout", "step=3", "--format", "universal", "--out", str(out), store=store)
    assert proc.returncode == 3 and param in proc.stderr and "Adam moment" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert not out.exists() and not list(tmp_path.glob(".out.tailor-partial-*"))


def test_each_master_is_read_once_and_feeds_the_model_states_weights(
    runs: Runs, tmp_path: Path, blob_reads: dict[str, int]
) -> None:
    """A bf16 save's module weights are rounded from the master chunks fp32.pt streams, not rebuilt
    by reading and decoding every master a second time; the model-states file is still the saved
    one byte for byte (assert_same_universal)."""
    reads = blob_reads  # conftest: each blob's stream count
    save = runs.get("zero2-bf16-odd-two-groups").save_dir
    with tailorstore.Store.init(tmp_path / "store") as store:
        masters, derived = commit_and_reset_reads(store, as_of_step(save, 3, tmp_path / "at3"), reads)
        store.checkout_universal(3, tmp_path / "ours")
    assert derived and masters <= set(reads), "the save has derived weights and every master was read"
    assert {h: n for h, n in reads.items() if h in masters and n != 1} == {}
    theirs = ds_to_universal(save / "global_step3", tmp_path / "theirs")
    assert_same_universal(tmp_path / "ours", theirs, "global_step3")
