""":class:`TailorStorageWriter` in one process (DCP without a process group), a real store, real
``dcp.save``: the step it names, what it refuses before anything is written, and a failure at the
step's commit point records nothing. Two ranks of FSDP2 are in tests/system/test_dcp_writer.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from tailorstore import Store
from tailorstore.integrations.common import StoreSession
from tailorstore.integrations.dcp.reader import TailorStorageReader
from tailorstore.integrations.dcp.writer import TailorStorageWriter
from tests.conftest import parts_of_any_age
from tests.unit.integrations.dcp.test_reader import _equal, _state

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.fixture
def store(tmp_path: Path):
    with Store.init(tmp_path / "store") as opened:
        yield opened


def test_a_save_checks_out_as_filesystemwriter_writes_it_and_loads_back(store: Store, tmp_path: Path) -> None:
    state = _state(1, 3)
    dcp.save(state, storage_writer=TailorStorageWriter(store, step=3))
    dcp.save(state, checkpoint_id=str(tmp_path / "raw"))
    assert [(s.step, s.world_size) for s in store.log()] == [(3, 1)]
    store.checkout("step=3", tmp_path / "out")
    assert (tmp_path / "out" / "__0_0.distcp").read_bytes() == (tmp_path / "raw" / "__0_0.distcp").read_bytes()
    for load in ({"storage_reader": TailorStorageReader(store, "step=3")}, {"checkpoint_id": str(tmp_path / "out")}):
        loaded = _state(9, 0)
        dcp.load(loaded, **load)
        assert _equal(loaded, state)
    assert not [p for p in tmp_path.iterdir() if p.name not in ("store", "raw", "out")]


@pytest.mark.parametrize(("checkpoint_id", "step"), [(7, 7), ("/runs/a/step-12", 12), (Path("ckpt/global_step5"), 5)])
def test_the_step_comes_from_checkpoint_id(store: Store, checkpoint_id: object, step: int) -> None:
    dcp.save(_state(1, step), storage_writer=TailorStorageWriter(store), checkpoint_id=checkpoint_id)
    assert [s.step for s in store.log()] == [step]


def _refused(store: Store, writer: TailorStorageWriter, *words: str, checkpoint_id: object = None) -> None:
    with pytest.raises(CheckpointException) as caught:
        dcp.save(_state(1, 3), storage_writer=writer, checkpoint_id=checkpoint_id)
    for word in words:
        assert word in str(caught.value), (word, str(caught.value))


def test_a_save_without_a_step_writes_nothing(store: Store) -> None:
    _refused(store, TailorStorageWriter(store), "needs the step")
    _refused(store, TailorStorageWriter(store), "names no step", checkpoint_id="/runs/latest")
    assert store.log() == [] and StoreSession(store).parts(3) == []
    used = store.usage()
    assert used.stored_bytes == used.index_bytes  # no blob was written


def test_a_save_of_a_step_the_store_holds_is_refused_and_the_step_kept(store: Store, tmp_path: Path) -> None:
    dcp.save(_state(1, 3), storage_writer=TailorStorageWriter(store, step=3))
    _refused(store, TailorStorageWriter(store, step=3), "already in the store")
    loaded = _state(9, 0)
    dcp.load(loaded, storage_reader=TailorStorageReader(store, "step=3"))
    assert _equal(loaded, _state(1, 3))


def test_a_failure_at_the_commit_point_records_no_step(store: Store) -> None:
    """Finalize refuses a tag another step holds: every part was written, no step is recorded,
    and gc collects the parts."""
    dcp.save(_state(1, 3), storage_writer=TailorStorageWriter(store, step=3, tag="best"))
    _refused(store, TailorStorageWriter(store, step=6, tag="best"), "tag 'best' already names")
    assert [(s.step, s.tag) for s in store.log()] == [(3, "best")]
    assert len(StoreSession(store).parts(6)) == 2  # the rank's file, and .metadata
    with parts_of_any_age():
        store.gc(drop_parts=True)
    assert StoreSession(store).parts(6) == [] and store.verify(deep=True).ok


def test_a_dtype_the_store_does_not_keep_is_refused_before_anything_is_written(store: Store) -> None:
    import torch

    state = {"model": {"w": torch.randn(4, 4, dtype=torch.complex64), "b": torch.zeros(4)}}
    with pytest.raises(CheckpointException) as caught:
        dcp.save(state, storage_writer=TailorStorageWriter(store, step=3))
    assert "model.w is a complex64 tensor, which tailorstore does not store" in str(caught.value)
    assert store.log() == [] and StoreSession(store).parts(3) == []


def test_odd_but_valid_states_load_back_equal(store: Store, tmp_path: Path) -> None:
    """An empty tensor, a 0-dim one, a transposed view (saved contiguous, the same values), and a
    state of objects only."""
    import torch

    states = {
        1: {"model": {"w": torch.empty(0, 4), "b": torch.tensor(3.0), "t": torch.randn(8, 8).t()}},
        2: {"train": {"step": 2, "note": "objects only"}},
    }
    for step, state in states.items():
        dcp.save(state, storage_writer=TailorStorageWriter(store, step=step))
        loaded = {k: {n: torch.zeros_like(v) if isinstance(v, torch.Tensor) else None for n, v in d.items()}
                  for k, d in state.items()}  # fmt: skip
        dcp.load(loaded, storage_reader=TailorStorageReader(store, f"step={step}"))
        assert _equal(loaded, state), step
    assert store.verify(deep=True).ok


def test_a_name_too_long_for_the_metadata_reader_is_refused_before_anything_is_written(store: Store) -> None:
    """A 5,000-character key was saved and recorded, and then the step's own .metadata did not
    read back (every load and checkout failed with exit 3): refused now, nothing written."""
    import torch

    state = {"model": {"x" * 5000: torch.zeros(3), "b": torch.zeros(3)}}
    with pytest.raises(CheckpointException) as caught:
        dcp.save(state, storage_writer=TailorStorageWriter(store, step=3))
    assert "a name of 5006 characters" in str(caught.value)
    assert store.log() == [] and StoreSession(store).parts(3) == []


def test_options_and_the_store_are_checked_when_the_writer_is_built(store: Store, tmp_path: Path) -> None:
    """A misspelt option, a policy the writer cannot apply (budget measures the whole step) and a
    store that is neither a Store nor a location are refused by the constructor, in one line each;
    a location is opened as Store.open opens it."""
    from tailorstore.core.errors import PolicyError, StoreError

    with pytest.raises(PolicyError, match="polcy"):
        TailorStorageWriter(store, step=3, polcy="parity")
    with pytest.raises(PolicyError, match="checkpoint_id"):  # DCP's argument, given to the writer
        TailorStorageWriter(store, checkpoint_id=None)
    for policy in ("budget", "adaptive"):
        with pytest.raises(StoreError, match=f"the {policy} policy measures .* full, parity or filter"):
            TailorStorageWriter(store, step=3, policy=policy)
    for wrong in (None, 3, object()):
        with pytest.raises(StoreError, match="give a Store"):
            TailorStorageWriter(wrong, step=3)  # type: ignore[arg-type]
        with pytest.raises(StoreError, match="give a Store"):
            TailorStorageReader(wrong, 3)  # type: ignore[arg-type]
    assert store.log() == [] and StoreSession(store).parts(3) == []
    for step, location in ((3, str(tmp_path / "store")), (4, tmp_path / "store")):
        dcp.save(_state(1, step), storage_writer=TailorStorageWriter(location, step=step))
        loaded = _state(9, 0)
        dcp.load(loaded, storage_reader=TailorStorageReader(location, f"step={step}"))
        assert _equal(loaded, _state(1, step))


def test_the_writer_tells_the_commit_where_each_tensor_is_and_the_zip_reader_agrees() -> None:
    """The writer watched ``torch.save`` write each tensor into its memory file, so it tells the
    commit where each tensor item's bytes are, and the commit cuts the file without parsing the
    zips again. The torch-free zip reader, parsing the same file, finds every tensor exactly there,
    and the file cut either way is the same: the same skeleton, entries and offsets."""
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    from tailorstore.formats import dcp as dcp_format
    from tailorstore.formats.memory_folder import MemoryFile
    from tailorstore.formats.source import InputFile
    from tailorstore.formats.torch_pickle import read_torch_zip
    from tailorstore.integrations.dcp.writer import RankOrders, rank_metadata, serialize

    planner = DefaultSavePlanner()
    planner.set_up_planner(_state(1, 3), is_coordinator=True)
    plan = planner.create_local_plan()
    orders = RankOrders(step=3, label="dcp.test", rank=0, world_size=1, plan=None)  # type: ignore[arg-type]
    file = MemoryFile(orders.file_name)
    try:
        results = serialize(file, orders.file_name, plan.items, planner)
        told = rank_metadata(plan, results, orders, lent=file.lent)
        untold = rank_metadata(plan, results, orders)
        tensors = [i for i in told.items[orders.file_name] if i.chunk is not None]
        assert len(tensors) > 4 and all(i.data_at is not None for i in tensors)
        assert all(i.data_at is None for i in untold.items[orders.file_name])
        with InputFile(file.path) as src:
            for item in tensors:
                ref, *_ = read_torch_zip(src.window(item.offset, item.length), item.fqn)
                assert item.offset + ref.file_offset == item.data_at, item.fqn
            cut_told = dcp_format.read_distcp(src, orders.file_name, told, "told")
            cut_parsed = dcp_format.read_distcp(src, orders.file_name, untold, "parsed")
        assert cut_told[0] == cut_parsed[0] and cut_told[2] == cut_parsed[2]
        assert _cut(cut_told[1]) == _cut(cut_parsed[1])
        assert [e.file_offset for e in cut_told[1]] == [i.data_at for i in tensors]
    finally:
        file.close()


def _cut(entries: list) -> list[tuple]:
    """Entries by what they say (a ref parsed from its zip is a subclass still tied to its record)."""
    return [
        (e.slot, e.path, e.tensor.dtype, e.tensor.shape, e.tensor.file_offset, e.segments, e.file_offset)
        for e in entries
    ]
