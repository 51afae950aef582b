"""tailorstore as Megatron-Core's storage layer: ``dist_checkpointing`` save and load strategies
whose tensors go straight into the store and come straight out of it.

    from tailorstore.integrations.megatron import TailorLoadShardedStrategy, TailorSaveShardedStrategy

    dist_checkpointing.save(sharded_state_dict, "ckpts/iter_0000100",
                            sharded_strategy=TailorSaveShardedStrategy(store))
    dist_checkpointing.load(sharded_state_dict, "ckpts/iter_0000100",
                            sharded_strategy=TailorLoadShardedStrategy(store, "step=100"))

Saving: the strategy translates Megatron's ``ShardedTensor`` s to DCP's as Megatron's own
``torch_dist`` strategy does (its ``_replace_state_dict_keys_with_sharded_keys`` and
``mcore_to_pyt_state_dict``, its ``MCoreSavePlanner``), and saves them with DCP through
:class:`MegatronStorageWriter`: each rank commits its chunks as its part of the step, the
coordinator then commits ``.metadata`` with ``common.pt`` and ``metadata.json`` and finalizes the
step, fenced as every commit is (the step's commit point; a save that fails or a rank killed before
it records nothing). The step is of layout ``megatron``, named as a commit of the folder names it,
and checks out as the folder Megatron's own strategy writes, which ``dist_checkpointing.load`` reads.

What still touches ``checkpoint_dir``, and why: Megatron-Core (0.16) refuses any common strategy
but its own (``save`` raises ``NotImplementedError('The only supported common strategy is
torch')``), so rank 0's ``common.pt`` (a few KB: the non-sharded state) is written there by Megatron
before the sharded save starts, and read from there into the step; and Megatron writes
``metadata.json`` there after it. Loading, Megatron's ``load`` reads ``metadata.json`` and
``common.pt`` from ``checkpoint_dir`` before it asks any strategy, so the folder a save through the
strategy leaves (those two files) is what a load through it names; the tensors come from the store.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from megatron.core.dist_checkpointing.core import CheckpointingConfig
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest
from megatron.core.dist_checkpointing.strategies.base import AsyncSaveShardedStrategy
from megatron.core.dist_checkpointing.strategies.state_dict_saver import (
    save_state_dict_async_finalize,
    save_state_dict_async_plan,
)
from megatron.core.dist_checkpointing.strategies.torch import (
    MCoreLoadPlanner,
    MCoreSavePlanner,
    TorchDistLoadShardedStrategy,
    _replace_sharded_keys_with_state_dict_keys,
    _replace_state_dict_keys_with_sharded_keys,
    _restore_dict_types,
    _unwrap_pyt_sharded_tensor,
    mcore_to_pyt_state_dict,
)

from tailorstore import CommitRequest
from tailorstore.api import Ref, Store
from tailorstore.core.errors import StoreError
from tailorstore.integrations.common.store_session import (
    MEGATRON,
    MemoryFolder,
    StoreSession,
    megatron_format,
    opened_store,
)
from tailorstore.integrations.dcp.reader import TailorStorageReader
from tailorstore.integrations.dcp.writer import RankOrders, TailorStorageWriter, rank_metadata, serialize

BACKEND, VERSION = "torch_dist", 1  # what the step's metadata.json says: Megatron's own loader reads it


class MegatronStorageWriter(TailorStorageWriter):
    """The DCP writer, for a Megatron save: its parts are of layout ``megatron`` (an ``iter_N``
    folder), its chunks named by ``ShardedTensor`` key and layer, and the coordinator's last part
    holds ``common.pt`` (read from ``common``) and ``metadata.json`` beside ``.metadata``."""

    megatron = True

    def __init__(self, store: Store | str | os.PathLike, *, common: Path, step: int, **options: Any) -> None:
        super().__init__(store, step=step, **options)
        self.common = common

    def folder(self, step: int) -> MemoryFolder:
        return MemoryFolder(tag=megatron_format.iteration_folder(step), step=step, kind=MEGATRON)

    def beside(self) -> dict[str, bytes]:
        try:
            common = self.common.read_bytes()
        except FileNotFoundError:
            raise StoreError(
                f"{self.common}: no common.pt, which Megatron's save writes on rank 0 before the sharded save; "
                "save through dist_checkpointing.save(..., sharded_strategy=TailorSaveShardedStrategy(store))."
            ) from None
        config = json.dumps(asdict(CheckpointingConfig(BACKEND, VERSION))).encode()  # as Megatron's save_config
        return {megatron_format.COMMON: common, megatron_format.CONFIG: config}


class MegatronAsyncWriter(MegatronStorageWriter):
    """The writer of an async save, driven by Megatron's own async planner and finalizer
    (``save_state_dict_async_plan`` and ``..._finalize``, whose collectives are Megatron's): the plan
    and a copy of this rank's tensors are made while training waits (``prepare_write_data``: the
    copy is what Megatron's own async save makes, so that training may change its tensors); the
    part's commit (hashing, compression, the blob and part writes) runs in Megatron's async
    process (``get_save_function_and_args``); the coordinator's ``finish`` in the finalization,
    after every rank's process is done, commits ``.metadata`` and finalizes the step."""

    def __init__(self, store: Store | str | os.PathLike, *, common: Path, step: int, **options: Any) -> None:
        super().__init__(store, common=common, step=step, **options)
        self.reset()
        self._pending: tuple[MemoryFolder, RankOrders] | None = None
        self._results: list[Any] = []

    def prepare_write_data(self, plan: Any, planner: Any) -> None:
        orders = plan.storage_data
        if not isinstance(orders, RankOrders):
            raise StoreError("prepare_write_data before prepare_global_plan: Megatron's planner calls them so")
        folder = self.folder(orders.step)
        try:
            file = folder.add(orders.file_name)
            self._results = serialize(file, orders.file_name, plan.items, _Copies(planner))
            folder.dcp_metadata = rank_metadata(plan, self._results, orders, self.megatron, file.lent)
        except BaseException:
            folder.close()
            raise
        self._pending = (folder, orders)

    def get_save_function_and_args(self) -> tuple[Any, Any, tuple]:
        return commit_pending, None, (self,)

    def retrieve_write_results(self) -> list[Any]:
        return self._results

    def close(self) -> None:
        """Free the memory folder and the tensors' copies (once the step is finalized, or failed)."""
        if self._pending is not None:
            self._pending[0].close()
            self._pending = None


class _Copies:
    """A planner whose tensors are copies: an async save's bytes are those of the moment it began."""

    def __init__(self, planner: Any) -> None:
        self.planner = planner

    def resolve_data(self, item: Any) -> Any:
        data = self.planner.resolve_data(item)
        return data.detach().to("cpu", copy=True) if isinstance(data, torch.Tensor) else data


def commit_pending(writer: MegatronAsyncWriter) -> None:
    """Megatron's async function: this rank's part, committed (in the process Megatron starts)."""
    if writer._pending is None:
        raise StoreError("an async Megatron save with nothing prepared: Megatron's planner calls prepare_write_data")
    folder, orders = writer._pending
    StoreSession(writer.store).commit_memory(folder, writer.request, part_label=orders.label, plan=orders.plan)


class TailorSaveShardedStrategy(AsyncSaveShardedStrategy):
    """Megatron's ``torch_dist`` sharded save, into ``store``: the step is ``step``, or the
    iteration the checkpoint folder's name carries (``iter_0000100``). Options are a commit's
    (``policy``, ``tag``, ``metrics``...). Sync (``dist_checkpointing.save(...)``) or async
    (``async_sharded_save=True``, the request scheduled on Megatron's ``AsyncCallsQueue``): the
    step is recorded once, when the coordinator finalizes it, and not at all if a rank fails or
    dies before."""

    def __init__(
        self,
        store: Store | str | os.PathLike,
        *,
        step: int | None = None,
        request: CommitRequest | None = None,
        keep_only_main_replica: bool = True,
        **options: Any,
    ) -> None:
        super().__init__(BACKEND, VERSION)
        self.store = opened_store(store)
        self.step = step
        self.request = CommitRequest.of(request, options)
        self.keep_only_main_replica = keep_only_main_replica

    @property
    def can_handle_sharded_objects(self) -> bool:
        return True  # as Megatron's torch_dist: ShardedObjects are DCP bytes items

    def _step(self, folder: Path) -> int:
        step = self.step if self.step is not None else megatron_format.step_of(folder.name)
        if step is None:
            raise StoreError(
                f"{folder}: names no iteration (iter_NNNNNNN); pass TailorSaveShardedStrategy(store, step=N)."
            )
        return step

    def _translated(self, sharded_state_dict: dict[str, Any]) -> tuple[dict[str, Any], MCoreSavePlanner]:
        """Megatron's ShardedTensors as DCP's, and Megatron's planner, as its torch_dist strategy makes them."""
        state, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded_state_dict, self.keep_only_main_replica)
        planner = MCoreSavePlanner(dedup_replicated_tensors=not self.keep_only_main_replica, flatten_state_dict=False)
        return mcore_to_pyt_state_dict(state, False), planner

    def save(self, sharded_state_dict: dict[str, Any], checkpoint_dir: str | Path) -> None:
        folder = Path(checkpoint_dir)
        step = self._step(folder)
        writer = MegatronStorageWriter(
            self.store, common=folder / megatron_format.COMMON, step=step, request=self.request
        )
        state, planner = self._translated(sharded_state_dict)
        dcp.save(state, storage_writer=writer, planner=planner)

    def async_save(self, sharded_state_dict: dict[str, Any], checkpoint_dir: str | Path) -> AsyncRequest:
        folder = Path(checkpoint_dir)
        writer = MegatronAsyncWriter(
            self.store, common=folder / megatron_format.COMMON, step=self._step(folder), request=self.request
        )
        state, planner = self._translated(sharded_state_dict)
        try:
            planned = save_state_dict_async_plan(state, writer, None, 0, planner=planner)[0]
        except BaseException:
            writer.close()
            raise
        save_fn, preload_fn, args = writer.get_save_function_and_args()
        return AsyncRequest(save_fn, args, [partial(_finalize, writer, planned)], preload_fn=preload_fn)


