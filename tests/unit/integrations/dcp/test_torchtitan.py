"""TailorCheckpointManager's configuration, without a training (fast tier)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tailorstore import Store
from tailorstore.core.errors import PolicyError
from tailorstore.integrations.common import StoreSession
from tailorstore.integrations.dcp.torchtitan import TailorCheckpointManager


def build(config: TailorCheckpointManager.Config) -> TailorCheckpointManager:
    model = torch.nn.Linear(4, 4)
    return config.build(
        dataloader=None, model_parts=[model], optimizers=None, lr_schedulers=None, states={}, sd_adapter=None
    )


def test_a_policy_that_does_not_exist_is_refused_when_the_manager_is_built(tmp_path: Path) -> None:
    Store.init(tmp_path / "store").close()
    with pytest.raises(PolicyError, match="unknown policy 'parityy'"):
        build(TailorCheckpointManager.Config(enable=True, store=str(tmp_path / "store"), policy="parityy"))


def test_the_manager_opens_the_store_and_run_its_config_names(tmp_path: Path) -> None:
    Store.init(tmp_path / "store").close()
    config = TailorCheckpointManager.Config(enable=True, store=str(tmp_path / "store"), run="sweep", policy="parity")
    manager = build(config)
    try:
        assert manager.store.run == "sweep" and manager._find_load_step() == -1
    finally:
        manager.close()
        manager.store.close()


def _commit_steps(store: Store, run: str, steps: range, folder: Path) -> None:
    handle = StoreSession(store).in_run(run).store
    for step in steps:
        save = folder / f"{run}-{step}"
        save.mkdir(parents=True)
        torch.save({"w": torch.full((8,), float(step))}, save / "model.pt")
        handle.commit(save, step=step)


def _held(location: Path, run: str) -> list[int]:
    with Store.open(location, run=run) as store:
        return [s.step for s in store.log(run=run)]


def test_keep_latest_k_thins_only_the_jobs_own_run(tmp_path: Path) -> None:
    """Two trainings share a store: a torchtitan job on main with keep_latest_k=2 leaves the other
    run's steps alone (its gc names its run)."""
    with Store.init(tmp_path / "store") as store:
        _commit_steps(store, "other", range(1, 6), tmp_path / "saves")
        _commit_steps(store, "main", range(1, 5), tmp_path / "saves")
    config = TailorCheckpointManager.Config(enable=True, store=str(tmp_path / "store"), keep_latest_k=2)
    manager = build(config)
    try:
        manager._purge_stale_checkpoints()
    finally:
        manager.close()  # joins the gc thread
        manager.store.close()
    assert _held(tmp_path / "store", "main") == [3, 4]
    assert _held(tmp_path / "store", "other") == [1, 2, 3, 4, 5]


def _purge_with_a_save_in_flight(location: Path, step: int, land_first: bool) -> None:
    """The manager's purge right after the async save of ``step`` began (its future not done); with
    ``land_first``, the save is recorded before the gc runs, its future still not done."""
    from concurrent.futures import Future

    from torchtitan.components.checkpoint import AsyncMode

    config = TailorCheckpointManager.Config(enable=True, store=str(location), keep_latest_k=2)
    manager = build(config)
    in_flight: Future[None] = Future()
    try:
        manager.async_mode = AsyncMode.ASYNC  # as the async mode sets it, without its process group
        manager.save_future, manager._saving = in_flight, step  # as _save and dcp_save leave them
        if land_first:
            _commit_steps(manager.store, "main", range(step, step + 1), location.parent / "landed")
        manager._purge_stale_checkpoints()
    finally:
        manager.close()  # joins the gc thread
        manager.store.close()
    if not land_first:
        with Store.open(location) as store:  # the save lands
            _commit_steps(store, "main", range(step, step + 1), location.parent / "landed")
    in_flight.set_result(None)


def test_keep_latest_k_counts_the_save_in_flight_as_torchtitan_does(tmp_path: Path) -> None:
    """torchtitan keeps the k newest steps counting the save just made: with an async save of step
    5 in flight and k=2, one recorded step stays beside it, and two once it is recorded."""
    with Store.init(tmp_path / "store") as store:
        _commit_steps(store, "main", range(1, 5), tmp_path / "saves")
    _purge_with_a_save_in_flight(tmp_path / "store", 5, land_first=False)
    assert _held(tmp_path / "store", "main") == [4, 5]


def test_a_save_recorded_before_the_gc_plans_is_counted_once(tmp_path: Path) -> None:
    """The async save of step 5 is recorded before the gc takes its lock, its future not yet done:
    the gc sees it recorded where it plans, and keeps k steps with it, not k-1."""
    with Store.init(tmp_path / "store") as store:
        _commit_steps(store, "main", range(1, 5), tmp_path / "saves")
    _purge_with_a_save_in_flight(tmp_path / "store", 5, land_first=True)
    assert _held(tmp_path / "store", "main") == [4, 5]
