"""Plain saves, stored layer-wise and checked out byte for byte: a single ``torch.save``
training state (model, optimizer, step) as the checkpoint guides write it, a sharded
``model.safetensors`` folder as ``save_pretrained`` writes it, and the HF Trainer's own
``checkpoint-N`` without DeepSpeed (``model.safetensors``, ``optimizer.pt``, ``scheduler.pt``,
``rng_state.pth``), each made here by real training."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch

from tailorstore import Store
from tailorstore.core.layers import layer_of
from tailorstore.store.index.catalogue import Catalogue
from testbed.compare import same_tree

pytestmark = pytest.mark.slow


def tiny_llama(layers: int = 4):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64, tie_word_embeddings=False,
    )  # fmt: skip
    return LlamaForCausalLM(config)


def train_steps(model, optim, first: int, last: int) -> None:
    for step in range(first, last + 1):
        gen = torch.Generator().manual_seed(step)
        ids = torch.randint(0, 128, (2, 16), generator=gen)
        model(input_ids=ids, labels=ids).loss.backward()
        optim.step()
        optim.zero_grad()


def atoms_by_kind(store: Store, ref: str) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for atom in store.repo.view(Catalogue).atoms(store.show(ref).summary.manifest):
        out.setdefault(atom.kind, set()).add(atom.param)
    return out


def test_a_torch_save_training_state_is_layer_wise_and_exact(tmp_path: Path) -> None:
    model = tiny_llama()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    saves = tmp_path / "saves"
    saves.mkdir()
    for step in (2, 4):
        train_steps(model, optim, step - 1, step)
        torch.save(
            {"model": model.state_dict(), "optimizer": optim.state_dict(), "step": step}, saves / f"ckpt_{step}.pt"
        )
    with Store.init(tmp_path / "store") as store:
        first = store.commit(saves / "ckpt_2.pt")
        assert first.step == 2
        names = set(model.state_dict())
        kinds = atoms_by_kind(store, "step=2")
        assert kinds["master"] == names  # FP32 parameters, each under its own name
        assert kinds["exp_avg"] == names and kinds["exp_avg_sq"] == names  # optimizer indices named
        layers = {x.layer for x in store.show("step=2").layers}
        assert {f"block.{i}" for i in range(4)} | {"embedding", "lm_head", "final_norm"} <= layers
        store.commit(saves / "ckpt_4.pt", policy="parity")
        inherited = {x.layer for x in store.show("step=4").layers if x.source_step == 2}
        assert inherited
        store.checkout("step=2", tmp_path / "out2")
        assert (tmp_path / "out2" / "ckpt_2.pt").read_bytes() == (saves / "ckpt_2.pt").read_bytes()
        store.checkout("step=4", tmp_path / "out4")  # a composite: torch loads it (CRCs mended)
    at2 = torch.load(saves / "ckpt_2.pt", weights_only=True)
    at4 = torch.load(saves / "ckpt_4.pt", weights_only=True)
    composite = torch.load(tmp_path / "out4" / "ckpt_4.pt", weights_only=True)
    assert composite["step"] == 4
    for name, tensor in composite["model"].items():
        source = at2 if layer_of(name) in inherited else at4
        assert torch.equal(tensor, source["model"][name]), name


def test_a_sharded_safetensors_folder_is_layer_wise_and_exact(tmp_path: Path) -> None:
    model = tiny_llama()
    folder = tmp_path / "step-7"
    model.save_pretrained(folder, max_shard_size="200KB")
    assert len(list(folder.glob("model-*.safetensors"))) > 1
    with Store.init(tmp_path / "store") as store:
        assert store.commit(folder).step == 7
        layers = {x.layer for x in store.show("latest").layers}
        assert {f"block.{i}" for i in range(4)} <= layers
        store.checkout("latest", tmp_path / "out")
    assert same_tree(tmp_path / "out" / "step-7", folder)


def test_the_hf_trainer_checkpoint_without_deepspeed_is_exact(tmp_path: Path) -> None:
    from transformers import Trainer, TrainingArguments

    from testbed.train_hf import RampTokens

    model = tiny_llama(2)
    args = TrainingArguments(
        output_dir=str(tmp_path / "run"), max_steps=2, save_steps=2, per_device_train_batch_size=2,
        report_to=[], use_cpu=True, logging_steps=1, disable_tqdm=True,
    )  # fmt: skip
    Trainer(model=model, args=args, train_dataset=RampTokens(8, 16, 128)).train()
    checkpoint = tmp_path / "run" / "checkpoint-2"
    present = {p.name for p in checkpoint.iterdir()}
    assert {"model.safetensors", "optimizer.pt", "scheduler.pt", "trainer_state.json"} <= present
    with Store.init(tmp_path / "store") as store:
        store.commit(checkpoint)
        kinds = atoms_by_kind(store, "latest")
        assert "exp_avg" in kinds  # optimizer.pt cut into atoms, not kept whole
        store.checkout("latest", tmp_path / "out")
    assert same_tree(tmp_path / "out", checkpoint) or same_tree(tmp_path / "out" / "checkpoint-2", checkpoint)
    buffer = io.BytesIO((checkpoint / "optimizer.pt").read_bytes())
    assert torch.load(buffer, weights_only=True)["state"]
