"""Averaging merges (`method: sma | ema | wma`) on real DeepSpeed runs, checked exactly against
a plain torch average of the original files (DeepSpeed's own zero_to_fp32 reads them). The rules
without a training are tests/unit/curate/test_averaging.py."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import yaml
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

from tailorstore.core import atom_types as A
from tailorstore.core.layers import layer_of
from tailorstore.formats.layout import detect
from tailorstore.formats.reader import read_checkpoint
from tailorstore.formats.tensors import dtype_from_name
from tailorstore.store.repo import Repository
from testbed.compare import tensors_identical
from testbed.runs import train_tiny
from tests.conftest import TAILOR_EVERY, TAILOR_STEPS, Runs, as_of_step, commit_saves, tailor

SAVES = list(range(TAILOR_EVERY, TAILOR_STEPS + 1, TAILOR_EVERY))  # 3, 6, ..., 18
AVERAGED = SAVES[-4:]  # 9, 12, 15, 18


def merge(store: Repository, work: Path, name: str, **document: object) -> dict:
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(document))
    proc = tailor("merge", str(path), "--tag", name, "--json", store=store.root)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def checked_out(store: Repository, tag: str, out: Path) -> Path:
    proc = tailor("checkout", f"tag={tag}", "--out", str(out), store=store.root)
    assert proc.returncode == 0, proc.stderr
    return out


def torch_average(save_dir: Path, steps: list[int], weights: list[float]) -> dict[str, torch.Tensor]:
    """The plain torch average of the original saves' FP32 weights: float64 sum, oldest first."""
    total: dict[str, torch.Tensor] = {}
    for step, c in zip(steps, weights, strict=True):
        state = get_fp32_state_dict_from_zero_checkpoint(str(save_dir), tag=f"global_step{step}")
        for name, tensor in state.items():
            total[name] = total.get(name, torch.zeros(tensor.shape, dtype=torch.float64)) + c * tensor.double()
    return {name: t.float() for name, t in total.items()}


def pieces(ckpt: Path, kind: str) -> dict[tuple[str, str, int, int], torch.Tensor]:
    """(file key, param, rank, start) -> that piece of ``kind``, read straight from the files."""
    out = {}
    for f in read_checkpoint(detect(ckpt)):
        with f.open() as src:
            for entry in f.entries:
                for seg in entry.segments:
                    if seg.kind == kind and seg.numel:
                        data = bytearray(f.piece(src, entry, seg))
                        dtype = dtype_from_name(entry.dtype_name)
                        out[(f.file_key, seg.param, seg.rank, seg.start)] = torch.frombuffer(data, dtype=dtype)
    return out


def module_weights(ckpt: Path) -> dict[str, torch.Tensor]:
    state = torch.load(next(ckpt.glob("global_step*/mp_rank_00_model_states.pt")), weights_only=False)
    return state["module"]


@pytest.mark.parametrize("name", ["tailor-zero2", "tailor-zero3"])
def test_sma_equals_a_torch_average_of_the_original_files(runs: Runs, tmp_path: Path, name: str) -> None:
    store, save_dir = commit_saves(runs, name, tmp_path, SAVES)
    result = merge(store, tmp_path, "sma", method="sma", steps={"from": 9, "to": 18, "every": 3})
    assert result["coefficients"] == {str(s): 0.25 for s in AVERAGED}
    assert result["step"] == 18 and result["new_bytes"] > 0
    out = checked_out(store, "sma", tmp_path / "out")
    expected = torch_average(save_dir, AVERAGED, [0.25] * 4)
    got = get_fp32_state_dict_from_zero_checkpoint(str(out))
    assert sorted(got) == sorted(expected)
    for param, tensor in expected.items():
        assert tensors_identical(got[param], tensor), param
    # not a plain copy of one step: every master moved between the steps averaged
    last = get_fp32_state_dict_from_zero_checkpoint(str(save_dir), tag="global_step18")
    assert all(not torch.equal(got[p], last[p]) for p in got)
    if name == "tailor-zero2":  # ZeRO 3 keeps no weights in its model states
        for param, weight in module_weights(out).items():
            assert tensors_identical(weight, expected[param].to(weight.dtype)), param
    # the moments and step counters are the base's (step 18), untouched
    base = as_of_step(save_dir, 18, tmp_path / "base")
    for kind in (A.EXP_AVG, A.EXP_AVG_SQ, A.STEP):
        theirs, ours = pieces(base, kind), pieces(out, kind)
        assert theirs.keys() == ours.keys() and theirs
        assert all(tensors_identical(ours[k], theirs[k]) for k in theirs)
    assert tailor("verify", "--deep", store=store.root).returncode == 0


