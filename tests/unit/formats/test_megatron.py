"""Megatron-Core's ``torch_dist`` layout without a training: the ``.metadata`` a real Megatron save
wrote (tests/data/megatron, made by testbed/train_megatron.py at tensor parallel 2, bf16 with FP32
main parameters and Adam's moments) read by the one allowlisted unpickler, widened only for a
Megatron folder and only by Megatron's planner classes; every chunk named and labelled by layer;
and the folders Megatron leaves (finished, unfinished, a run folder with its tracker) recognised or
refused in one line. tests/system/test_megatron.py does the same on saves Megatron makes as it runs."""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import pytest

from tailorstore.core import atom_types as A
from tailorstore.core.errors import BadCheckpointError, UnsafePickleError
from tailorstore.formats.dcp import read_metadata
from tailorstore.formats.layout import MEGATRON, detect
from tailorstore.formats.megatron import chunk_name
from tests.conftest import TEST_DATA, one_line, tailor_here

DATA = TEST_DATA / "megatron"
SEED = DATA / "iter_0000002.metadata"
SIZES = json.loads((DATA / "distcp_sizes.json").read_text())


def test_plain_dcp_rules_refuse_megatrons_metadata_and_the_megatron_widening_reads_it() -> None:
    """The refusal the issue met (``SavePlan`` is no DCP metadata class) stays for a plain DCP
    folder; a Megatron folder's metadata reads, every chunk checked against its files."""
    with pytest.raises(UnsafePickleError, match=r"torch\.distributed\.checkpoint\.planner\.SavePlan"):
        read_metadata(SEED.read_bytes(), ".metadata", SIZES)
    meta = read_metadata(SEED.read_bytes(), ".metadata", SIZES, megatron=True)
    assert meta.megatron and meta.world_size == 2
    assert "decoder.layers.self_attention.linear_qkv.weight" in meta.tensors
    assert "optimizer.state.exp_avg_sq.output_layer.weight" in meta.tensors


def test_every_chunk_is_named_by_its_sharded_tensor_key_and_labelled_by_layer() -> None:
    meta = read_metadata(SEED.read_bytes(), ".metadata", SIZES, megatron=True)
    named = {}
    for items in meta.items.values():
        for item in items:
            if item.chunk is not None:
                info = meta.tensors[item.fqn]
                named[(item.fqn, item.chunk.offsets)] = chunk_name(
                    item.fqn, item.chunk.offsets, item.chunk.sizes, info.dtype
                )
    assert len(set(named.values())) == len(named), "two chunks share an atom's name and kind"
    by_name = {name: (kind, layer) for name, kind, layer in named.values() if kind == A.WEIGHT}
    qkv = "decoder.layers.{}.self_attention.linear_qkv.weight"
    for layer in (0, 1):  # the stacked layer axis is the block; tensor parallel shards keep apart by offset
        assert by_name[qkv.format(layer)] == (A.WEIGHT, f"block.{layer}")
        assert by_name[qkv.format(layer) + "@96,0"] == (A.WEIGHT, f"block.{layer}")
    assert by_name["embedding.word_embeddings.weight"] == (A.WEIGHT, "embedding")
    assert by_name["output_layer.weight"] == (A.WEIGHT, "lm_head")
    assert by_name["decoder.final_layernorm.weight"] == (A.WEIGHT, "final_norm")
    for kind in (A.MASTER, A.EXP_AVG, A.EXP_AVG_SQ):  # each weight chunk has its optimizer states, same name
        states = {(name, layer) for name, k, layer in named.values() if k == kind}
        assert states == {(name, layer) for name, (_, layer) in by_name.items()}, kind
    assert {layer for _, _, layer in named.values()} == {"embedding", "block.0", "block.1", "final_norm", "lm_head"}


def _edited(edit) -> bytes:
    """The seed with one change, pickled again (our own checked-in file, loaded by pickle to edit it)."""
    pytest.importorskip("torch")
    meta = pickle.loads(SEED.read_bytes())
    edit(meta)
    return pickle.dumps(meta)


