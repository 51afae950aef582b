"""PyTorch distributed checkpoints (DCP) from real FSDP2 runs: a tiny Llama, each block
``fully_shard``ed, AdamW, 2 ranks on gloo, ``dcp.save`` every 3 steps (testbed/train_fsdp.py).

Commit, checkout byte for byte, ``dcp.load`` at 1 rank of a checkout made at 2, an exact
resume, a parity series whose composite loads and resumes, and hostile ``.metadata`` files
refused through the real CLI with one line."""

from __future__ import annotations

import json
import math
import os
import pickle
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest

from tailorstore import Retention, Store
from tailorstore.core.layers import layer_of
from tailorstore.store.index.catalogue import Catalogue
from testbed.compare import same_tree
from testbed.runs import torchrun
from tests.conftest import Runs, as_of_step, one_line, tailor

pytestmark = pytest.mark.slow

STEPS, EVERY, LAYERS = 6, 3, 4


@dataclass
class FsdpRun:
    out: Path  # step-3/ and step-6/ below it
    losses: list[float]
    weights: Path  # the final full weights (safetensors), gathered by FSDP itself


def train(out: Path, *extra: str, nproc: int = 2) -> dict:
    losses = out / "losses.json"
    args = ["--output-dir", str(out), "--steps", str(STEPS), "--save-every", str(EVERY), "--layers", str(LAYERS)]
    torchrun("testbed.train_fsdp", [*args, "--losses-out", str(losses), *extra], nproc=nproc, log=out / "log.txt")
    return json.loads(losses.read_text())


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory: pytest.TempPathFactory) -> FsdpRun:
    out = tmp_path_factory.mktemp("fsdp")
    weights = out / "final.safetensors"
    done = train(out, "--final-weights", str(weights))
    assert done["first"] == 1 and len(done["losses"]) == STEPS
    return FsdpRun(out, done["losses"], weights)


def full_model_state(folder: Path) -> dict:
    """``dcp.load`` of a folder into a plain (unsharded) model, in this one process: DCP
    reshards the 2 ranks' chunks to world size 1 itself."""
    import torch.distributed.checkpoint as dcp

    from testbed.train_fsdp import build_model

    state = {"model": build_model(LAYERS).state_dict()}
    dcp.load(state, checkpoint_id=str(folder))
    return state["model"]


