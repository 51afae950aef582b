"""``dcp.load`` through :class:`TailorStorageReader` (issue 50): a stored DCP step is read item by
item from the store, into the memory the state dict keeps, every tensor hash-checked, with no file
written. Real ``dcp.save`` folders, committed to a real store; one process here (DCP without a
process group), two ranks and one in tests/test_dcp.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import blob_object
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict

from tailorstore import Store
from tailorstore.core.errors import CorruptStoreError, StoreError
from tailorstore.integrations.dcp_storage import TailorStorageReader
from tailorstore.store.index.catalogue import Catalogue


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
            store.open_dcp(1)


def test_a_step_the_store_does_not_hold_is_one_error(two_steps) -> None:
    """Rank 0 resolves the ref and hands every rank its answer, a failure too (no rank waits for a
    step id that never comes)."""
    store, _, _ = two_steps
    with pytest.raises(CheckpointException, match="step 99 is not in the store"):
        dcp.load(_state(9, 0), storage_reader=TailorStorageReader(store, 99))
