"""tailorstore as PyTorch DCP's storage layer, saving: ``dcp.save(state, storage_writer=...)``
puts each rank's tensors into the store as atoms, with no raw file written anywhere.

    writer = TailorStorageWriter(store, step=100)   # or dcp.save(..., checkpoint_id=100)
    dcp.save(state, storage_writer=writer)
    dcp.async_save(state, storage_writer=writer)     # DCP's stager copies the state first

Each rank serializes its items exactly as ``FileSystemWriter`` does (bytes items, then every
tensor through ``torch.save``), but into an anonymous memory file (``formats/memory_folder.py``)
that holds everything but the tensors' bytes: those stay in the tensors until the commit copies
them, each copy checked against the hash the tensor's memory had as ``torch.save`` wrote it. The
rank commits that file as its part of the step: the same reader cuts it into atoms by parameter,
with the layer labels, dedup, compression and layer policy of a committed DCP folder. The
coordinator then commits DCP's ``.metadata`` (the items' places, pickled as DCP pickles it) and
finalizes the step from the save's parts, fenced as every commit is. A checkout of the step
writes the very folder ``FileSystemWriter`` would have written, which ``dcp.load`` and
``FileSystemReader`` read; :class:`tailorstore.integrations.dcp.reader.TailorStorageReader`
loads it straight from the store.

Call order (DCP's, ``torch/distributed/checkpoint/state_dict_saver.py``), and who makes each call:

1. every rank: ``reset(checkpoint_id)``: a new save; an int or a ``step-N`` path names the step;
2. every rank: ``set_up_storage_writer(is_coordinator, rank=...)``;
3. every rank: ``prepare_local_plan``: nothing changes;
4. the coordinator: ``prepare_global_plan(plans)``: names the step and the save's label, and
   decides once, under the store's shared lock, which layers the step stores (the policy, from
   every rank's items' sizes) and where each other layer comes from; each rank's plan carries
   that decision and the name of its file;
5. every rank: ``write_data(plan, planner)``: serializes its items into its memory file and
   commits it as its part (its blobs, then the part object: the part's commit point);
6. the coordinator: ``finish(metadata, results)``: commits ``.metadata`` as the last part, then
   finalizes the save's parts into one manifest: the step's commit point.

A save that fails anywhere, or a rank killed at any point, records no step: DCP raises on every
rank, and the parts already written wait for ``gc --drop-parts``. Memory: a rank holds its
items' zip headers and pickles while its part is committed, and keeps the tensors it saves
referenced until then.
"""

from __future__ import annotations

import bisect
import dataclasses
import io
import math
import os
import pickle
import threading
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION, _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from tailorstore import CommitRequest, PartPlan
from tailorstore.api import Store
from tailorstore.core.atom_types import dtype_name
from tailorstore.core.errors import StoreError
from tailorstore.core.host_memory import release_free_memory
from tailorstore.core.layers import STATE, layer_of
from tailorstore.core.tensor_ref import DTYPES
from tailorstore.integrations.common.store_session import (
    LentBytes,
    MemoryFile,
    MemoryFolder,
    StoreSession,
    check_sized_policy,
    dcp_format,
    megatron_format,
    opened_store,
    step_from_name,
)


@dataclass(frozen=True)
class RankOrders:
    """What the coordinator hands each rank in its plan's ``storage_data``."""

    step: int
    label: str  # the save's parts' label: finalize takes this save's parts alone
    rank: int
    world_size: int
    plan: PartPlan

    @property
    def file_name(self) -> str:
        return f"__{self.rank}_0{dcp_format.SUFFIX}"