def test_commit_and_checkout_are_byte_identical_and_layer_wise(fsdp_run: FsdpRun, tmp_path: Path) -> None:
    store = Store.init(tmp_path / "store")
    first = store.commit(fsdp_run.out / "step-3")
    second = store.commit(fsdp_run.out / "step-6")
    assert (first.step, second.step) == (3, 6)
    detail = store.show("step=6")
    layers = {x.layer for x in detail.layers}
    assert {f"block.{i}" for i in range(LAYERS)} | {"embedding", "final_norm", "lm_head"} <= layers
    changes = {d.layer: d.master for d in store.diff("step=3", "step=6").layers}
    assert all(changes[f"block.{i}"] and changes[f"block.{i}"] > 0 for i in range(LAYERS)), changes
    assert {"masters", "moments"} <= set(store.usage().kinds), store.usage().kinds
    png = store.plot(tmp_path / "changes.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for ref, step in (("step=3", 3), ("step=6", 6)):
        out = tmp_path / f"out{step}"
        store.checkout(ref, out)
        assert same_tree(out, fsdp_run.out / f"step-{step}")  # the DCP folder is out itself
    # compressed and deduplicated like any other step: the store holds less than the two saves
    raw = sum(p.stat().st_size for s in ("step-3", "step-6") for p in (fsdp_run.out / s).iterdir())
    assert store.usage().stored_bytes < raw
    store.close()


def test_dcp_load_at_one_rank_from_a_checkout_made_at_two(fsdp_run: FsdpRun, tmp_path: Path) -> None:
    import torch
    from safetensors.torch import load_file

    with Store.init(tmp_path / "store") as store:
        store.commit(fsdp_run.out / "step-6")
        store.checkout("latest", tmp_path / "out")
    loaded = full_model_state(tmp_path / "out")
    final = load_file(str(fsdp_run.weights))
    assert loaded.keys() == final.keys()
    for name, tensor in final.items():
        assert torch.equal(loaded[name], tensor), name


def test_resume_from_a_checkout_gives_the_same_losses(fsdp_run: FsdpRun, tmp_path: Path) -> None:
    with Store.init(tmp_path / "store") as store:
        store.commit(fsdp_run.out / "step-3")
        store.checkout("step=3", tmp_path / "out")
    resumed = train(tmp_path / "resumed", "--resume-from", str(tmp_path / "out"))
    assert resumed["first"] == EVERY + 1
    assert resumed["losses"] == fsdp_run.losses[EVERY:]  # bit for bit: floats through JSON are exact


def test_resume_through_the_storage_reader_at_two_ranks_and_at_one(fsdp_run: FsdpRun, tmp_path: Path) -> None:
    """``dcp.load`` with TailorStorageReader, nothing checked out: at the save's world size
    the losses are the uninterrupted run's; at one rank (DCP reshards the two ranks' chunks) they
    are those of DCP's own load of the raw folder at one rank, bit for bit."""
    with Store.init(tmp_path / "store") as store:
        store.commit(fsdp_run.out / "step-3")
    from_store = ("--resume-from-store", str(tmp_path / "store"), "step=3")
    at_two = train(tmp_path / "two", *from_store)
    assert at_two["first"] == EVERY + 1 and at_two["losses"] == fsdp_run.losses[EVERY:]
    at_one = train(tmp_path / "one", *from_store, nproc=1)
    raw_at_one = train(tmp_path / "raw-one", "--resume-from", str(fsdp_run.out / "step-3"), nproc=1)
    assert at_one["first"] == EVERY + 1 and at_one["losses"] == raw_at_one["losses"]
    # no DCP folder of step 3 was written anywhere: each run's own save of step 6 is all there is
    assert sorted(str(p.parent.relative_to(tmp_path)) for p in tmp_path.rglob(".metadata")) == [
        "one/step-6", "raw-one/step-6", "two/step-6"
    ]  # fmt: skip


def test_a_parity_composite_loads_and_resumes(fsdp_run: FsdpRun, tmp_path: Path) -> None:
    """Step 6 stores the odd blocks and inherits the even ones from step 3: the checkout of
    step 6 is a composite. DCP loads it (its zips' CRCs mended), each layer from its own step."""
    import torch

    with Store.init(tmp_path / "store") as store:
        store.commit(fsdp_run.out / "step-3")
        store.commit(fsdp_run.out / "step-6", policy="parity")
        inherited = {x.layer for x in store.show("step=6").layers if x.source_step == 3}
        blocks = {f"block.{i}" for i in range(LAYERS)}
        assert inherited & blocks and blocks - inherited
        store.checkout("step=6", tmp_path / "out")
    composite = full_model_state(tmp_path / "out")
    at3 = full_model_state(fsdp_run.out / "step-3")
    at6 = full_model_state(fsdp_run.out / "step-6")
    for name, tensor in composite.items():
        source = at3 if layer_of(name) in inherited else at6
        assert torch.equal(tensor, source[name]), name
    more = train(tmp_path / "more", "--resume-from", str(tmp_path / "out"), "--steps", str(STEPS + 2))
    assert more["first"] == STEPS + 1 and len(more["losses"]) == 2
    assert all(math.isfinite(loss) for loss in more["losses"])


# -- hostile .metadata, through the real CLI ----------------------------------------------------------------


def hostile_copy(fsdp_run: FsdpRun, tmp_path: Path, edit) -> Path:
    """step-3 copied, its .metadata loaded with torch, changed by ``edit`` and pickled again."""
    folder = tmp_path / "step-3"
    shutil.copytree(fsdp_run.out / "step-3", folder)
    with open(folder / ".metadata", "rb") as f:
        meta = pickle.load(f)  # our own test fixture: trusted
    edit(meta)
    with open(folder / ".metadata", "wb") as f:
        pickle.dump(meta, f)
    return folder


class _Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned > /tmp/tailor-dcp-pwned",))


def _first_tensor_item(meta):
    return next(k for k in meta.storage_data if k.offset is not None)


def _past_the_end(meta) -> None:
    meta.storage_data[_first_tensor_item(meta)].offset = 10**12


def _overlapping(meta) -> None:
    keys = sorted(
        (k for k in meta.storage_data if meta.storage_data[k].relative_path == "__0_0.distcp"),
        key=lambda k: meta.storage_data[k].offset,
    )
    meta.storage_data[keys[1]].offset = meta.storage_data[keys[0]].offset + 1


def _overflowing(meta) -> None:
    import torch

    fqn = _first_tensor_item(meta).fqn
    meta.state_dict_metadata[fqn].size = torch.Size([2**40, 2**40])


def _larger_than_its_chunks(meta) -> None:
    import torch

    fqn = _first_tensor_item(meta).fqn
    meta.state_dict_metadata[fqn].size = torch.Size([n * 2 for n in meta.state_dict_metadata[fqn].size])


def _chunks_overlapping(meta) -> None:
    """Two ranks' rows of one tensor moved to overlap by a row: their sizes still add up to the tensor's."""
    import dataclasses

    import torch

    fqn, desc = next((f, d) for f, d in meta.state_dict_metadata.items() if len(getattr(d, "chunks", [])) == 2)
    second = max(desc.chunks, key=lambda c: c.offsets[0])
    moved = torch.Size([second.offsets[0] - 1, *second.offsets[1:]])
    key = next(k for k in meta.storage_data if k.fqn == fqn and k.offset == second.offsets)
    meta.storage_data[dataclasses.replace(key, offset=moved)] = meta.storage_data.pop(key)
    desc.chunks[desc.chunks.index(second)] = dataclasses.replace(second, offsets=moved)


def _other_globals(meta) -> None:
    meta.planner_data = _Evil()


@pytest.mark.parametrize(
    "edit, words",
    [
        (_other_globals, ["posix.system", "not one of DCP's metadata classes"]),
        (_past_the_end, ["lies outside __"]),
        (_overlapping, ["overlap in __0_0.distcp"]),
        (_overflowing, ["2^48"]),
        (_larger_than_its_chunks, ["do not cover its size", "exactly once"]),
        (_chunks_overlapping, ["two chunks of", "overlap at"]),
    ],
    ids=[
        "other-globals",
        "offset-past-the-end",
        "overlapping-items",
        "overflowing-size",
        "size-beyond-its-chunks",
        "overlapping-chunks",
    ],
)
def test_hostile_metadata_is_refused_with_one_line(fsdp_run: FsdpRun, tmp_path: Path, edit, words) -> None:
    folder = hostile_copy(fsdp_run, tmp_path, edit)
    store = tmp_path / "store"
    assert tailor("init", str(store)).returncode == 0
    done = tailor("commit", str(folder), store=store)
    one_line(done, 2, ".metadata", *words)
    assert not Path("/tmp/tailor-dcp-pwned").exists()
    assert len(tailor("log", store=store).stdout.strip().splitlines()) == 1  # the header alone: nothing committed


def test_an_sma_merge_loads_and_resumes(fsdp_run: FsdpRun, tmp_path: Path) -> None:
    import torch

    spec = tmp_path / "sma.yaml"
    spec.write_text("method: sma\nsteps: [3, 6]\n")
    with Store.init(tmp_path / "store") as store:
        store.commit(fsdp_run.out / "step-3")
        store.commit(fsdp_run.out / "step-6")
        store.merge(spec, tag="sma")
        store.checkout("tag=sma", tmp_path / "out")
    folder = tmp_path / "out"  # dcp.load reads the checkout itself
    merged = full_model_state(folder)
    at3, at6 = full_model_state(fsdp_run.out / "step-3"), full_model_state(fsdp_run.out / "step-6")
    changed = 0
    for name, tensor in merged.items():
        want = ((at3[name].double() + at6[name].double()) / 2).float()
        assert torch.equal(tensor, want), name
        changed += not torch.equal(tensor, at6[name])
    assert changed > 0
    more = train(tmp_path / "more", "--resume-from", str(folder), "--steps", str(STEPS + 2))
    assert more["first"] == STEPS + 1 and len(more["losses"]) == 2


def test_export_equals_dcp_own_consolidation(fsdp_run: FsdpRun, tmp_path: Path) -> None:
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from transformers import LlamaForCausalLM

    from testbed.train_fsdp import build_model

    config_dir = tmp_path / "config"
    build_model(LAYERS).config.save_pretrained(config_dir)
    with Store.init(tmp_path / "store") as store:
        store.commit(fsdp_run.out / "step-6")
        store.export("latest", tmp_path / "hf", dtype="fp32", config=config_dir / "config.json")
    dcp_to_torch_save(str(fsdp_run.out / "step-6"), str(tmp_path / "own.pt"))
    own = torch.load(tmp_path / "own.pt", weights_only=True)
    own = own["model"] if "model" in own else {k.removeprefix("model."): v for k, v in own.items()}
    model = LlamaForCausalLM.from_pretrained(tmp_path / "hf")
    exported = model.state_dict()
    for name, tensor in exported.items():
        assert torch.equal(tensor, own[name]), name


def test_an_hf_fsdp_checkpoint_written_by_accelerate_is_exact(tmp_path: Path) -> None:
    """The HF Trainer's FSDP folder layout, written by Accelerate's own save functions:
    ``checkpoint-N/`` with the DCP folders ``pytorch_model_fsdp_0/`` and ``optimizer_0/``. The
    Trainer itself does not run FSDP on this CPU machine: given ``fsdp`` and ``use_cpu``
    (transformers 5.23, accelerate 1.15), Accelerate picks MULTI_CPU and wraps the model in DDP,
    and the checkpoint holds model.safetensors and optimizer.pt (tried here, 2 ranks)."""
    out = tmp_path / "run"
    train(out, "--accelerate-layout")
    checkpoint = out / "checkpoint-6"
    assert (checkpoint / "pytorch_model_fsdp_0" / ".metadata").is_file()
    assert (checkpoint / "optimizer_0" / ".metadata").is_file()
    with Store.init(tmp_path / "store") as store:
        assert store.commit(checkpoint).step == 6
        layers = {x.layer for x in store.show("latest").layers}
        assert {f"block.{i}" for i in range(LAYERS)} <= layers
        kinds = {a.kind for a in store.repo.view(Catalogue).atoms(store.show("latest").summary.manifest)}
        assert {"master", "exp_avg", "exp_avg_sq"} <= kinds
        store.checkout("latest", tmp_path / "out")
    written = tmp_path / "out" / "checkpoint-6" if (tmp_path / "out" / "checkpoint-6").is_dir() else tmp_path / "out"
    assert same_tree(written, checkpoint)


def test_an_accelerate_save_state_folder_is_one_step_that_loads_straight_from_the_store(tmp_path: Path) -> None:
    """Accelerate's ``save_state`` under FSDP writes ``checkpoint_N/`` holding two DCP
    folders (``pytorch_model_fsdp_0/``, ``optimizer_0/``, by Accelerate's own save functions) and
    each rank's random states. It was refused ("holds 2 checkpoint folders; commit each"), so an
    Accelerate user's one checkpoint became two steps or none. It commits as one step now (its
    number from Accelerate's ``checkpoint_N`` name), checks out as the very folder, and each DCP
    folder of it loads through TailorStorageReader as ``dcp.load`` loads the raw one."""
    import torch
    import torch.distributed.checkpoint as dcp

    from tailorstore.integrations.dcp.reader import TailorStorageReader

    out = tmp_path / "run"
    train(out, "--accelerate-layout", "save-state")
    checkpoint = out / "checkpoint_6"
    assert {p.name for p in checkpoint.iterdir()} == {
        "pytorch_model_fsdp_0",
        "optimizer_0",
        "random_states_0.pkl",
        "random_states_1.pkl",
    }
    with Store.init(tmp_path / "store") as store:
        result = store.commit(checkpoint)
        assert result.step == 6 and result.files == 8  # two DCP folders of 3 files, two random states
        assert {f"block.{i}" for i in range(LAYERS)} <= {x.layer for x in store.show("latest").layers}
        kinds = {a.kind for a in store.repo.view(Catalogue).atoms(result.manifest)}
        assert {"master", "exp_avg", "exp_avg_sq"} <= kinds
        store.checkout("latest", tmp_path / "out")
        assert same_tree(tmp_path / "out", checkpoint)
        for folder in ("pytorch_model_fsdp_0", "optimizer_0"):
            raw = dcp.FileSystemReader(str(checkpoint / folder))
            template = {
                key: torch.empty(meta.size, dtype=meta.properties.dtype)
                for key, meta in raw.read_metadata().state_dict_metadata.items()
                if hasattr(meta, "size")
            }
            expected = {k: v.clone() for k, v in template.items()}
            dcp.load(expected, storage_reader=raw)
            loaded = {k: v.clone() for k, v in template.items()}
            dcp.load(loaded, storage_reader=TailorStorageReader(store, "latest", folder=folder))
            assert loaded.keys() == expected.keys() and len(loaded) > 0
            for key, tensor in expected.items():
                assert torch.equal(loaded[key], tensor), (folder, key)


def test_a_rank_parallel_commit_equals_a_single_process_one(fsdp_run: FsdpRun, tmp_path: Path) -> None:
    """Each rank writes its own ``__R_0.distcp`` file's blobs as a part, rank 0 the rest and the
    manifest: every manifest equals a single-process commit's, parity policy included."""
    from tests.conftest import manifest_rows

    saves = [fsdp_run.out / "step-3", fsdp_run.out / "step-6"]
    with Store.init(tmp_path / "single") as single:
        for save in saves:
            single.commit(save, policy="parity")
        expected = {step: manifest_rows(single, step) for step in (3, 6)}
    Store.init(tmp_path / "parallel").close()
    out = tmp_path / "out.json"
    torchrun("testbed.rank_commit", [str(tmp_path / "parallel"), str(out), *map(str, saves), "--policy", "parity"])
    with Store.open(tmp_path / "parallel") as parallel:
        for step in (3, 6):
            assert manifest_rows(parallel, step) == expected[step], step
        assert parallel.verify(deep=True).ok
    first_save = json.loads(Path(f"{out}.rank0").read_text())[0]
    assert all(part and part["new_blobs"] > 0 for part in first_save["parts"]), "each rank wrote its own file's blobs"


def test_retention_thins_an_old_dcp_step_to_its_weights(fsdp_run: FsdpRun, tmp_path: Path) -> None:
    """gc keeps the last step whole and thins step 3: its Adam moments go, its FP32 parameters
    (the model's only copy) stay; it exports as before and no longer checks out; verify passes."""
    from safetensors.torch import load_file

    config_dir = tmp_path / "config"
    from testbed.train_fsdp import build_model

    build_model(LAYERS).config.save_pretrained(config_dir)
    with Store.init(tmp_path / "store") as store:
        store.commit(fsdp_run.out / "step-3")
        store.commit(fsdp_run.out / "step-6")
        store.export("step=3", tmp_path / "before", dtype="fp32", config=config_dir / "config.json")
        whole = store.usage().stored_bytes
        store.gc(Retention(keep_last=1, thin="weights"))
        kinds = {a.kind for a in store.repo.view(Catalogue).atoms(store.show("step=3").summary.manifest)}
        assert "master" in kinds and not kinds & {"exp_avg", "exp_avg_sq"}
        assert store.usage().stored_bytes < whole
        store.export("step=3", tmp_path / "after", dtype="fp32", config=config_dir / "config.json")
        with pytest.raises(Exception, match="thinned"):
            store.checkout("step=3", tmp_path / "out")
        assert store.verify(deep=True).ok
        store.checkout("step=6", tmp_path / "out6")
    assert same_tree(tmp_path / "out6", fsdp_run.out / "step-6")
    before, after = (
        load_file(tmp_path / "before" / "model.safetensors"),
        load_file(tmp_path / "after" / "model.safetensors"),
    )
    assert before.keys() == after.keys() and all(before[k].equal(after[k]) for k in before)


def test_a_dcp_step_of_another_model_needs_a_run_of_its_own(fsdp_run: FsdpRun, runs, tmp_path: Path) -> None:
    """One store, two frameworks: a DeepSpeed run refuses a DCP step (another framework's save, here
    of another model too), and a run of its own takes it, sharing the store's blobs."""
    from tailorstore.core.errors import StoreError

    deepspeed_save = runs.get("zero2-bf16").save_dir / "global_step3"
    with Store.init(tmp_path / "store") as store:
        store.commit(deepspeed_save)
        with pytest.raises(StoreError, match="is a DCP"):
            store.commit(fsdp_run.out / "step-6")
        store.commit(fsdp_run.out / "step-6", run="fsdp")
        assert {(s.run, s.step) for s in store.log()} == {("main", 3), ("fsdp", 6)}
        assert store.verify(deep=True).ok


def test_a_bf16_weight_that_is_its_fp32_master_rounded_is_derived(tmp_path: Path) -> None:
    """A DCP save that holds both (bf16 parameters, and an optimizer that keeps an FP32 ``master``
    of each, as mixed-precision optimizers do): the weight is stored as a derivation of its
    master, not as bytes of its own, and checks out byte for byte."""
    import torch
    import torch.distributed.checkpoint as dcp

    torch.manual_seed(0)
    masters = {f"layers.{i}.w": torch.randn(64, 32) for i in range(3)}
    state = {
        "model": {name: m.to(torch.bfloat16) for name, m in masters.items()},
        "optim": {"state": {name: {"master": m, "exp_avg": torch.zeros_like(m)} for name, m in masters.items()}},
    }
    dcp.save(state, checkpoint_id=str(tmp_path / "step-1"))
    with Store.init(tmp_path / "store") as store:
        result = store.commit(tmp_path / "step-1")
        assert result.derived_bytes == sum(m.numel() * 2 for m in masters.values())
        store.checkout("latest", tmp_path / "out")
        assert store.verify(deep=True).ok
    assert same_tree(tmp_path / "out", tmp_path / "step-1")


def test_a_dcp_step_is_refused_into_a_deepspeed_run_unless_forced(
    fsdp_run: FsdpRun, runs: Runs, tmp_path: Path
) -> None:
    """A DCP step of the same shapes was accepted into a DeepSpeed run and became
    its `latest`; the run's next resume through `attach` then failed with a bare AssertionError."""
    store = tmp_path / "store"
    assert tailor("init", str(store)).returncode == 0
    save = as_of_step(runs.get("zero2-bf16").save_dir, 3, tmp_path / "at3")
    assert tailor("commit", str(save), store=store).returncode == 0
    refused = tailor("commit", str(fsdp_run.out / "step-6"), store=store)
    one_line(refused, 2, "DCP", "DeepSpeed save", "--run NAME")
    assert tailor("commit", str(fsdp_run.out / "step-6"), "--run", "fsdp", store=store).returncode == 0
    assert tailor("commit", str(fsdp_run.out / "step-6"), "--step", "7", "--force", store=store).returncode == 0


def test_the_dcp_tutorials_stateful_recipe_is_read_as_model_and_optimizer(tmp_path: Path) -> None:
    """``dcp.save({"app": AppState(model, optim)})``, the recipe of PyTorch's DCP
    tutorial, labelled every atom ``master`` (``app`` was read as the model's own prefix): export then
    wrote the Adam moments as weights, and ``gc --thin weights`` kept them. The ``Stateful``'s name is
    looked through now, and the export holds exactly the model's parameters."""
    import torch
    import torch.distributed.checkpoint as dcp
    from safetensors import safe_open
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.checkpoint.stateful import Stateful

    class AppState(Stateful):
        def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
            self.model, self.optimizer = model, optimizer

        def state_dict(self) -> dict:
            model_state, optimizer_state = get_state_dict(self.model, self.optimizer)
            return {"model": model_state, "optim": optimizer_state}

        def load_state_dict(self, state: dict) -> None:
            set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(8, 16)).sum().backward()
    optimizer.step()
    dcp.save({"app": AppState(model, optimizer)}, checkpoint_id=str(tmp_path / "step-1"))

    params = dict(model.named_parameters())
    with Store.init(tmp_path / "store") as store:
        store.commit(tmp_path / "step-1")
        shown = store.show("latest")
        store.export("latest", tmp_path / "hf", dtype="fp32")
        store.checkout("latest", tmp_path / "out")
    assert same_tree(tmp_path / "out", tmp_path / "step-1")
    kinds = {k for layer in shown.layers for k in layer.kinds}
    assert {"master", "exp_avg", "exp_avg_sq"} <= kinds, kinds
    with safe_open(str(next((tmp_path / "hf").glob("*.safetensors"))), "pt") as f:
        names = set(f.keys())
        assert names == set(params), sorted(names)
        for name, p in params.items():
            assert torch.equal(f.get_tensor(name), p.detach()), name


