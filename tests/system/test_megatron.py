"""Megatron-Core ``torch_dist`` saves from a real run: a tiny ``GPTModel`` (local layer spec, tensor
parallel 2, bf16) trained on 2 gloo ranks and saved by ``dist_checkpointing.save`` at iterations 2
and 4 into a Megatron-LM run folder (testbed/train_megatron.py).

Megatron's own optimizers need CUDA (they accept only ``torch.cuda.*Tensor`` parameters), so the
optimizer state is built as Megatron names and shards it: FP32 main parameters updated by AdamW and
cast back into the bf16 parameters, saved through Megatron's ``make_sharded_optimizer_tensor``
under ``optimizer.state.{fp32_param,exp_avg,exp_avg_sq}.<key>``. The model, its forward and loss,
the save and every load are Megatron's. Megatron-Core writes no ``integrity.json`` (Megatron-LM's
training loop may); the test that needs one writes it as Megatron-LM does, SHA-256 of every file.

Commit (an iteration folder, and a run folder by its tracker), checkout byte for byte with
``metadata.json`` and ``integrity.json`` written last, Megatron's ``dist_checkpointing.load`` of the
checkout at TP 2 (the very tensors saved) and at TP 1 (what Megatron's load of the raw folder
gives), a resume from the checkout with the same losses, a series smaller than the raw saves, and
an unfinished save refused in one line."""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest

from tailorstore import Store
from tailorstore.access.contents import Contents
from tailorstore.core import atom_types as A
from tailorstore.formats.layout import MEGATRON
from testbed.compare import same_tree
from testbed.runs import TrainingFailed, torchrun
from tests.conftest import TEST_DATA, one_line, tailor

pytestmark = pytest.mark.slow
SEED = TEST_DATA / "megatron" / "iter_0000002.metadata"


@dataclass
class MegatronRun:
    run: Path  # iter_0000002/, iter_0000004/, latest_checkpointed_iteration.txt
    dumps: Path  # each rank's tensors at each save: dumps.iter_0000002.rank0 ...
    losses: dict[str, float]


def megatron(*args: str, nproc: int = 2, log: Path) -> None:
    torchrun("testbed.train_megatron", list(args), nproc=nproc, log=log, timeout=300)


@pytest.fixture(scope="module")
def megatron_run(tmp_path_factory: pytest.TempPathFactory) -> MegatronRun:
    out = tmp_path_factory.mktemp("megatron")
    run, dumps, losses = out / "run", out / "dumps", out / "losses.json"
    megatron("--out", str(run), "--steps", "4", "--save-every", "2", "--dump", str(dumps),
             "--losses-out", str(losses), log=out / "train.log")  # fmt: skip
    return MegatronRun(run, dumps, json.loads(losses.read_text()))


def loaded(folder: Path, tp: int, dump: Path, *extra: str) -> dict[int, dict]:
    """Each rank's tensors after Megatron's own ``dist_checkpointing.load`` of ``folder`` at ``tp``
    (``--store S``: through ``TailorLoadShardedStrategy``, the tensors from the store)."""
    import torch

    megatron("--tp", str(tp), "--load", str(folder), "--dump", str(dump), *extra, nproc=tp,
             log=dump.with_suffix(".log"))  # fmt: skip
    return {r: torch.load(f"{dump}.rank{r}") for r in range(tp)}


