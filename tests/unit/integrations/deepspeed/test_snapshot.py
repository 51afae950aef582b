"""A snapshot writes the bytes ``torch.save`` of the original would write, from a copy taken at
once: tensors keep their storage sharing, views, dtypes, requires_grad and Parameter type, and
the original may change as soon as the copy returns. Buffers are reused two saves later; what
the snapshot does not know how to copy is refused (the engine then saves at once)."""

from __future__ import annotations

import argparse
import threading
from collections import OrderedDict
from pathlib import Path

import pytest
import torch

from tailorstore.integrations.deepspeed import snapshot


def state() -> dict:
    flat = torch.arange(64, dtype=torch.float32)
    module = torch.nn.Linear(3, 2).state_dict()  # an OrderedDict with _metadata, as a module's state dict is
    return {
        "state_dict": module,
        "module": OrderedDict(w=flat[:16].view(4, 4), b=flat[16:20], t=flat[20:36].view(4, 4).t()),  # one storage
        "bf16": torch.randn(8, 3).to(torch.bfloat16),
        "param": torch.nn.Parameter(torch.ones(5)),
        "groups": [{"step": torch.tensor(3.0), "lr": 0.1, "shape": torch.Size([4, 4])}],
        "meta": ("ds", 7, None, {"x": [1, 2]}),
        "args": argparse.Namespace(lr=0.1),
        "empty": torch.empty(0),
        "also_empty": [torch.empty(0), torch.zeros(0, 3)],  # distinct storages, every one at address 0
    }


def test_the_written_file_is_what_torch_save_writes(tmp_path: Path) -> None:
    original = state()
    (tmp_path / "direct").mkdir()
    torch.save(original, tmp_path / "direct" / "file.pt")
    shots = snapshot.Snapshots(pinned=False)
    shots.begin(1)
    tree, nbytes = shots.copy(original, "file.pt")
    assert nbytes == 64 * 4 + 8 * 3 * 2 + 5 * 4 + 4 + (6 + 2) * 4, "each storage copied once"
    with torch.no_grad():  # training goes on at once: the copy must not see it
        original["module"]["w"].add_(1000)
        original["param"].mul_(7)
    shots.write(tree, tmp_path / "staged" / "file.pt", tmp_path / "real.pt")
    shots.finish(tmp_path, 0)
    shots.drain()
    assert (tmp_path / "staged" / "file.pt").read_bytes() == (tmp_path / "direct" / "file.pt").read_bytes()
    assert [p.name for p in (tmp_path / "staged").iterdir()] == ["file.pt"], "no temporary left behind"
    assert (tmp_path / ".written-0").exists() and not (tmp_path / "real.pt").exists()
    snapshot.await_written(tmp_path, [0], timeout=5)


_marked: set[int] = set()  # live storages whose location the stand-in tagger below builds afresh


def _fresh_cpu_tag(storage: object) -> str | None:
    return "".join(["c", "pu"]) if getattr(storage, "_cdata", None) in _marked else None


_stand_in_registered: list[bool] = []


def test_location_tags_keep_their_identity(tmp_path: Path) -> None:
    """torch's CUDA tagger builds "cuda:0" afresh for every tensor, and the pickler back-references
    a string only when it is the same object; so a snapshot that gave every view of one storage the
    same tag object wrote a shorter file than torch.save of the live GPU state (seen on an H200).
    A tagger that builds "cpu" afresh for the live storages stands in for CUDA's here."""
    if not _stand_in_registered:  # after ours (0), before torch's CPU tagger (10); inert unless marked
        torch.serialization.register_package(5, _fresh_cpu_tag, lambda obj, location: None)
        _stand_in_registered.append(True)
    flat = torch.arange(64, dtype=torch.float32)
    live = {"w": flat[:16].view(4, 4), "b": flat[16:20], "t": flat[20:36].view(4, 4).t(), "own": torch.ones(3)}
    _marked.update({flat.untyped_storage()._cdata, live["own"].untyped_storage()._cdata})
    try:
        (tmp_path / "direct").mkdir()
        torch.save(live, tmp_path / "direct" / "file.pt")
        shots = snapshot.Snapshots(pinned=False)
        shots.begin(1)
        tree, _ = shots.copy(live, "file.pt")
        shots.write(tree, tmp_path / "staged" / "file.pt", tmp_path / "real.pt")
        shots.drain()
    finally:
        _marked.clear()
    assert (tmp_path / "staged" / "file.pt").read_bytes() == (tmp_path / "direct" / "file.pt").read_bytes()


def test_buffers_alternate_between_two_saves(tmp_path: Path) -> None:
    shots = snapshot.Snapshots(pinned=False)
    ptrs = []
    for save in (1, 2, 3):
        shots.begin(save)
        tree, _ = shots.copy({"x": torch.full((1000,), float(save))}, "f.pt")
        ptrs.append(tree["x"].data_ptr())
        shots.write(tree, tmp_path / f"s{save}.pt", tmp_path / f"r{save}.pt")
    shots.drain()
    assert ptrs[0] == ptrs[2] != ptrs[1], "save 3 reuses save 1's buffer, never save 2's"
    assert [torch.load(tmp_path / f"s{s}.pt")["x"][0].item() for s in (1, 2, 3)] == [1.0, 2.0, 3.0]


def test_a_tensor_inside_an_object_is_not_copied_by_halves() -> None:
    shots = snapshot.Snapshots(pinned=False)
    shots.begin(1)
    with pytest.raises(snapshot.Unsupported):
        shots.copy({"scaler": argparse.Namespace(scale=torch.ones(1))}, "f.pt")
    with pytest.raises(snapshot.Unsupported):
        shots.copy({"sparse": torch.eye(3).to_sparse()}, "f.pt")