def test_a_tied_embedding_is_exported_once_as_save_pretrained_writes_it(tmp_path: Path) -> None:
    """DCP writes a tied tensor under each of its names, and the export wrote
    both (21 tensors where save_pretrained writes 20). The output embedding that is its input
    embedding, piece for piece, is written once now and reported tied; from_pretrained ties it back."""
    import torch
    import torch.distributed.checkpoint as dcp
    from safetensors import safe_open
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=32, tie_word_embeddings=True,
    )  # fmt: skip
    model = LlamaForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.arange(16).view(2, 8), labels=torch.arange(16).view(2, 8)).loss.backward()
    optimizer.step()
    model_state, optim_state = get_state_dict(model, optimizer)
    assert "lm_head.weight" in model_state  # DCP holds it under both names
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(tmp_path / "step-1"))
    model.save_pretrained(tmp_path / "own")  # what Hugging Face writes of the same model
    with safe_open(str(tmp_path / "own" / "model.safetensors"), "pt") as f:
        own_names = set(f.keys())
    config.save_pretrained(tmp_path / "config")

    with Store.init(tmp_path / "store") as store:
        store.commit(tmp_path / "step-1")
        result = store.export("latest", tmp_path / "hf", dtype="fp32", config=tmp_path / "config" / "config.json")
    assert result.tied == {"lm_head.weight": "model.embed_tokens.weight"}
    with safe_open(str(tmp_path / "hf" / "model.safetensors"), "pt") as f:
        assert set(f.keys()) == own_names and result.tensors == len(own_names)
    loaded = LlamaForCausalLM.from_pretrained(tmp_path / "hf")
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name


def test_equal_tensors_that_are_not_embeddings_are_both_exported() -> None:
    """The tie rule is narrow: two norms still at ones are equal blob for blob, yet not tied."""
    from tailorstore.access.model_tensors import ModelTensor, tied_embeddings
    from tailorstore.core.records import AtomRecord

    def tensor(name: str, blob: str) -> ModelTensor:
        atom = AtomRecord("f", 0, 0, 4, "float32", "[4]", name, "master", 0, 0, 16, "x", blob, None, 0)
        return ModelTensor(name, (4,), "float32", (atom,), "master")

    tensors = [
        tensor("model.norm.weight", "a"),
        tensor("model.layers.0.input_layernorm.weight", "a"),
        tensor("model.embed_tokens.weight", "b"),
        tensor("lm_head.weight", "b"),
        tensor("output.weight", "c"),  # an untied head: other pieces
    ]
    assert tied_embeddings(tensors) == {"lm_head.weight": "model.embed_tokens.weight"}
