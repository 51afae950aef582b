"""The snapshot's copies out of GPU memory run beside training (integrations/deepspeed/side_copy.py), so what
it writes must still be the state at the save: a change queued right after the save waits for the
copy through the guard, in both ways the copy runs (through GPU buffers and straight to pinned
memory). The CUDA tests run where a GPU is (the device check runs them); the wiring of the guard
into an engine's optimizer runs everywhere."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tailorstore.integrations.deepspeed import snapshot
from tailorstore.integrations.deepspeed.attaching import _guard_changes, _has_persistent_buffers, _torch_optimizers

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


class Counter:
    """Stands in for the engine's tailor: counts the calls the hooks make."""

    def __init__(self) -> None:
        self.calls = 0

    def before_change(self) -> None:
        self.calls += 1


class Wrapper:
    """A ZeRO-like optimizer wrapper: not a torch optimizer, holding one."""

    def __init__(self, inner: torch.optim.Optimizer) -> None:
        self.optimizer = inner


class Engine:
    def __init__(self, module: torch.nn.Module, optimizer: object) -> None:
        self.module, self.optimizer, self.steps = module, optimizer, 0

    def step(self) -> None:
        self.steps += 1


def test_the_guard_runs_before_each_step_of_the_wrapped_torch_optimizer() -> None:
    model = torch.nn.Linear(4, 4)
    inner = torch.optim.AdamW(model.parameters())
    engine, tailor = Engine(model, Wrapper(inner)), Counter()
    assert _torch_optimizers(engine.optimizer) == [inner]
    _guard_changes(engine, tailor)  # type: ignore[arg-type]
    model(torch.ones(2, 4)).sum().backward()
    inner.step()
    assert tailor.calls == 1  # not the forward: a Linear has no buffers a forward may change


def test_without_a_torch_optimizer_the_engine_step_waits() -> None:
    engine, tailor = Engine(torch.nn.Linear(2, 2), object()), Counter()
    _guard_changes(engine, tailor)  # type: ignore[arg-type]
    engine.step()
    assert (tailor.calls, engine.steps) == (1, 1)


def test_a_module_with_running_statistics_waits_before_its_forward() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.BatchNorm1d(3))
    assert _has_persistent_buffers(model)
    rope = torch.nn.Module()
    rope.register_buffer("inv_freq", torch.ones(2), persistent=False)  # not saved: no wait for it
    assert not _has_persistent_buffers(rope)
    engine, tailor = Engine(model, torch.optim.SGD(model.parameters(), lr=0.1)), Counter()
    _guard_changes(engine, tailor)  # type: ignore[arg-type]
    model(torch.ones(4, 3))
    assert tailor.calls == 1


def _state(device: str) -> dict:
    flat = torch.arange(64 << 20, dtype=torch.float32, device=device)  # 256 MB: a copy of some length
    return {"flat": flat, "view": flat[1000:2000], "moment": torch.full((1 << 20,), 3.0, device=device)}


@cuda
@pytest.mark.parametrize("gpu_buffers", [True, False])
def test_a_change_queued_right_after_the_save_is_not_in_the_file(tmp_path: Path, gpu_buffers: bool) -> None:
    state = _state("cuda")
    before = {k: v.cpu().clone() for k, v in state.items()}
    shots = snapshot.Snapshots(pinned=True, device_buffers=gpu_buffers)
    for number in (1, 2, 3):  # the third save reuses the first one's buffers
        shots.begin(number)
        tree, nbytes = shots.copy(state, "f.pt")
        shots.write(tree, tmp_path / f"{number}.pt", tmp_path / "real" / f"{number}.pt")
        shots.finish(tmp_path / "markers", 0)
        shots.guard()  # what attach does before the optimizer step
        for tensor in (state["flat"], state["moment"]):
            tensor.mul_(-1.0).add_(1.0)  # queued at once, while the copy may still run
        shots.drain()
        written = torch.load(tmp_path / f"{number}.pt", map_location="cpu")
        assert all(torch.equal(written[k], before[k]) for k in before), number
        assert written["view"].untyped_storage().data_ptr() == written["flat"].untyped_storage().data_ptr()
        before = {k: v.cpu().clone() for k, v in state.items()}
    assert nbytes == sum(v.untyped_storage().nbytes() for k, v in state.items() if k != "view")
    side = shots._side
    assert side is not None and side.staged_bytes == (nbytes if gpu_buffers else 0)


@cuda
def test_an_optimizer_step_after_the_save_waits_for_the_copy(tmp_path: Path) -> None:
    model = torch.nn.Linear(4096, 4096, device="cuda")
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    engine, shots = Engine(model, optimizer), snapshot.Snapshots(pinned=True)

    class Tailor:
        def before_change(self) -> None:
            shots.guard()

    _guard_changes(engine, Tailor())  # type: ignore[arg-type]
    model(torch.ones(8, 4096, device="cuda")).sum().backward()
    optimizer.step()  # the moments exist
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    before = torch.cat([t.flatten().cpu() for t in state["model"].values()])
    shots.begin(1)
    tree, _ = shots.copy(state, "f.pt")
    shots.write(tree, tmp_path / "f.pt", tmp_path / "real.pt")
    shots.finish(tmp_path / "markers", 0)
    optimizer.step()  # no explicit guard: the hook waits
    shots.drain()
    written = torch.load(tmp_path / "f.pt", map_location="cpu")
    assert torch.equal(torch.cat([t.flatten() for t in written["model"].values()]), before)
    assert not torch.equal(before, torch.cat([t.flatten().cpu() for t in model.state_dict().values()]))
