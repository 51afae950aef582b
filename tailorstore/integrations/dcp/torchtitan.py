"""torchtitan's checkpoint manager over the store: every save goes straight into it, a restart
resumes from it, and ``keep_latest_k`` is the store's own retention.

torchtitan's ``CheckpointManager`` saves with ``dcp.save`` or ``dcp.async_save`` to a folder
``step-N`` under ``checkpoint.folder``, finds the step to resume from by listing that folder, and
purges old steps by deleting folders. :class:`TailorCheckpointManager` keeps every rule of its own
(when to save, what the state is, what the first step and the last one hold, the async modes,
initial loads from a folder or from Hugging Face) and changes only where the bytes go. (The
pinned-memory mode is passed through with its stager and process checkpointer; it pins memory,
which needs a GPU, so the tests run the sync and thread-async modes.)

- ``dcp_save``: the same ``dcp.save``/``dcp.async_save`` call, with
  :class:`~tailorstore.integrations.dcp.writer.TailorStorageWriter` as its storage writer: each
  rank's tensors become atoms in the store, no raw file is written, and the step is recorded
  when the save finishes (its ``checkpoint_id``, ``.../step-N``, names the step). The last
  step's Hugging Face export (``last_save_in_hf``) is a folder of safetensors for other tools,
  and is written as torchtitan writes it;
- ``_load``: the newest step of the store's run (or the one asked for), resolved on rank 0 and
  loaded by every rank through
  :class:`~tailorstore.integrations.dcp.reader.TailorStorageReader` (DCP reshards at any world
  size). A store without steps falls back to torchtitan's own rules: an initial load from a
  folder or from Hugging Face, or a fresh start;
- ``_purge_stale_checkpoints``: rank 0 runs ``gc(keep_last=..., run=<the job's run>)`` on a thread of
  its own, one at a time, as torchtitan's purge thread deletes folders. Only the job's own run is
  thinned: other trainings sharing the store keep their steps. torchtitan's rule keeps the
  ``keep_latest_k`` newest steps counting the save just made, which in the async modes is still in
  flight: so while it is, the gc keeps ``keep_latest_k - 1`` recorded steps (the save in flight is
  the k-th; at least one), and once it is recorded, ``keep_latest_k`` (:class:`Purge`).

Use it in a torchtitan config in place of the default manager::

    checkpoint=TailorCheckpointManager.Config(
        store="s3://bucket/ckpts", interval=500, keep_latest_k=3, async_mode="async", policy="parity"
    )

Needs torchtitan (0.3.0) and its ``tyro``; tested with both installed without the rest of
torchtitan's dependencies (tests/system/test_torchtitan.py).
"""

from __future__ import annotations

import gc
import logging
import queue
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from torchtitan.components.checkpoint import MODEL, AsyncMode, CheckpointManager

from tailorstore import MAIN_RUN, CommitRequest, Retention
from tailorstore.api import Store
from tailorstore.core.errors import UnknownStepError
from tailorstore.integrations.common.distributed import from_rank0
from tailorstore.integrations.common.ranks import is_distributed, rank
from tailorstore.integrations.common.store_session import StoreSession, step_from_name
from tailorstore.integrations.dcp.reader import TailorStorageReader
from tailorstore.integrations.dcp.writer import TailorStorageWriter

if TYPE_CHECKING:
    from tailorstore import GcPlan

log = logging.getLogger("tailorstore")

NO_STEP = -1  # torchtitan's word for "nothing to resume from"


