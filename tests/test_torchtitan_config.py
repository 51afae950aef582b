"""TailorCheckpointManager's configuration, without a training (fast tier)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tailorstore import Store
from tailorstore.core.errors import PolicyError
from tailorstore.integrations.torchtitan import TailorCheckpointManager


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