class _Shell:
    def __reduce__(self):
        import os

        return (os.system, ("true",))


def _evil_attribute(meta) -> None:
    meta.mcore_data = {"sharded_state": _Shell()}


def _evil_in_a_plan(meta) -> None:
    object.__setattr__(meta.all_local_plans[1], "planner_data", _Shell())  # a frozen dataclass


class _ItemType:
    def __init__(self, value: int) -> None:
        self.value = value

    def __reduce__(self):
        from torch.distributed.checkpoint.planner import WriteItemType

        return (WriteItemType, (self.value,))


def _unknown_item_type(meta) -> None:
    object.__setattr__(meta.all_local_plans[0].items[0], "type", _ItemType(99))


@pytest.mark.parametrize(
    ("edit", "error", "words"),
    [
        (_evil_attribute, UnsafePickleError, "system"),
        (_evil_in_a_plan, UnsafePickleError, "system"),
        (_unknown_item_type, BadCheckpointError, "WriteItemType(99)"),
    ],
)
def test_the_widening_admits_no_other_global_and_no_other_item_type(edit, error, words: str) -> None:
    data = _edited(edit)
    with pytest.raises(error, match=r".*") as raised:
        read_metadata(data, ".metadata", SIZES, megatron=True)
    assert words in str(raised.value) and "\n" not in str(raised.value)


def _folder(root: Path, name: str = "iter_0000100", config: dict | None = None, common: bool = True) -> Path:
    """The file names of a Megatron save (the detection reads names and metadata.json alone)."""
    folder = root / name
    folder.mkdir(parents=True)
    shutil.copy(SEED, folder / ".metadata")
    for distcp in SIZES:
        (folder / distcp).write_bytes(b"")
    if common:
        (folder / "common.pt").write_bytes(b"")
    if config is not None:
        (folder / "metadata.json").write_text(json.dumps(config))
    return folder


TORCH_DIST = {"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch"}


def test_an_iteration_folder_and_a_run_folder_are_layout_megatron(tmp_path: Path) -> None:
    folder = _folder(tmp_path / "run", config=TORCH_DIST)
    one = detect(folder)
    assert (one.kind, one.step, one.root, one.committed) == (MEGATRON, 100, folder.parent, folder)
    assert one.files[-1] == "iter_0000100/metadata.json" and "iter_0000100/common.pt" in one.files
    _folder(tmp_path / "run", "iter_0000050", config=TORCH_DIST)
    (tmp_path / "run" / "latest_checkpointed_iteration.txt").write_text("100\n")
    run = detect(tmp_path / "run")
    assert (run.kind, run.step, run.ds_tag, run.committed) == (MEGATRON, 100, "iter_0000100", tmp_path / "run")
    assert run.files[0] == "latest_checkpointed_iteration.txt"
    assert not any(f.startswith("iter_0000050") for f in run.files)  # the tracker names the step, no other


@pytest.mark.parametrize(
    ("config", "tracker", "words"),
    [
        (None, None, ["metadata.json", "did not finish"]),  # Megatron writes it last: an unfinished save
        ({"sharded_backend": "zarr"}, None, ["zarr", "torch_dist"]),
        (TORCH_DIST, "lots", ["latest_checkpointed_iteration.txt", "not an iteration number"]),
        (TORCH_DIST, "7", ["iter_0000007", "no Megatron torch_dist save"]),
        (None, "100", ["metadata.json", "did not finish"]),  # the run folder's iteration, unfinished
    ],
)
def test_a_megatron_folder_it_cannot_commit_is_refused_in_one_line(
    tmp_path: Path, config: dict | None, tracker: str | None, words: list[str]
) -> None:
    folder = _folder(tmp_path / "run", config=config)
    if tracker is not None:
        (tmp_path / "run" / "latest_checkpointed_iteration.txt").write_text(tracker)
    assert tailor_here("init", str(tmp_path / "store")).returncode == 0
    target = tmp_path / "run" if tracker is not None else folder
    one_line(tailor_here("commit", str(target), store=tmp_path / "store"), 2, *words)