class TailorCheckpointManager(CheckpointManager):
    """torchtitan's ``CheckpointManager``, saving into and resuming from a tailorstore."""

    @dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):
        store: str = ""
        """The store's location (a folder or ``s3://bucket/prefix``); empty: ``$TAILOR_STORE``."""

        run: str = ""
        """The store's run the steps go to and resume from; empty: ``main``."""

        policy: str = "full"
        """The layer policy of each save: ``full``, ``parity`` or ``filter`` (docs/API.md)."""

    def __init__(self, config: Config, **components: Any) -> None:
        super().__init__(config, **components)
        if not self.enable:
            return
        self.store = Store.open(config.store or None, run=config.run or MAIN_RUN)
        self.request = CommitRequest(policy=config.policy)
        self.request.spec()  # a policy that does not exist is refused now, not at the first save
        self._gc_queue: queue.Queue[Purge | None] = queue.Queue()
        self._saving: int | None = None  # the step of the last dcp_save into the store
        self._gc_thread: threading.Thread | None = None

    # -- where the bytes go ------------------------------------------------------------------------
    @torch.no_grad()
    def dcp_save(
        self,
        state_dict: dict[str, Any],
        checkpoint_id: str,
        async_mode: AsyncMode,
        enable_garbage_collection: bool = False,
        to_hf: bool = False,
    ) -> Any:
        if to_hf:  # a Hugging Face folder for other tools, as torchtitan writes it
            return super().dcp_save(state_dict, checkpoint_id, async_mode, enable_garbage_collection, to_hf)
        writer = TailorStorageWriter(self.store, request=self.request)  # checkpoint_id names the step
        self._saving = step_from_name(PurePosixPath(checkpoint_id).name)
        if async_mode == AsyncMode.ASYNC:
            done = dcp.async_save(state_dict, storage_writer=writer, checkpoint_id=checkpoint_id, process_group=self.pg)
        elif async_mode == AsyncMode.ASYNC_WITH_PINNED_MEM:
            done = dcp.async_save(
                state_dict,
                storage_writer=writer,
                checkpoint_id=checkpoint_id,
                process_group=self.pg,
                async_checkpointer_type=AsyncCheckpointerType.PROCESS,
                async_stager=self.stager,
            )
        else:
            done = dcp.save(state_dict, storage_writer=writer, checkpoint_id=checkpoint_id)
        if enable_garbage_collection:
            gc.collect()
        return done

    def _load(self, step: int = -1) -> bool:
        found = self._find_load_step() if step == NO_STEP else step
        if found == NO_STEP or not self._held(found):
            return super()._load(step)  # nothing in the store: torchtitan's initial loads, or a fresh start
        states = self._states_to_load(model_only=found == 0)  # step 0 is torchtitan's model-only seed
        dcp.load(states, storage_reader=TailorStorageReader(self.store, f"step={found}"))
        if MODEL in self.states:  # torchtitan flattens the model's states into the top level
            self.states[MODEL].load_state_dict(states)
        log.info("tailorstore: resumed from step %d of %s", found, self.store.location)
        return True

    def _find_load_step(self, folder: str = "") -> int:
        """The newest step of the store's run, as rank 0 sees it, on every rank (-1: none)."""
        if folder:  # torchtitan asks about a folder of its own: its rule
            return super()._find_load_step(folder)

        def newest() -> int:
            try:
                return self.store.step("latest").step
            except UnknownStepError:
                return NO_STEP

        return from_rank0(newest, None, "finding the step to resume from") if is_distributed() else newest()

    def _held(self, step: int) -> bool:
        if not is_distributed():
            return StoreSession(self.store).holds(step)
        return from_rank0(lambda: StoreSession(self.store).holds(step), None, f"looking for step {step}")

    # -- retention ---------------------------------------------------------------------------------
    def _purge_stale_checkpoints(self) -> None:
        if self.keep_latest_k <= 0 or rank() != 0:
            return
        if self._gc_thread is None:
            self._gc_thread = threading.Thread(target=self._collect, name="tailor-gc", daemon=True)
            self._gc_thread.start()
        in_flight = self.save_future if self.async_mode != AsyncMode.DISABLED else None
        self._gc_queue.put(Purge(self.keep_latest_k, in_flight, self._saving))

    def _collect(self) -> None:
        """gc of the job's run, one request at a time; a failed gc is said and the next one tried,
        as torchtitan's purge thread goes on after a failed deletion. The thread has a handle of
        its own (its own index connection): an async save's thread uses the manager's meanwhile,
        and the store lock, not a shared handle, orders the two."""
        own: Store | None = None
        while (request := self._gc_queue.get()) is not None:
            try:
                own = own or Store.open(self.store.location, run=self.store.run)
                request.run(own)
            except Exception as exc:
                log.warning("tailorstore: gc after a save failed: %s", exc)
        if own is not None:
            own.close()

    def _close(self) -> None:
        super()._close()
        if getattr(self, "_gc_thread", None) is not None:
            self._gc_queue.put(None)
            self._gc_thread.join()
            self._gc_thread = None


class _Landed(Exception):
    """The save counted as in flight was recorded before the gc took its lock."""


@dataclass(frozen=True)
class Purge:
    """One ``keep_latest_k`` request: torchtitan's rule keeps the k newest steps counting the save
    just made (``step``). While that save is in flight (an async save's ``in_flight`` not done) the
    k-1 newest recorded steps stay beside it (at least one), else the k newest. Whether it is
    recorded yet is decided where the gc plans, under the store's exclusive lock (a save's commit
    point waits for it), so a save that lands meanwhile is never counted twice."""

    keep_latest_k: int
    in_flight: Future[Any] | None = None
    step: int | None = None

    def run(self, store: Store) -> None:
        if self.in_flight is None or self.in_flight.done() or self.step is None or self.keep_latest_k <= 1:
            store.gc(Retention(keep_last=self.keep_latest_k, run=store.run))
            return
        saving = self.step

        def not_yet_recorded(plan: GcPlan) -> None:
            if any(step == saving for _, step in (*plan.keep, *plan.drop)):
                raise _Landed  # before anything is deleted: the gc lets go of its lock and deletes nothing

        try:
            store.gc(Retention(keep_last=self.keep_latest_k - 1, run=store.run), show_plan=not_yet_recorded)
        except _Landed:
            store.gc(Retention(keep_last=self.keep_latest_k, run=store.run))
