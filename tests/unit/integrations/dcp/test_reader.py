"""``dcp.load`` through :class:`TailorStorageReader`: a stored DCP step is read item by
item from the store, into the memory the state dict keeps, every tensor hash-checked, with no file
written. Real ``dcp.save`` folders, committed to a real store; one process here (DCP without a
process group), two ranks and one in tests/system/test_dcp.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict

from tailorstore import Retention, Store
from tailorstore.core.errors import CorruptStoreError, StoreError
from tailorstore.integrations.common import StoreSession
from tailorstore.integrations.dcp.reader import TailorStorageReader
from tailorstore.store.index.catalogue import Catalogue
from tests.conftest import blob_object


def _trained(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    model.register_buffer("seen", torch.tensor([seed], dtype=torch.int64))  # an integer buffer
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(2):
        model(torch.randn(4, 16)).sum().backward()
        optimizer.step()
    return model, optimizer


def _state(seed: int, step: int) -> dict:
    model, optimizer = _trained(seed)
    msd, osd = get_state_dict(model, optimizer)
    return {"model": msd, "optim": osd, "train": {"step": step, "note": f"seed {seed}"}}


def _equal(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return isinstance(b, list | tuple) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    return a == b


@pytest.fixture
def two_steps(tmp_path: Path) -> tuple[Store, dict, dict]:
    saved = {3: _state(1, 3), 6: _state(2, 6)}
    store = Store.init(tmp_path / "store")
    for step, state in saved.items():
        dcp.save(state, checkpoint_id=str(tmp_path / f"step-{step}"))
        store.commit(tmp_path / f"step-{step}")
    yield store, saved, {s: tmp_path / f"step-{s}" for s in saved}
    store.close()


def test_a_committed_step_loads_as_the_raw_folder_does_into_the_memory_kept(two_steps, tmp_path: Path) -> None:
    store, saved, folders = two_steps
    for ref, step in (("step=3", 3), ("latest", 6)):
        ours, theirs = _state(9, 0), _state(9, 0)
        kept = {k: v.data_ptr() for k, v in ours["model"].items()}
        dcp.load(ours, storage_reader=TailorStorageReader(store, ref))
        dcp.load(theirs, checkpoint_id=str(folders[step]))  # DCP's own FileSystemReader
        assert _equal(ours, theirs), ref
        assert _equal(ours["model"], saved[step]["model"]) and ours["train"] == saved[step]["train"]
        assert {k: v.data_ptr() for k, v in ours["model"].items()} == kept  # decoded in place
    assert not list(tmp_path.glob("**/*.tailor-partial*"))


def test_a_destination_that_is_not_contiguous_memory_gets_the_same_values(two_steps) -> None:
    """A destination the bytes cannot be decoded into (a transposed view): decoded once into a
    scratch buffer, then copied, with the same values."""
    store, saved, _ = two_steps
    whole = saved[6]["model"]["0.weight"]
    target = torch.zeros(whole.shape[1], whole.shape[0]).t()
    assert not target.is_contiguous()
    state = {"model": {"0.weight": target}}
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    dcp.load(state, storage_reader=TailorStorageReader(store, 6), planner=DefaultLoadPlanner(allow_partial_load=True))
    assert torch.equal(state["model"]["0.weight"], whole)


def test_a_damaged_blob_fails_the_load(two_steps) -> None:
    store, _, _ = two_steps
    atom = max(store.repo.view(Catalogue).atoms(store.repo.resolve("latest")), key=lambda a: a.nbytes)
    file, start, size = blob_object(store.repo, atom.blob)
    file.chmod(0o644)
    data = bytearray(file.read_bytes())
    data[start + size // 2] ^= 0x01
    file.write_bytes(bytes(data))
    with pytest.raises(CheckpointException) as failed:  # DCP wraps each rank's error
        dcp.load(_state(9, 0), storage_reader=TailorStorageReader(store, "latest"))
    assert any(isinstance(error, CorruptStoreError) for error, _ in failed.value.failures.values())


def test_a_step_without_a_dcp_folder_is_refused(tmp_path: Path) -> None:
    (tmp_path / "plain").mkdir()
    torch.save({"w": torch.ones(3)}, tmp_path / "plain" / "ckpt.pt")
    with Store.init(tmp_path / "store") as store:
        store.commit(tmp_path / "plain", step=1)
        with pytest.raises(CheckpointException, match="step 1 holds no DCP folder"):  # wrapped by DCP
            dcp.load({"w": torch.zeros(3)}, storage_reader=TailorStorageReader(store, 1))
        with pytest.raises(StoreError, match="holds no DCP folder"):
            StoreSession(store).open_dcp(1)


def test_a_step_the_store_does_not_hold_is_one_error(two_steps) -> None:
    """Rank 0 resolves the ref and hands every rank its answer, a failure too (no rank waits for a
    step id that never comes)."""
    store, _, _ = two_steps
    with pytest.raises(CheckpointException, match="step 99 is not in the store"):
        dcp.load(_state(9, 0), storage_reader=TailorStorageReader(store, 99))


class _Runs:
    """An object whose pickle runs a command when unpickled (``os.system``), as a hostile save's is."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self) -> tuple:
        import os

        return (os.system, (self.command,))