def equal(a: dict, b: dict) -> bool:
    import torch

    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_an_iteration_folder_is_layout_megatron_labelled_by_layer_with_weights_derived(
    megatron_run: MegatronRun, tmp_path: Path
) -> None:
    """``tailor commit iter_0000002/``: the step from the folder's name; every chunk an atom named by
    its ShardedTensor key, its layer's label; the optimizer's states by kind; the bf16 weights
    derived from their FP32 main parameters; the checkout is the folder, byte for byte."""
    store = tmp_path / "store"
    assert tailor("init", str(store)).returncode == 0
    done = tailor("commit", str(megatron_run.run / "iter_0000002"), store=store)
    assert done.returncode == 0, done.stderr
    with Store.open(store) as opened:
        step = opened.step("latest")
        facts = opened.repo.manifest(step.manifest)
        assert (step.step, facts.layout) == (2, MEGATRON)
        atoms = opened.repo.view(Contents).atoms(step.manifest)
        for atom in atoms:
            if atom.param.startswith("decoder.layers."):
                assert atom.layer == f"block.{atom.param.split('.')[2]}", atom
        kinds = {(a.layer, a.kind) for a in atoms}
        for layer in ("embedding", "block.0", "block.1", "final_norm", "lm_head"):
            assert {(layer, k) for k in (A.WEIGHT, A.MASTER, A.EXP_AVG, A.EXP_AVG_SQ)} <= kinds, layer
        bf16 = [a for a in atoms if a.kind == A.WEIGHT]
        assert all(a.dtype == "bfloat16" for a in bf16)
        derived = opened.repo.view(Contents).atoms(step.manifest, kind=A.WEIGHT, derived=True)
        assert sum(a.nbytes for a in derived) > 0.9 * sum(a.nbytes for a in bf16)  # the cast of each main param
        opened.checkout("latest", tmp_path / "out")
    assert same_tree(tmp_path / "out", megatron_run.run / "iter_0000002")  # the folder is out itself
    # not yet read as one model (no export), and resharded by Megatron itself: each said in one line
    one_line(tailor("export", "latest", "--out", str(tmp_path / "hf"), store=store), 2, "Megatron-Core", "checkout")
    resharded = tailor("checkout", "latest", "--out", str(tmp_path / "w1"), "--world-size", "1", store=store)
    one_line(resharded, 2, "dist_checkpointing.load reshards it")


