"""The tiny Llama of ``train_fsdp`` (FSDP2, AdamW, 2 CPU ranks), checkpointed by torchtitan's own
``CheckpointManager`` machinery through :class:`tailorstore.integrations.dcp.torchtitan.TailorCheckpointManager`.

As torchtitan's trainer does: build the manager from its config, ``load()`` before the first
step (a resume when the store holds a step), ``save(step, last_step=...)`` after each step, and
``maybe_wait_for_staging``/``close`` as it does. The optimizer and the learning-rate schedule are
``Stateful`` wrappers of the shape torchtitan's containers have (its own pull in more packages
than this test installs). Rank 0 writes the loss of every step it trained to ``--losses-out``.
Launch with ``torchrun --nproc_per_node 2 -m testbed.train_titan``.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch


class Optimizers:
    """A Stateful optimizer, as torchtitan's ``OptimizersContainer`` is: its state by parameter name."""

    def __init__(self, model: torch.nn.Module, optim: torch.optim.Optimizer) -> None:
        self.model, self.optim = model, optim

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return get_optimizer_state_dict(self.model, self.optim)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        set_optimizer_state_dict(self.model, self.optim, state)


class Schedules:
    """A Stateful learning-rate schedule, as torchtitan's ``LRSchedulersContainer`` is."""

    def __init__(self, schedule: torch.optim.lr_scheduler.LRScheduler) -> None:
        self.schedule = schedule

    def state_dict(self) -> dict[str, Any]:
        return self.schedule.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.schedule.load_state_dict(state)


class TrainState:
    """The step counter, saved as torchtitan saves its ``train_state``."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": torch.tensor(self.step)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])


VOCAB = 128


@dataclass
class ManagedTraining:
    model: torch.nn.Module
    optim: torch.optim.Optimizer
    schedule: torch.optim.lr_scheduler.LRScheduler
    train_state: TrainState
    manager: Any  # TailorCheckpointManager


def managed_training(
    store: str, folder: str, *, interval: int, keep_latest_k: int, async_mode: str, layers: int = 2
) -> ManagedTraining:
    """The tiny FSDP2 Llama, AdamW and its schedule, under torchtitan's manager over the store, as
    torchtitan's trainer builds them (this script and the job-life simulation's torchtitan launches)."""
    from tailorstore.integrations.dcp.torchtitan import TailorCheckpointManager
    from testbed.train_fsdp import build_model, sharded

    model = sharded(build_model(layers, 64, VOCAB))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.LambdaLR(optim, lambda step: 1.0 / (1 + step))
    train_state = TrainState()
    config = TailorCheckpointManager.Config(
        enable=True,
        store=store,
        folder=folder,  # torchtitan's checkpoint.folder: nothing may be written there
        interval=interval,
        keep_latest_k=keep_latest_k,
        async_mode=async_mode,
        last_save_model_only=False,  # the last step resumes too (torchtitan's default saves the model alone)
    )
    manager = config.build(
        dataloader=None,
        model_parts=[model],
        optimizers=Optimizers(model, optim),
        lr_schedulers=Schedules(schedule),
        states={"train_state": train_state},
        sd_adapter=None,
    )
    return ManagedTraining(model, optim, schedule, train_state, manager)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--store", required=True)
    p.add_argument("--folder", required=True, help="torchtitan's checkpoint.folder (nothing may be written there)")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--interval", type=int, default=2)
    p.add_argument("--keep-latest-k", type=int, default=0)
    p.add_argument("--async-mode", default="disabled", choices=("disabled", "async"))
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--losses-out", required=True)
    args = p.parse_args(argv)

    import torch.distributed as dist

    from testbed.train_fsdp import train_step

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    training = managed_training(
        args.store, args.folder, interval=args.interval, keep_latest_k=args.keep_latest_k,
        async_mode=args.async_mode, layers=args.layers,
    )  # fmt: skip
    model, optim, schedule = training.model, training.optim, training.schedule
    train_state, manager = training.train_state, training.manager
    manager.load()
    first = train_state.step + 1
    losses: list[float] = []
    for step in range(first, args.steps + 1):
        losses.append(train_step(model, optim, step, VOCAB))
        schedule.step()
        train_state.step = step
        manager.save(step, last_step=step == args.steps)
        manager.maybe_wait_for_staging()
    manager.maybe_wait_for_saving()
    manager.close()
    if rank == 0:
        Path(args.losses_out).write_text(json.dumps({"first": first, "losses": losses}))
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    main()