def _failures(caught: pytest.ExceptionInfo[CheckpointException]) -> list[BaseException]:
    return [error for error, _ in caught.value.failures.values()]


def test_an_object_item_beyond_the_allowlist_is_committed_but_never_run_by_a_load(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A DCP folder whose object item's pickle runs a command: committed whole (with a warning),
    saved the same through the writer, and refused by every load with one line naming the item and
    the global, the command never run; a caller who trusts the store's objects says so by name."""
    from tailorstore.core.errors import Category, UnsafePickleError
    from tailorstore.integrations.dcp.writer import TailorStorageWriter

    ran = tmp_path / "ran"
    state = _state(1, 3)
    state["train"]["hook"] = _Runs(f"touch {ran}")
    dcp.save(state, checkpoint_id=str(tmp_path / "step-3"))
    assert not ran.exists()
    with Store.init(tmp_path / "store") as store:
        with caplog.at_level("WARNING", logger="tailorstore"):
            store.commit(tmp_path / "step-3")
            dcp.save(state, storage_writer=TailorStorageWriter(store, step=4))
        warned = [r.getMessage() for r in caplog.records if "pickle allowlist" in r.getMessage()]
        assert len(warned) == 2 and all("train.hook" in w and "posix.system" in w for w in warned), warned
        for step in (3, 4):
            with pytest.raises(CheckpointException) as caught:
                dcp.load(_state(9, 0) | {"train": {"step": 0, "note": "", "hook": None}},
                         storage_reader=TailorStorageReader(store, step))  # fmt: skip
            (error,) = _failures(caught)
            assert isinstance(error, UnsafePickleError) and error.category is Category.BAD_INPUT
            assert "train.hook" in str(error) and "posix.system" in str(error) and "trust_objects=True" in str(error)
            assert not ran.exists(), "the load ran the object's pickle"
        # the model and the allowlisted objects load without the hostile one
        loaded = {"model": _state(9, 0)["model"], "train": {"step": 0, "note": ""}}
        from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

        partial = DefaultLoadPlanner(allow_partial_load=True)
        dcp.load(loaded, storage_reader=TailorStorageReader(store, 3), planner=partial)
        assert _equal(loaded["model"], state["model"]) and loaded["train"] == {"step": 3, "note": "seed 1"}
        trusted = _state(9, 0) | {"train": {"step": 0, "note": "", "hook": None}}
        dcp.load(trusted, storage_reader=TailorStorageReader(store, 3, trust_objects=True))
        assert ran.exists(), "trust_objects=True hands DCP the object as it was saved"
        ran.unlink()
        # a checkout writes the folder byte for byte, which DCP's own reader would run: only when trusted
        with pytest.raises(UnsafePickleError, match="outside the allowlist"):
            store.checkout("step=3", tmp_path / "out")
        assert not (tmp_path / "out").exists()
        store.checkout("step=3", tmp_path / "out", trust_pickles=True)
        saved = tmp_path / "step-3" / "__0_0.distcp"
        assert (tmp_path / "out" / "__0_0.distcp").read_bytes() == saved.read_bytes()
        assert store.verify(deep=True).ok and not ran.exists()


class _Resized:
    """A load planner whose destination for one tensor is not the size of the chunk it asks for."""

    def __new__(cls, fqn: str, shape: tuple[int, ...]):  # type: ignore[no-untyped-def]
        from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

        class Planner(DefaultLoadPlanner):
            def resolve_tensor(self, read_item):  # type: ignore[no-untyped-def]
                if read_item.dest_index.fqn == fqn:
                    return torch.zeros(shape)
                return super().resolve_tensor(read_item)

        return Planner()


@pytest.mark.parametrize("shape", [(0,), (32, 16), (128, 16)], ids=["empty", "smaller", "larger"])
def test_a_destination_that_does_not_fit_its_chunk_is_a_size_mismatch(two_steps, shape: tuple[int, ...]) -> None:
    """FileSystemReader refuses a destination of another size than the chunk the plan asks for;
    so does the reader, as bad input naming the item (an empty one loaded nothing, and the others
    were called store damage)."""
    from tailorstore.core.errors import Category

    store, _, folders = two_steps
    with pytest.raises(CheckpointException):  # DCP's own reader, for comparison
        dcp.load(_state(9, 0), checkpoint_id=str(folders[6]), planner=_Resized("model.0.weight", shape))
    with pytest.raises(CheckpointException) as caught:
        dcp.load(_state(9, 0), storage_reader=TailorStorageReader(store, 6), planner=_Resized("model.0.weight", shape))
    (error,) = _failures(caught)
    assert isinstance(error, StoreError) and not isinstance(error, CorruptStoreError), error
    assert error.category is Category.BAD_INPUT and "size mismatch" in str(error) and "model.0.weight" in str(error)


def test_a_thinned_step_loads_its_model_and_says_it_was_thinned(two_steps, tmp_path: Path) -> None:
    """gc thins step 3 to weights (its moments go): asking for the whole state says the step was
    thinned, as checkout does, and loads nothing; the model alone loads as saved."""
    from tailorstore.core.errors import ThinnedStepError

    store, saved, _ = two_steps
    store.gc(Retention(keep_last=1, thin="weights"))
    assert store.verify(deep=True).ok
    ours = _state(9, 0)
    before = {k: v.clone() for k, v in ours["model"].items()}
    with pytest.raises(CheckpointException) as caught:
        dcp.load(ours, storage_reader=TailorStorageReader(store, 3))
    (error,) = _failures(caught)
    assert isinstance(error, ThinnedStepError) and "thinned to weights" in str(error), error
    assert "exp_avg" in str(error) and "model alone" in str(error)
    assert _equal(ours["model"], before), "nothing was loaded"
    model = {"model": _state(9, 0)["model"]}
    dcp.load(model, storage_reader=TailorStorageReader(store, 3))
    assert _equal(model["model"], saved[3]["model"])


def test_a_composite_step_loads_with_the_warning_a_checkout_gives(tmp_path: Path, caplog) -> None:
    """A step whose layers come from earlier steps (a parity commit) loads as its checkout does,
    with the shared composite warning; a whole step loads without one."""
    store = Store.init(tmp_path / "store")
    try:
        for step, policy in ((3, "full"), (6, "parity")):
            dcp.save(_state(step, step), checkpoint_id=str(tmp_path / f"step-{step}"))
            store.commit(tmp_path / f"step-{step}", policy=policy)
        inherited = store.checkout("step=6", tmp_path / "out").inherited
        assert inherited, "the parity commit inherits layers"
        for step, composite in ((3, False), (6, True)):
            caplog.clear()
            with caplog.at_level("WARNING", logger="tailorstore"):
                ours, theirs = _state(9, 0), _state(9, 0)
                dcp.load(ours, storage_reader=TailorStorageReader(store, step))
            warned = [r.getMessage() for r in caplog.records if "a composite" in r.getMessage()]
            assert len(warned) == int(composite), warned
            if composite:
                dcp.load(theirs, checkpoint_id=str(tmp_path / "out"))
                assert _equal(ours, theirs) and f"resuming from step {step}" in warned[0]
    finally:
        store.close()