def test_ema_of_some_layers_and_kinds_then_resume(runs: Runs, tmp_path: Path) -> None:
    """EMA over blocks 0-1 and the lm_head, masters and first moments: the named layers are
    averaged, everything else is the base's; DeepSpeed loads exactly the averaged state and trains on."""
    store, save_dir = commit_saves(runs, "tailor-zero2", tmp_path, SAVES)
    alpha = 0.4
    result = merge(
        store, tmp_path, "ema", method="ema", alpha=alpha, steps=AVERAGED, base={"step": 15},
        layers=[{"layer_range": [0, 2]}, "lm_head"], kinds=["master", "exp_avg"],
    )  # fmt: skip
    weights = [(1 - alpha) ** 3, alpha * (1 - alpha) ** 2, alpha * (1 - alpha), alpha]
    assert list(result["coefficients"].values()) == weights
    assert result["layers"] == ["block.0", "block.1", "lm_head"] and result["step"] == 15
    named = set(result["layers"])
    out = checked_out(store, "ema", tmp_path / "out")
    base = as_of_step(save_dir, 15, tmp_path / "base")
    originals = {s: as_of_step(save_dir, s, tmp_path / f"orig{s}") for s in AVERAGED}
    for kind in (A.MASTER, A.EXP_AVG, A.EXP_AVG_SQ):
        ours, theirs = pieces(out, kind), pieces(base, kind)
        sources = {s: pieces(originals[s], kind) for s in AVERAGED}
        assert ours.keys() == theirs.keys()
        averaged = 0
        for key, tensor in ours.items():
            if layer_of(key[1]) in named and kind != A.EXP_AVG_SQ:
                total = torch.zeros(tensor.shape, dtype=torch.float64)
                for s, c in zip(AVERAGED, weights, strict=True):
                    total = total + c * sources[s][key].double()
                assert tensors_identical(tensor, total.float()), key
                averaged += 1
            else:
                assert tensors_identical(tensor, theirs[key]), key
        assert averaged > 0 or kind == A.EXP_AVG_SQ
    master = get_fp32_state_dict_from_zero_checkpoint(str(out))
    for param, weight in module_weights(out).items():
        assert tensors_identical(weight, master[param].to(weight.dtype)), param
    # DeepSpeed resumes from it: what it holds right after the load is the averaged state
    run = runs.get("tailor-zero2")
    losses = train_tiny(
        tmp_path / "resumed", losses_out=tmp_path / "resumed.json", resume_from=out, steps=17, save_every=0,
        save_on_load=str(tmp_path / "loaded"), **run.options,
    )  # fmt: skip
    assert sorted(losses) == [16, 17] and all(math.isfinite(float.fromhex(v)) for v in losses.values())
    loaded = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path / "loaded"), tag="loaded")
    assert sorted(loaded) == sorted(master)
    assert all(tensors_identical(loaded[p], master[p]) for p in master)


def test_averaging_refusals_leave_the_store_as_it_was(runs: Runs, tmp_path: Path) -> None:
    store, _ = commit_saves(runs, "tailor-zero2", tmp_path, SAVES)
    before = sorted(p.relative_to(store.root) for p in store.root.rglob("*") if p.is_file() and "index" not in p.name)
    for document, message in [
        ({"method": "sma", "steps": [9, 10]}, "step 10 is not in the store"),
        ({"method": "sma", "steps": [9, 12], "layers": [{"layer_range": [0, 9]}]}, "block 6 does not exist"),
        ({"method": "wma", "steps": [9, 12], "weights": [1, 2, 3]}, "2 numbers"),
    ]:
        path = tmp_path / "bad.yaml"
        path.write_text(yaml.safe_dump(document))
        proc = tailor("merge", str(path), "--tag", "bad", store=store.root)
        assert proc.returncode == 2, proc.stderr
        assert message in proc.stderr and "Traceback" not in proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1
    after = sorted(p.relative_to(store.root) for p in store.root.rglob("*") if p.is_file() and "index" not in p.name)
    assert after == before
    assert "bad" not in tailor("log", store=store.root).stdout