class TailorStorageWriter(StorageWriter):
    """A ``StorageWriter`` that commits the save as step ``step`` of ``store`` (or the step
    ``checkpoint_id`` names), under ``policy`` and with ``tag`` and ``metrics``, as a commit of the
    DCP folder would record it."""

    megatron = False  # a Megatron save's (integrations/megatron): chunks named as layout megatron names them

    def folder(self, step: int) -> MemoryFolder:
        """The memory folder a rank's file (and the coordinator's last part) is committed as."""
        return MemoryFolder(tag=f"step-{step}", step=step)

    def beside(self) -> dict[str, bytes]:
        """Files the coordinator commits with ``.metadata``, by name (none for a plain DCP save)."""
        return {}

    def __init__(
        self,
        store: Store | str | os.PathLike,
        *,
        step: int | None = None,
        request: CommitRequest | None = None,
        **options: Any,
    ) -> None:
        super().__init__()
        self.request = CommitRequest.of(request, options)
        check_sized_policy(self.request.spec())  # a misspelt option or a policy it cannot apply: refused now
        if self.request.step is not None and step is None:
            step = self.request.step
        store = opened_store(store)
        self._store: Store | None = store
        self._where = (store.location, store.run)
        self._pid = os.getpid()
        self.step = step
        self._save: str = ""
        self._orders: RankOrders | None = None
        self._unnamed = ""  # why checkpoint_id named no step

    # the checkpointer may run the save in another process: the store is opened there anew
    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_store": None}

    @property
    def store(self) -> Store:
        if self._store is None or self._pid != os.getpid():
            location, run = self._where
            self._store, self._pid = Store.open(location, run=run), os.getpid()
        return self._store

    # -- DCP's calls ------------------------------------------------------------------------------------
    def reset(self, checkpoint_id: Any = None) -> None:
        self._save, self._orders, self._unnamed = uuid.uuid4().hex[:16], None, ""
        if checkpoint_id is None:
            return
        if isinstance(checkpoint_id, int) and not isinstance(checkpoint_id, bool):
            self.step = checkpoint_id
            return
        found = step_from_name(PurePosixPath(os.fspath(checkpoint_id)).name)
        if found is None:  # said by the coordinator's plan, so that DCP raises it on every rank alike
            self._unnamed = (
                f"checkpoint_id {str(checkpoint_id)[:200]!r} names no step: pass a step number, a path ending in "
                "step-N, or TailorStorageWriter(store, step=N)."
            )
        self.step = found

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False  # a writer is built over a store, never found from a path

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        pass  # each rank learns its rank and orders from its plan (prepare_global_plan)

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=None, save_id=self._save)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        if self._unnamed:
            raise StoreError(self._unnamed)
        if self.step is None:
            raise StoreError(
                "TailorStorageWriter needs the step it saves: TailorStorageWriter(store, step=N), or "
                "dcp.save(..., checkpoint_id=N)."
            )
        label = f"dcp.{self._save or uuid.uuid4().hex[:16]}"
        plan = StoreSession(self.store).plan_parts(self.step, layer_sizes(plans, self.megatron), self.request)
        every = [RankOrders(self.step, label, rank, len(plans), plan) for rank in range(len(plans))]
        self._orders = every[0]  # what finish records, on this (the coordinator's) instance
        return [dataclasses.replace(p, storage_data=orders) for p, orders in zip(plans, every, strict=True)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        orders = plan.storage_data
        if not isinstance(orders, RankOrders):
            raise StoreError("write_data before prepare_global_plan: DCP's save calls them in that order")
        folder = self.folder(orders.step)
        try:
            file = folder.add(orders.file_name)
            results = serialize(file, orders.file_name, plan.items, planner)
            folder.dcp_metadata = rank_metadata(plan, results, orders, self.megatron, file.lent)
            StoreSession(self.store).commit_memory(folder, self.request, part_label=orders.label, plan=orders.plan)
        finally:
            folder.close()
            _release_thread_memory()
        done: Future[list[WriteResult]] = Future()
        done.set_result(results)
        return done

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        orders = self._orders
        if orders is None:
            raise StoreError("finish without a save plan: DCP's save calls prepare_global_plan first")
        metadata.version = CURRENT_DCP_VERSION  # as FileSystemWriter stamps it
        metadata.storage_data = {result.index: result.storage_data for rank in results for result in rank}
        metadata.storage_meta = self.storage_meta()
        data = pickle.dumps(metadata)
        # read back by the reader every checkout and load uses: a step is recorded only if it reads
        sizes: dict[str, int] = {}
        for info in metadata.storage_data.values():
            sizes[info.relative_path] = max(sizes.get(info.relative_path, 0), info.offset + info.length)
        where = f"step {orders.step}'s {dcp_format.METADATA}"
        dcp_format.read_metadata(data, where, sizes, own=True, megatron=self.megatron)
        folder = self.folder(orders.step)
        try:
            for name, content in {dcp_format.METADATA: data, **self.beside()}.items():
                with folder.add(name).writer() as stream:
                    stream.write(content)
            StoreSession(self.store).commit_memory(folder, self.request, part_label=orders.label, plan=orders.plan)
        finally:
            folder.close()
        try:
            self.store.finalize(
                orders.step,
                label=orders.label,
                tag=self.request.tag,
                lock_timeout=self.request.lock_timeout,
                metrics=self.request.metrics,
            )
        finally:
            _release_thread_memory()


def _release_thread_memory() -> None:
    """What a save freed, handed back when it ran off the main thread (an async save's thread,
    which may never run again: glibc keeps what a thread freed in that thread's arena). A save on
    the main thread leaves it for the next one to reuse, and skips the trim's cost."""
    if threading.current_thread() is not threading.main_thread():
        release_free_memory()


def layer_sizes(plans: list[SavePlan], megatron: bool = False) -> dict[str, int]:
    """Every layer's bytes over every rank's tensor items, named as the commit of the saved folder
    names them (``formats/dcp.name_and_kind``; a Megatron save's, ``formats/megatron.chunk_name``).
    An item the store cannot keep or read back (a dtype it does not store, a name too long for its
    metadata reader) is refused here, by the coordinator, before any rank writes anything."""
    sizes: dict[str, int] = {}
    for plan in plans:
        paths = plan.planner_data if isinstance(plan.planner_data, dict) else {}
        for item in plan.items:
            fqn = item.index.fqn
            if len(fqn) > dcp_format.MAX_NAME:  # the step's .metadata would not read back
                raise StoreError(
                    f"{fqn[:80]}...: a name of {len(fqn)} characters; tailorstore reads DCP names of at most "
                    f"{dcp_format.MAX_NAME}, so the step would not load. Shorten the state dict's keys."
                )
            if item.type == WriteItemType.BYTE_IO or item.tensor_data is None:
                continue
            dtype = dtype_name(item.tensor_data.properties.dtype)
            if dtype not in DTYPES:  # refused before any rank writes anything
                raise StoreError(
                    f"{fqn} is a {dtype} tensor, which tailorstore does not store (it stores "
                    f"{', '.join(DTYPES)}); convert it, or save it apart from the checkpoint."
                )
            if megatron:
                chunk = item.tensor_data.chunk
                layer = megatron_format.chunk_name(fqn, tuple(chunk.offsets), tuple(chunk.sizes), dtype)[2]
            else:
                keys = tuple(str(k) for k in paths[fqn]) if fqn in paths else None
                param, _, is_model = dcp_format.name_and_kind(fqn, keys, dtype)
                layer = layer_of(param) if is_model else STATE
            nbytes = math.prod(item.tensor_data.chunk.sizes) * item.tensor_data.properties.dtype.itemsize
            sizes[layer] = sizes.get(layer, 0) + nbytes
    return sizes


def serialize(into: MemoryFile, name: str, items: list[WriteItem], planner: SavePlanner) -> list[WriteResult]:
    """The items as ``FileSystemWriter`` writes one rank's file: bytes items first, then each
    tensor on the CPU, cloned where its storage holds more than it, through ``torch.save``. A
    tensor that is not contiguous is saved contiguous (the same values; ``FileSystemWriter`` would
    save its strides, which a commit of the folder refuses)."""
    results = []
    ordered = [i for i in items if i.type == WriteItemType.BYTE_IO] + [
        i for i in items if i.type != WriteItemType.BYTE_IO
    ]
    with into.writer() as stream:
        for item in ordered:
            data = planner.resolve_data(item)
            offset = stream.tell()
            if item.type == WriteItemType.BYTE_IO:
                if not isinstance(data, io.BytesIO):
                    raise StoreError(f"{item.index.fqn}: DCP resolved a bytes item to a {type(data).__name__}")
                stream.write(data.getbuffer())
            else:
                tensor = data.detach().cpu()
                if not tensor.is_contiguous():  # a transposed view: its values in row order, as DCP loads them
                    tensor = tensor.contiguous()
                if tensor.untyped_storage().size() != tensor.nbytes:
                    tensor = tensor.clone()
                stream.lend(tensor)  # its bytes stay in the tensor; the commit copies them once
                torch.save(tensor, stream)
            length = stream.tell() - offset
            results.append(
                WriteResult(index=item.index, size_in_bytes=length, storage_data=_StorageInfo(name, offset, length))
            )
    return results


def rank_metadata(
    plan: SavePlan,
    results: list[WriteResult],
    orders: RankOrders,
    megatron: bool = False,
    lent: Sequence[LentBytes] = (),
) -> dcp_format.DcpMetadata:
    """What ``.metadata`` will say of this rank's file, built from its plan (the coordinator
    writes the whole of it only once every rank is done): enough to cut the file into atoms.

    ``lent``: the tensors whose bytes the memory file left in them (``LendingWriter``), each at the
    offset ``torch.save`` wrote it. Each tensor item is told where its bytes are, so the commit does
    not parse the zip the writer has just written to find what the writer already knew."""
    meta = dcp_format.DcpMetadata(megatron=megatron)
    paths = plan.planner_data if isinstance(plan.planner_data, dict) else {}
    meta.paths = {fqn: tuple(str(k) for k in keys) for fqn, keys in paths.items() if isinstance(keys, tuple | list)}
    meta.items = {f"__{r}_0{dcp_format.SUFFIX}": [] for r in range(orders.world_size)}  # the save's world size
    by_index = {result.index: result.storage_data for result in results}
    starts = [one.offset for one in lent]  # in the file's order, as torch.save wrote them
    for item in plan.items:
        info = by_index[item.index]
        fqn = item.index.fqn
        if item.type == WriteItemType.BYTE_IO or item.tensor_data is None:
            meta.objects.add(fqn)
            meta.items[orders.file_name].append(dcp_format.Item(fqn, info.relative_path, info.offset, info.length))
            continue
        data = item.tensor_data
        chunk = dcp_format.Chunk(tuple(data.chunk.offsets), tuple(data.chunk.sizes))
        tensor = meta.tensors.setdefault(
            fqn, dcp_format.TensorInfo(dtype_name(data.properties.dtype), tuple(data.size), [])
        )
        tensor.chunks.append(chunk)
        at = _bytes_at(lent, starts, info.offset, info.length, data)
        meta.items[orders.file_name].append(
            dcp_format.Item(fqn, info.relative_path, info.offset, info.length, chunk, data_at=at)
        )
    meta.items[orders.file_name].sort(key=lambda i: i.offset)
    return meta


def _bytes_at(lent: Sequence[LentBytes], starts: list[int], offset: int, length: int, data: Any) -> int | None:
    """Where the one tensor lent inside ``[offset, offset + length)`` has its bytes, if it is the
    item's tensor (its dtype, its chunk's shape); None (the commit parses the item) otherwise."""
    i = bisect.bisect_left(starts, offset)
    if i == len(lent) or lent[i].end > offset + length:
        return None
    tensor = lent[i].owner
    sizes = tuple(getattr(tensor, "shape", ()))
    if getattr(tensor, "dtype", None) != data.properties.dtype or sizes != tuple(data.chunk.sizes):
        return None
    return lent[i].offset