def _finalize(writer: MegatronAsyncWriter, planned: tuple) -> None:
    """Megatron's finalization of an async save (every rank, after every rank's process is done):
    the coordinator commits ``.metadata`` and finalizes the step; then the copies are freed."""
    try:
        save_state_dict_async_finalize(*planned)
    finally:
        writer.close()


class TailorLoadShardedStrategy(TorchDistLoadShardedStrategy):
    """Megatron's ``torch_dist`` sharded load, from step ``ref`` of ``store``: every chunk each
    rank's ``ShardedTensor`` s ask for, at any tensor, pipeline or data parallel layout, read
    straight from the store and hash-checked (:class:`TailorStorageReader`); object items only
    through the pickle allowlist unless ``trust_objects``."""

    def __init__(self, store: Store | str | os.PathLike, ref: Ref = "latest", *, trust_objects: bool = False) -> None:
        super().__init__()
        self.store, self.ref, self.trust_objects = opened_store(store), ref, trust_objects

    def reader(self) -> TailorStorageReader:
        return TailorStorageReader(self.store, self.ref, trust_objects=self.trust_objects)

    def load(self, sharded_state_dict: dict[str, Any], checkpoint_dir: str | Path) -> dict[str, Any]:
        """What Megatron's ``TorchDistLoadShardedStrategy.load`` does, with the store's reader for
        the folder's (``strategies/torch.py``)."""
        flexible = [t for t in _sharded_tensors(sharded_state_dict) if not t.allow_shape_mismatch]
        mismatch = {t.key: t for t in _sharded_tensors(sharded_state_dict) if t.allow_shape_mismatch}
        original = sharded_state_dict
        state, flat_mapping, rename_mapping = _replace_state_dict_keys_with_sharded_keys(sharded_state_dict)
        pyt_state_dict = mcore_to_pyt_state_dict(state, True)
        reader = self.reader()
        planner = MCoreLoadPlanner(
            shapes_validation_sharded_tensors=flexible, allow_shape_mismatch_sharded_tensors=mismatch
        )
        dcp.load(pyt_state_dict, storage_reader=reader, planner=planner)
        loaded = {k: _unwrap_pyt_sharded_tensor(v) for k, v in pyt_state_dict.items()}
        loaded = _replace_sharded_keys_with_state_dict_keys(loaded, flat_mapping, rename_mapping)
        _restore_dict_types(loaded, original)
        return loaded

    def load_tensors_metadata(self, checkpoint_dir: str | Path, metadata: Any = None) -> dict[str, Any]:
        return super().load_tensors_metadata(checkpoint_dir, metadata or self.reader().read_metadata())

    def load_sharded_metadata(self, checkpoint_dir: str | Path) -> dict[str, Any]:
        return self.load_tensors_metadata(checkpoint_dir)


def _sharded_tensors(sharded_state_dict: dict[str, Any]) -> list[Any]:
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    return [t for t in nested_values(sharded_state_dict) if isinstance(t, ShardedTensor)]
