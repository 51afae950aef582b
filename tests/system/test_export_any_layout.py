"""`tailor export` of every layout the store holds layer-wise, not only DeepSpeed's: an HF Trainer
checkpoint without DeepSpeed (``model.safetensors``), whole and thinned by gc to its weights (what
checkout sends a user to export), and a plain ``torch.save`` training state. Each is made here by
real training, exported through the command and loaded by transformers' ``from_pretrained``."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tailorstore.core.sizes import human
from tests.conftest import HFRun, copy_tree, one_line, tailor
from tests.system.test_plain_saves import tiny_llama, train_steps

pytestmark = pytest.mark.slow


def loaded(folder: Path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    return model.state_dict()


def test_a_thinned_hf_trainer_step_without_deepspeed_exports(tmp_path: Path) -> None:
    """Checkout refuses a step thinned to weights and names export; export then writes the folder
    from the stored weights, which from_pretrained loads equal to the Trainer's own save."""
    from transformers import Trainer, TrainingArguments

    from testbed.train_hf import RampTokens

    args = TrainingArguments(
        output_dir=str(tmp_path / "run"), max_steps=4, save_steps=2, per_device_train_batch_size=2,
        report_to=[], use_cpu=True, logging_steps=1, disable_tqdm=True,
    )  # fmt: skip
    Trainer(model=tiny_llama(2), args=args, train_dataset=RampTokens(8, 16, 128)).train()
    store = tmp_path / "store"
    assert tailor("init", str(store)).returncode == 0
    for step in (2, 4):
        done = tailor("commit", str(tmp_path / "run" / f"checkpoint-{step}"), "-q", store=store)
        assert done.returncode == 0, done.stderr
    assert tailor("gc", "--keep-last", "1", "--thin", "weights", store=store).returncode == 0
    one_line(tailor("checkout", "step=2", "--out", str(tmp_path / "co"), store=store), 2, "tailor export")
    # log and ls say what the thinned step holds, not what it was saved as (its moments are gone)
    thinned, whole = json.loads(tailor("log", "--json", store=store).stdout)
    moments = sum(v.numel() * v.element_size() for v in torch.load(
        tmp_path / "run" / "checkpoint-2" / "optimizer.pt", weights_only=True)["state"][0].values())  # fmt: skip
    assert thinned["held_bytes"] < thinned["raw_bytes"] - moments and whole["held_bytes"] == whole["raw_bytes"]
    row = tailor("log", store=store).stdout.splitlines()[1]
    assert "thinned to weights (saved as" in row and row.split()[6:8] == human(thinned["held_bytes"]).split(), row
    listed = json.loads(tailor("ls", "step=2", "--json", store=store).stdout)["files"]
    assert sum(f["held"] for f in listed) == thinned["held_bytes"]
    for step in (2, 4):  # thinned, and whole
        out = tmp_path / f"model{step}"
        done = tailor("export", f"step={step}", "--out", str(out), "--dtype", "fp32", store=store)
        assert done.returncode == 0, done.stderr
        assert {"model.safetensors", "config.json"} <= {p.name for p in out.iterdir()}
        saved = load_file(tmp_path / "run" / f"checkpoint-{step}" / "model.safetensors")
        state = loaded(out)
        assert set(saved) <= set(state)
        for name, tensor in saved.items():
            assert torch.equal(state[name], tensor), name


def test_a_plain_torch_save_exports_with_a_config(tmp_path: Path) -> None:
    """A training state as the PyTorch guides save it ({model, optimizer, step}): export writes
    the model's parameters (the optimizer's moments and the step counter stay out)."""
    model = tiny_llama(2)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    train_steps(model, optim, 1, 2)
    save = tmp_path / "save"
    save.mkdir()
    torch.save({"model": model.state_dict(), "optimizer": optim.state_dict(), "step": 2}, save / "state.pt")
    model.config.save_pretrained(tmp_path / "config")
    store = tmp_path / "store"
    assert tailor("init", str(store)).returncode == 0
    assert tailor("commit", str(save), "--step", "2", "-q", store=store).returncode == 0
    out = tmp_path / "model"
    done = tailor(
        "export", "step=2", "--out", str(out), "--dtype", "fp32", "--config", str(tmp_path / "config" / "config.json"),
        store=store,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert not any("exp_avg" in k or "state" in k for k in load_file(out / "model.safetensors"))
    state = loaded(out)
    for name, tensor in model.state_dict().items():
        assert torch.equal(state[name], tensor), name


def test_a_thinned_hf_deepspeed_step_exports(hf_run: HFRun, tmp_path: Path) -> None:
    """The HF Trainer under DeepSpeed (the hf_run fixture): its step thinned to weights exports the
    bf16 weights it holds, as the Trainer's own model.safetensors has them."""
    work = tmp_path / "work"
    store = tmp_path / "store"
    assert tailor("init", str(store)).returncode == 0
    for step in (3, 6):
        checkpoint = copy_tree(hf_run.output_dir / f"checkpoint-{step}", work / f"checkpoint-{step}")
        assert tailor("commit", str(checkpoint), "-q", store=store).returncode == 0
        shutil.rmtree(checkpoint)
    assert tailor("gc", "--keep-last", "1", "--thin", "weights", store=store).returncode == 0
    out = tmp_path / "model"
    done = tailor("export", "step=3", "--out", str(out), "--dtype", "bf16", store=store)
    assert done.returncode == 0, done.stderr
    saved = load_file(hf_run.output_dir / "checkpoint-3" / "model.safetensors")
    state = loaded(out)
    for name, tensor in saved.items():
        assert torch.equal(state[name], tensor.to(torch.float32)), name
