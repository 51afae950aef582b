"""``TailorCheckpointEngine``: DeepSpeed's checkpoint engine, saving into the store.

The engine is DeepSpeed's ``CheckpointEngine`` interface over two halves that share what the start
left (:class:`.startup.Started`: the rank session, this rank's store handle, the engine's staging
folder) and the engine's :class:`..common.rewind.Rewind`:

- the save path (:mod:`.save_path`): ``create``, ``makedirs``, ``save`` and ``commit``, as DeepSpeed
  calls them on every rank for each save, then the commit on global rank 0 (or each node's leader);
- the load path (:mod:`.load_path`): ``engine.load_checkpoint`` through the store, and ``load`` of
  each file DeepSpeed reads while it resumes.

Building one runs no collective and commits nothing: the start-up (recovering what a killed job
left in staging and in the store's parts) is :func:`.startup.start_up`'s, which ``attach`` runs
once, before it builds the engine (:mod:`.attaching`). ``flush`` before exit, on every rank.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo, CheckpointEngine

from tailorstore.core.policies import Policy
from tailorstore.integrations.common.rewind import Rewind
from tailorstore.integrations.deepspeed.helpers import ENGINE_NAME
from tailorstore.integrations.deepspeed.load_path import LoadPath
from tailorstore.integrations.deepspeed.save_path import SavePath
from tailorstore.integrations.deepspeed.startup import Started


class TailorCheckpointEngine(CheckpointEngine):
    """A DeepSpeed checkpoint engine whose saves go into a tailorstore store.

    Build it with :func:`attach`, which starts it (:func:`.startup.start_up`) and also routes
    ``engine.load_checkpoint`` through it. ``policy`` and its parameters choose the layers stored at
    each step, as in ``Store.commit``; ``on_existing`` what a save of a step the store holds does.
    """

    def __init__(
        self,
        started: Started,
        *,
        policy: str | Policy = "full",
        asynchronous: bool = True,
        global_steps: Callable[[], int] | None = None,
        on_existing: str = "branch",
        shape: Callable[[], tuple[int, int]] | None = None,
        snapshot: bool = True,
        gpu_buffers: bool | None = None,
        metrics: Callable[[int | None], Mapping[str, float] | None] | None = None,
        staged_resume: bool = False,
        **policy_params: float,
    ) -> None:
        super().__init__(None)
        self.name = ENGINE_NAME
        self.started = started
        self.store, self.session, self.folder = started.store, started.session, started.folder
        self.recovered = started.recovered
        self.rewind = Rewind(on_existing)  # a save of a step the store holds: a rewind (common/rewind.py)
        self.saves = SavePath(
            started, self.rewind, policy=policy, policy_params=policy_params, asynchronous=asynchronous,
            global_steps=global_steps, snapshot=snapshot, gpu_buffers=gpu_buffers, metrics=metrics,
        )  # fmt: skip
        self.loads = LoadPath(started, self.rewind, shape=shape, staged_resume=staged_resume)

    # -- what DeepSpeed calls while saving: the save path ------------------------------------
    def create(self, info: CheckpointCommitInfo) -> None:
        self.saves.create(info)

    def makedirs(self, path: str | os.PathLike, exist_ok: bool = False) -> None:
        self.saves.makedirs(path, exist_ok)

    def save(self, state_dict: Any, path: str) -> None:
        self.saves.save(state_dict, path)

    def commit(self, info: CheckpointCommitInfo) -> bool:
        return self.saves.commit(info)

    def before_change(self) -> None:
        """The saved tensors are about to change (an optimizer step): on a GPU, the training stream
        waits for the last save's copies (:mod:`.side_copy`); the host does not wait. :func:`attach`
        calls it before each optimizer step; call it before changing them any other way."""
        self.saves.before_change()

    def set_metrics(self, metrics: Mapping[str, float]) -> None:
        """Metrics recorded with the next save's step (``{"eval_loss": 2.31}``), on global rank 0;
        ``gc --keep-best`` reads them. Checked now, so a bad name fails here, not in the background."""
        self.saves.set_metrics(metrics)

    # -- what DeepSpeed calls while resuming: the load path ----------------------------------
    def load(self, path: str, map_location: Any = None) -> Any:
        return self.loads.load(path, map_location)

    def load_checkpoint(self, original: Callable[..., Any], load_dir: str, tag: str | None = None, **kw: Any) -> Any:
        """``engine.load_checkpoint`` through the store (:meth:`.load_path.LoadPath.load_checkpoint`)."""
        return self.loads.load_checkpoint(original, load_dir, tag, **kw)

    # -- lifecycle ---------------------------------------------------------------------
    def flush(self) -> None:
        """Wait for the files still being written (every rank) and the commits in flight, and raise
        the first failure (where this rank commits)."""
        self.saves.flush()

    def cleanup(self) -> None:
        self.flush()