def test_a_file_staging_cannot_take_goes_where_deepspeed_writes_it(tmp_path: Path) -> None:
    shots = snapshot.Snapshots(pinned=False)
    shots.begin(1)
    tree, _ = shots.copy({"x": torch.ones(3)}, "f.pt")
    blocked = tmp_path / "staging"
    blocked.write_text("a file where the staging folder should be")
    shots.write(tree, blocked / "save" / "f.pt", tmp_path / "real" / "f.pt")
    shots.finish(tmp_path / "markers", 0)
    shots.drain()
    assert torch.equal(torch.load(tmp_path / "real" / "f.pt")["x"], torch.ones(3))
    with pytest.raises(Exception, match="could not write its files"):
        snapshot.await_written(tmp_path / "markers", [0], timeout=5)


def save_once(shots: snapshot.Snapshots, number: int, state: dict, folder: Path) -> dict:
    shots.begin(number)
    tree, _ = shots.copy(state, "f.pt")
    shots.write(tree, folder / f"staged{number}" / "f.pt", folder / f"real{number}.pt")
    shots.finish(folder / f"markers{number}", 0)
    return tree


def test_the_second_save_reuses_buffers_made_ready_after_the_first(tmp_path: Path) -> None:
    """Fresh memory blocked a second save for as long as the first: the writer now readies the
    second generation, with the first save's sizes, once the first save's files are written."""
    shots = snapshot.Snapshots(pinned=False)
    first = {"flat": torch.arange(300_000, dtype=torch.float32), "w": torch.ones(7, 3)}
    save_once(shots, 1, first, tmp_path)
    assert shots._prefault is not None
    shots._prefault.result(timeout=30)
    ready = {b.untyped_storage().data_ptr() for b in shots._buffers[0].values()}
    assert len(ready) == 2
    second = {"flat": torch.arange(300_000, dtype=torch.float32) * 2, "w": torch.zeros(7, 3)}
    tree = save_once(shots, 2, second, tmp_path)
    assert {t.untyped_storage().data_ptr() for t in tree.values()} == ready, "save 2 copied into the ready buffers"
    shots.drain()
    (tmp_path / "direct").mkdir()
    torch.save(second, tmp_path / "direct" / "f.pt")
    assert (tmp_path / "staged2" / "f.pt").read_bytes() == (tmp_path / "direct" / "f.pt").read_bytes()


@pytest.mark.parametrize("spare", [True, False])
def test_the_second_generation_is_readied_only_while_the_node_can_spare_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, spare: bool
) -> None:
    """Buffers taken ahead of a save that may never come must not run the node out of memory:
    every rank of the node takes its own, and they are taken only while as much again stays free."""
    first = {"flat": torch.arange(300_000, dtype=torch.float32)}
    need = 4 * 300_000 * 4  # this rank's bytes, times the node's 4 ranks
    monkeypatch.setattr(snapshot, "available_memory", lambda: 2 * need if spare else 2 * need - 1)
    shots = snapshot.Snapshots(pinned=False, ranks_on_node=4)
    save_once(shots, 1, first, tmp_path)
    assert shots._prefault is not None
    shots._prefault.result(timeout=30)
    assert bool(shots._buffers[0]) == spare
    tree = save_once(shots, 2, {"flat": first["flat"] * 3}, tmp_path)  # either way, save 2 is whole
    shots.drain()
    assert torch.equal(torch.load(tmp_path / "staged2" / "f.pt")["flat"], first["flat"] * 3)
    assert torch.equal(tree["flat"], first["flat"] * 3)


def test_a_second_save_before_the_writer_gets_there_allocates_as_before(tmp_path: Path) -> None:
    shots = snapshot.Snapshots(pinned=False)
    hold = threading.Event()
    shots._writer.submit(hold.wait, 30)  # the writer is busy: the first save's files queue behind this
    save_once(shots, 1, {"x": torch.ones(1000)}, tmp_path)
    prefault = shots._prefault
    assert prefault is not None
    shots.begin(2)  # does not wait for the busy writer
    assert prefault.cancelled()
    tree, _ = shots.copy({"x": torch.zeros(1000)}, "f.pt")
    hold.set()
    shots.write(tree, tmp_path / "staged2" / "f.pt", tmp_path / "real2.pt")
    shots.drain()
    assert torch.equal(torch.load(tmp_path / "staged2" / "f.pt")["x"], torch.zeros(1000))


def test_a_saves_files_are_written_only_once_its_last_file_is_copied(tmp_path: Path) -> None:
    """Writing the first file while the next one was still being copied took a core from the copy:
    the copies are what blocks training, the writes are not."""
    shots = snapshot.Snapshots(pinned=False)
    shots.begin(1)
    first, _ = shots.copy({"w": torch.ones(1000)}, "model.pt")
    shots.write(first, tmp_path / "staged" / "model.pt", tmp_path / "real" / "model.pt")
    shots._writer.submit(lambda: None).result()  # everything handed to the writer so far is done
    assert not (tmp_path / "staged" / "model.pt").exists(), "written while the save was still copying"
    second, _ = shots.copy({"m": torch.zeros(1000)}, "optim.pt")
    shots.write(second, tmp_path / "staged" / "optim.pt", tmp_path / "real" / "optim.pt")
    shots.finish(tmp_path / "markers", 0)
    shots.drain()
    assert torch.equal(torch.load(tmp_path / "staged" / "model.pt")["w"], torch.ones(1000))
    assert torch.equal(torch.load(tmp_path / "staged" / "optim.pt")["m"], torch.zeros(1000))
    assert (tmp_path / "markers" / f"{snapshot.WRITTEN}0").exists()
