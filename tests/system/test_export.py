"""`tailor export`: a consolidated model folder from the store, checked against DeepSpeed's own
zero_to_fp32 on real runs (ZeRO 2 and 3, bf16 and fp32, odd sizes, two param groups), loaded by
transformers' from_pretrained for an HF Trainer checkpoint, and refused cleanly when it cannot be
produced."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
from safetensors.torch import load_file

import tailorstore
from tailorstore.formats.safetensors_writer import TensorSpec, parse_size, plan_shards
from tailorstore.store.index.catalogue import Catalogue
from tests.conftest import HFRun, Runs, as_of_step, blob_object, tailor

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def exported(out: Path) -> dict[str, torch.Tensor]:
    """Every tensor of an exported folder, through safetensors' own reader (and the index when sharded)."""
    index = out / "model.safetensors.index.json"
    if not index.exists():
        return load_file(out / "model.safetensors")
    weight_map = json.loads(index.read_text())["weight_map"]
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(set(weight_map.values())):
        part = load_file(out / shard)
        assert {k for k, v in weight_map.items() if v == shard} == set(part)
        tensors.update(part)
    return tensors


def assert_equals_zero_to_fp32(save_dir: Path, tag: str, out: Path, dtype: str, tied: dict[str, str]) -> None:
    reference = get_fp32_state_dict_from_zero_checkpoint(str(save_dir), tag=tag)
    got = exported(out)
    # zero_to_fp32 lists a tied parameter under both names, as one tensor; export writes it once, as
    # save_pretrained does, under the name DeepSpeed registered
    for alias, name in tied.items():
        assert reference[alias] is reference[name] and alias not in got
        del reference[alias]
    assert set(got) == set(reference), set(got) ^ set(reference)
    for name, tensor in reference.items():
        expected = tensor.to(DTYPES[dtype])
        assert got[name].dtype == expected.dtype and got[name].shape == expected.shape, name
        assert torch.equal(got[name], expected), name


@pytest.mark.parametrize(
    ("run", "dtypes"),
    [
        ("zero2-bf16", ("fp32", "bf16")),
        ("zero2-fp32", ("fp32", "fp16")),
        ("zero3-bf16-odd-per-layer", ("fp32", "bf16")),
        ("zero2-bf16-odd-two-groups", ("bf16",)),
        ("zero3-bf16-tied", ("fp32",)),
    ],
)
def test_export_equals_zero_to_fp32(runs: Runs, tmp_path: Path, run: str, dtypes: tuple[str, ...]) -> None:
    save = runs.get(run).save_dir
    with tailorstore.Store.init(tmp_path / "store") as store:
        store.commit(as_of_step(save, 3, tmp_path / "at3"))
        store.commit(as_of_step(save, 6, tmp_path / "at6"))
        for dtype in dtypes:
            out = tmp_path / f"export-{dtype}"
            result = store.export(3, out, dtype=dtype)
            assert result.step == 3 and result.shards == ["model.safetensors"]
            assert result.tied == ({"lm_head.weight": "model.embed_tokens.weight"} if "tied" in run else {})
            assert_equals_zero_to_fp32(save, "global_step3", out, dtype, result.tied)
        # a sharded export holds the same tensors, every shard within the limit unless one tensor is bigger
        sharded = tmp_path / "sharded"
        result = store.export("latest", sharded, dtype="bf16", max_shard_size="20KB")
        assert len(result.shards) > 1 and (sharded / "model.safetensors.index.json").exists()
        for name in result.shards:
            part = load_file(sharded / name)
            assert len(part) == 1 or sum(t.numel() * t.element_size() for t in part.values()) <= 20_000
        assert_equals_zero_to_fp32(save, "global_step6", sharded, "bf16", result.tied)


def test_export_of_a_composite_uses_each_layer_from_its_step(runs: Runs, tmp_path: Path) -> None:
    """A parity commit inherits some layers: export takes those masters from the step they come from,
    so it equals zero_to_fp32 of a save assembled from the same steps, layer by layer."""
    save = runs.get("tailor-zero2").save_dir
    with tailorstore.Store.init(tmp_path / "store") as store:
        store.commit(as_of_step(save, 15, tmp_path / "at15"))
        result = store.commit(as_of_step(save, 18, tmp_path / "at18"), policy="parity")
        inherited = result.inherited_layers
        assert inherited, "parity must inherit some layers for this test to mean anything"
        store.export(18, tmp_path / "out", dtype="fp32")
    step15 = get_fp32_state_dict_from_zero_checkpoint(str(save), tag="global_step15")
    step18 = get_fp32_state_dict_from_zero_checkpoint(str(save), tag="global_step18")
    got = exported(tmp_path / "out")
    from tailorstore.core.layers import layer_of

    for name, tensor in got.items():
        expected = step15[name] if layer_of(name) in inherited else step18[name]
        assert torch.equal(tensor, expected), name