def test_a_checkout_writes_metadata_json_and_integrity_json_last(
    megatron_run: MegatronRun, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Megatron takes ``metadata.json`` for "this save is complete": the checkout writes every
    other file first, then it, then Megatron-LM's ``integrity.json``. The order of the writes is
    watched as they happen (the writers themselves run)."""
    from tailorstore.access import placement
    from tailorstore.restore import checkout

    folder = tmp_path / "iter_0000004"
    shutil.copytree(megatron_run.run / "iter_0000004", folder)
    sums = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}
    (folder / "integrity.json").write_text(json.dumps(sums))  # as Megatron-LM writes it, after everything
    order: list[str] = []
    place, raw = placement.write_files, checkout.write_raw_blob

    def placed(repo, facts, rows, root, **kw):
        order.extend(Path(r.path).name for r in rows)
        return place(repo, facts, rows, root, **kw)

    def whole(repo, digest, target, where):
        order.append(target.name)
        return raw(repo, digest, target, where)

    monkeypatch.setattr(placement, "write_files", placed)
    monkeypatch.setattr(checkout, "write_raw_blob", whole)
    with Store.init(tmp_path / "store") as store:
        assert store.commit(folder).step == 4
        store.checkout("latest", tmp_path / "out")
    assert same_tree(tmp_path / "out", folder)
    assert order[-2:] == ["metadata.json", "integrity.json"] and len(order) == len(set(order)) == 8, order


def test_a_run_folder_commits_the_iteration_its_tracker_names(megatron_run: MegatronRun, tmp_path: Path) -> None:
    """``tailor commit RUN_DIR``: the iteration ``latest_checkpointed_iteration.txt`` names, with that
    file; the checkout is a folder Megatron-LM's ``--load`` resumes from."""
    with Store.init(tmp_path / "store") as store:
        assert store.commit(megatron_run.run).step == 4
        store.checkout("latest", tmp_path / "out")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["iter_0000004", "latest_checkpointed_iteration.txt"]
    assert same_tree(tmp_path / "out" / "iter_0000004", megatron_run.run / "iter_0000004")
    assert (tmp_path / "out" / "latest_checkpointed_iteration.txt").read_text() == "4"
    # delete_after_commit takes the committed iteration alone: the tracker and the other iterations stay
    copy = tmp_path / "copy"
    shutil.copytree(megatron_run.run, copy)
    with Store.init(tmp_path / "store2") as store:
        assert store.commit(copy, delete_after_commit=True).step == 4
        store.commit(copy / "iter_0000002", delete_after_commit=True)  # by itself: rooted at its parent
    assert sorted(p.name for p in copy.iterdir()) == ["latest_checkpointed_iteration.txt"]


def test_megatron_loads_the_checkout_at_tp2_and_at_tp1(megatron_run: MegatronRun, tmp_path: Path) -> None:
    """Megatron's ``dist_checkpointing.load`` of the checkout: at TP 2 the very tensors each rank
    saved; at TP 1 (resharded by Megatron) what its load of the raw folder gives at TP 1."""
    store = tmp_path / "store"
    with Store.init(store) as opened:
        opened.commit(megatron_run.run / "iter_0000002")
        opened.checkout("latest", tmp_path / "out")
    import torch

    at_tp2 = loaded(tmp_path / "out", 2, tmp_path / "tp2")
    for rank in (0, 1):
        assert equal(at_tp2[rank], torch.load(f"{megatron_run.dumps}.iter_0000002.rank{rank}")), rank
    raw_tp1 = loaded(megatron_run.run / "iter_0000002", 1, tmp_path / "raw-tp1")[0]
    assert equal(loaded(tmp_path / "out", 1, tmp_path / "tp1")[0], raw_tp1)
    assert raw_tp1["model.output_layer.weight"].shape == (128, 64)  # whole at TP 1: both shards joined
    # the committed folder, loaded straight from the store through the strategy, at TP 1 too
    through = loaded(megatron_run.run / "iter_0000002", 1, tmp_path / "strategy-tp1", "--store", str(store))[0]
    assert equal(through, raw_tp1)


def test_a_resume_from_the_checkout_gives_the_same_losses(megatron_run: MegatronRun, tmp_path: Path) -> None:
    with Store.init(tmp_path / "store") as store:
        store.commit(megatron_run.run / "iter_0000002")
        store.commit(megatron_run.run / "iter_0000004")
        store.checkout("step=2", tmp_path / "out")
        # a series of saves: the store holds the two well under their raw size (derived weights, compression)
        raw = sum(p.stat().st_size for p in megatron_run.run.rglob("*") if p.is_file())
        assert store.usage().stored_bytes * 1.3 <= raw, (store.usage().stored_bytes, raw)
    losses = tmp_path / "losses.json"
    megatron("--resume-from", str(tmp_path / "out"), "--steps", "4", "--losses-out", str(losses),
             log=tmp_path / "resume.log")  # fmt: skip
    resumed = json.loads(losses.read_text())
    assert resumed == {k: v for k, v in megatron_run.losses.items() if int(k) > 2}, (resumed, megatron_run.losses)


def test_an_unfinished_save_is_refused_in_one_line(megatron_run: MegatronRun, tmp_path: Path) -> None:
    """A save killed before ``metadata.json`` (Megatron writes it last): refused, nothing recorded."""
    folder = tmp_path / "iter_0000004"
    shutil.copytree(megatron_run.run / "iter_0000004", folder)
    (folder / "metadata.json").unlink()
    assert tailor("init", str(tmp_path / "store")).returncode == 0
    one_line(tailor("commit", str(folder), store=tmp_path / "store"), 2, "metadata.json", "did not finish")
    assert tailor("log", store=tmp_path / "store").stdout.count("exact") == 0


def test_the_checked_in_seed_pickles_the_classes_megatron_pickles_today(megatron_run: MegatronRun) -> None:
    """The fuzz seed and the fast tests read a checked-in ``.metadata``: it must still be what
    Megatron writes, global for global, or the widening is tested against a format of the past."""
    import io
    import pickle

    def globals_of(data: bytes) -> set[str]:
        found: set[str] = set()

        class Recording(pickle.Unpickler):  # our own files: the seed, and the save this module made
            def find_class(self, module: str, name: str):
                found.add(f"{module}.{name}")
                return super().find_class(module, name)

        Recording(io.BytesIO(data)).load()
        return found

    fresh = globals_of((megatron_run.run / "iter_0000004" / ".metadata").read_bytes())
    assert "torch.distributed.checkpoint.planner.SavePlan" in fresh
    assert globals_of(SEED.read_bytes()) == fresh


@pytest.fixture(scope="module")
def strategy_run(tmp_path_factory: pytest.TempPathFactory) -> MegatronRun:
    """The same training, saved through ``TailorSaveShardedStrategy``: the tensors into the store."""
    out = tmp_path_factory.mktemp("megatron-strategy")
    run, dumps, losses = out / "run", out / "dumps", out / "losses.json"
    assert tailor("init", str(out / "store")).returncode == 0
    megatron("--out", str(run), "--steps", "4", "--save-every", "2", "--dump", str(dumps), "--store",
             str(out / "store"), "--losses-out", str(losses), log=out / "train.log")  # fmt: skip
    return MegatronRun(run, dumps, json.loads(losses.read_text()))


def test_a_save_through_the_strategy_is_a_megatron_step_that_megatron_loads(
    megatron_run: MegatronRun, strategy_run: MegatronRun, tmp_path: Path
) -> None:
    """``dist_checkpointing.save(..., sharded_strategy=TailorSaveShardedStrategy(store))``: each save
    is a step of layout ``megatron``, its chunks labelled by layer, and the folder keeps only the
    two small files Megatron itself writes there (``common.pt``, ``metadata.json``). Its checkout is
    a folder Megatron's own load reads, at TP 2, to the very tensors each rank saved."""
    assert strategy_run.losses == megatron_run.losses  # the same training
    store = strategy_run.run.parent / "store"
    for folder in ("iter_0000002", "iter_0000004"):
        assert sorted(p.name for p in (strategy_run.run / folder).iterdir()) == ["common.pt", "metadata.json"]
    with Store.open(store) as opened:
        assert [s.step for s in opened.log()] == [2, 4]
        step = opened.step("step=2")
        assert opened.repo.manifest(step.manifest).layout == MEGATRON
        layers = {a.layer for a in opened.repo.view(Contents).atoms(step.manifest)}
        assert layers == {"embedding", "block.0", "block.1", "final_norm", "lm_head"}
        assert opened.repo.view(Contents).atoms(step.manifest, kind=A.WEIGHT, derived=True)
        opened.checkout("step=2", tmp_path / "out")
    import torch

    at_tp2 = loaded(tmp_path / "out", 2, tmp_path / "tp2")
    for rank in (0, 1):
        assert equal(at_tp2[rank], torch.load(f"{strategy_run.dumps}.iter_0000002.rank{rank}")), rank


def test_an_async_save_through_the_strategy_resumes_through_it_with_the_raw_paths_losses(
    megatron_run: MegatronRun, tmp_path: Path
) -> None:
    """``async_sharded_save=True``, scheduled on Megatron's ``AsyncCallsQueue`` as Megatron-LM does:
    each rank's part is committed in Megatron's async process, the step when the queue finalizes.
    Loaded back through ``TailorLoadShardedStrategy`` (the tensors from the store, at TP 2), training
    goes on with the losses, bit for bit, of the run that never stopped and saved to disk."""
    store, run = tmp_path / "store", tmp_path / "run"
    assert tailor("init", str(store)).returncode == 0
    megatron("--out", str(run), "--steps", "4", "--save-every", "2", "--store", str(store), "--async-save",
             log=tmp_path / "train.log")  # fmt: skip
    with Store.open(store) as opened:
        assert [s.step for s in opened.log()] == [2, 4]
    assert (run / "latest_checkpointed_iteration.txt").read_text() == "4"  # written at the finalization
    losses = tmp_path / "losses.json"
    megatron("--resume-from", str(run / "iter_0000002"), "--store", str(store), "--ref", "step=2", "--steps", "4",
             "--losses-out", str(losses), log=tmp_path / "resume.log")  # fmt: skip
    resumed = json.loads(losses.read_text())
    assert resumed == {k: v for k, v in megatron_run.losses.items() if int(k) > 2}, (resumed, megatron_run.losses)


def test_a_kill_during_an_async_save_records_no_step(tmp_path: Path) -> None:
    """Every rank dies once its async process has committed its part, before Megatron's queue
    finalizes the save: both parts are in the store, and no step is."""
    from tailorstore.integrations.common.store_session import StoreSession

    store = tmp_path / "store"
    assert tailor("init", str(store)).returncode == 0
    with pytest.raises(TrainingFailed, match="exited with code 3"):
        megatron("--out", str(tmp_path / "run"), "--steps", "2", "--save-every", "2", "--store", str(store),
                 "--async-save", "--die-after-parts", log=tmp_path / "train.log")  # fmt: skip
    with Store.open(store) as opened:
        assert opened.log() == []
        assert len(StoreSession(opened).parts(2)) == 2  # each rank's part, waiting for gc --drop-parts