def test_hf_checkpoint_exports_a_folder_from_pretrained_loads(hf_run: HFRun, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    checkpoint = hf_run.output_dir / "checkpoint-6"
    with tailorstore.Store.init(tmp_path / "store") as store:
        store.commit(checkpoint)
        result = store.export("latest", tmp_path / "model", dtype="bf16")
    assert "config.json" in result.copied and "generation_config.json" in result.copied
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "model", torch_dtype=torch.bfloat16)
    reference = get_fp32_state_dict_from_zero_checkpoint(str(checkpoint))
    state = model.state_dict()
    assert set(reference) <= set(state)
    for name, tensor in reference.items():
        assert torch.equal(state[name], tensor.to(torch.bfloat16)), name
    # the Trainer's own bf16 weights are these masters rounded: the same bytes as its model.safetensors
    trainer_weights = load_file(checkpoint / "model.safetensors")
    assert all(torch.equal(trainer_weights[k], state[k]) for k in trainer_weights)


def test_a_plain_save_with_a_config_given_loads_in_from_pretrained(runs: Runs, tmp_path: Path) -> None:
    """A DeepSpeed save holds no config.json: `--config` adds the model's, byte for byte, and
    transformers then builds the model from the folder with every weight from the masters."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    save = runs.get("zero2-bf16").save_dir  # train_tiny's defaults: a Llama of these sizes, untied
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=172,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        tie_word_embeddings=False,
    )
    config.save_pretrained(tmp_path / "config")
    given = tmp_path / "config" / "config.json"
    store = tmp_path / "store"
    with tailorstore.Store.init(store) as st:
        st.commit(as_of_step(save, 6, tmp_path / "at6"))
    out = tmp_path / "model"
    proc = tailor("export", "step=6", "--out", str(out), "--dtype", "bf16", "--config", str(given), store=store)
    assert proc.returncode == 0 and "no config.json" not in proc.stderr, proc.stderr
    assert (out / "config.json").read_bytes() == given.read_bytes()
    model, info = AutoModelForCausalLM.from_pretrained(out, torch_dtype=torch.bfloat16, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    reference = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path / "at6"))
    state = model.state_dict()
    assert set(reference) == set(state)
    for name, tensor in reference.items():
        assert torch.equal(state[name], tensor.to(torch.bfloat16)), name


def test_refusals_write_nothing(runs: Runs, tmp_path: Path) -> None:
    save = runs.get("zero2-bf16").save_dir
    store = tmp_path / "store"
    with tailorstore.Store.init(store) as st:
        st.commit(as_of_step(save, 3, tmp_path / "at3"))
    out = tmp_path / "out"
    not_configs = {
        "passwd": b"root:x:0:0:root:/root:/bin/bash\n",
        "binary": bytes(range(256)),
        "list.json": b"[1, 2]",
        "untyped.json": json.dumps({"hidden_size": 64}).encode(),
    }
    for name, data in not_configs.items():
        (tmp_path / name).write_bytes(data)
    with open(tmp_path / "huge.json", "wb") as f:
        f.truncate((64 << 20) + 1)  # sparse: read up to the limit and refused, never loaded whole
    cases = [
        (["--dtype", "int8"], "dtype 'int8'"),
        (["--max-shard-size", "lots"], "shard size 'lots'"),
        (["--config", str(tmp_path / "missing.json")], "no such file"),
        (["--config", str(tmp_path / "passwd")], "passwd: not JSON"),
        (["--config", str(tmp_path / "binary")], "binary: not UTF-8 text"),
        (["--config", str(tmp_path / "list.json")], "list.json: not a model's config"),
        (["--config", str(tmp_path / "untyped.json")], "untyped.json: not a model's config"),
        (["--config", str(tmp_path / "huge.json")], "huge.json: over 64 MiB"),
    ]
    for extra, says in cases:
        proc = tailor("export", "step=3", "--out", str(out), *extra, store=store)
        assert proc.returncode == 2 and says in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert not out.exists() and not list(tmp_path.glob(".out.tailor-partial-*"))

    # a damaged blob: exit 3, and no folder that looks complete
    with tailorstore.Store.open(store) as st:
        master = max(st.repo.view(Catalogue).atoms(1, kind="master"), key=lambda a: a.nbytes)
        file, start, size = blob_object(st.repo, master.blob)
    file.chmod(0o644)
    data = bytearray(file.read_bytes())
    data[start + size // 2] ^= 0x01
    file.write_bytes(bytes(data))
    proc = tailor("export", "step=3", "--out", str(out), store=store)
    assert proc.returncode == 3 and "Traceback" not in proc.stderr, proc.stderr
    assert not out.exists() and not list(tmp_path.glob(".out.tailor-partial-*"))


def test_shard_plan_and_sizes() -> None:
    specs = [TensorSpec(f"t{i}", "float32", (n,)) for i, n in enumerate((10, 10, 30, 5, 5))]
    shards = plan_shards(specs, 100)
    assert [[s.name for s in shard] for shard in shards] == [["t0", "t1"], ["t2"], ["t3", "t4"]]
    assert plan_shards([], 100) == []
    assert parse_size("5GB") == 5 * 10**9 and parse_size("2GiB") == 2 * 2**30 and parse_size("1000") == 1000
    assert parse_size("1.5mb") == 1_500_000
    for bad in ("0", "-1GB", "5XB", ""):
        with pytest.raises(tailorstore.StoreError):
            parse_size(bad)
