"""tailorstore as PyTorch DCP's storage layer, loading: ``dcp.load(state, storage_reader=...)``
reads a stored step's items straight from the store, every tensor hash-checked, no file written.

    reader = TailorStorageReader(store, "latest")       # or a step, "tag=best", "id=..."; a Store or a location
    dcp.load(state, storage_reader=reader)

An object item (``BYTE_IO``: a step count, hyperparameters) is unpickled by DCP's loader with
``torch.load(weights_only=False)``, which runs whatever the pickle names. So the reader hands DCP
only the object items that pass tailorstore's pickle allowlist (the one the torch zip reader
uses), checked again as they are read; any other fails the load with one line naming it, unless
the caller trusts the store's objects: ``TailorStorageReader(store, ref, trust_objects=True)``.
A step gc thinned loads its model alone (its moments are gone: asking for them is refused, naming
the tier); a composite step loads with the one warning a checkout gives.

DCP's load planner asks each rank for exactly the chunks it needs (``ReadItem``), at any world
size, so the reader reshards as ``FileSystemReader`` does. A tensor item whose whole chunk lands
in contiguous CPU memory is decoded into that memory directly; any other is decoded once into a
scratch buffer and copied (a chunk split between ranks, a GPU destination). Items decode on a pool
of threads (``threads``, default two a usable core, as a checkout), at most twice as many in flight.

Call order (DCP's, ``torch/distributed/checkpoint/state_dict_loader.py``), on every rank:
``reset``; ``read_metadata``, collective here: rank 0 names the step and every rank reads that
one, so a commit meanwhile cannot give ranks different steps; ``set_up_storage_reader``;
``prepare_local_plan``; ``prepare_global_plan`` on the coordinator; ``read_data``.
"""

from __future__ import annotations

import io
import os
from collections import deque
from concurrent.futures import Future as ConcurrentFuture
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from tailorstore import DcpStep
from tailorstore.api import Ref, Store
from tailorstore.core.errors import StoreError
from tailorstore.core.threads import decode_threads
from tailorstore.integrations.common.distributed import from_rank0
from tailorstore.integrations.common.ranks import is_distributed, rank
from tailorstore.integrations.common.rewind import warn_if_composite
from tailorstore.integrations.common.store_session import StoreSession, dcp_format, dtype_from_name, opened_store


class TailorStorageReader(StorageReader):
    """A ``StorageReader`` over one stored step (``ref``, resolved once, by rank 0)."""

    def __init__(
        self,
        store: Store | str | os.PathLike,
        ref: Ref = "latest",
        *,
        folder: str | None = None,
        threads: int | None = None,
        trust_objects: bool = False,
    ) -> None:
        super().__init__()
        self.store, self.ref, self.folder = opened_store(store), ref, folder
        self.threads = decode_threads(threads)
        self.trust_objects = trust_objects  # hand dcp.load object items beyond the pickle allowlist too
        self._step: DcpStep | None = None

    # -- DCP's calls ------------------------------------------------------------------------------------
    def reset(self, checkpoint_id: Any = None) -> None:
        self._step = None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False  # a reader is built over a store and a step, never found from a path

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        def resolve() -> str:
            return self.store.step(self.ref).id

        # rank 0 names the step, and every rank gets its answer or its failure (none waits in vain)
        stable_id = from_rank0(resolve, None, f"resolving {self.ref!r}") if is_distributed() else resolve()
        self._step = StoreSession(self.store).open_dcp(f"id={stable_id}", folder=self.folder)
        if rank() == 0:  # one warning for the job, as a checkout or attach gives
            warn_if_composite(self._step.step, self._step.inherited)
        return torch_metadata(self._step.metadata)

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        pass

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        step = self._step
        if step is None:
            raise StoreError("read_data before read_metadata: DCP's load calls them in that order")
        items = [_stored_item(step, request) for request in plan.items]
        step.check_held(items)  # a thinned step's dropped state is refused before anything is loaded
        with step.reading(), ThreadPoolExecutor(self.threads, thread_name_prefix="tailor-dcp-read") as pool:
            window: deque[tuple[ReadItem, torch.Tensor, Any]] = deque()  # decodes in flight, in plan order
            for request, item in zip(plan.items, items, strict=True):
                if request.type == LoadItemType.BYTE_IO:
                    data = step.object_bytes(item, trust_objects=self.trust_objects)  # only bytes that passed
                    planner.load_bytes(request, io.BytesIO(data))
                    continue
                target, into, rest = _plan_tensor(step, item, request, planner)
                if step.any_thread(item):
                    window.append((request, target, pool.submit(_decode, step, item, into, rest)))
                else:
                    window.append((request, target, _done(_decode(step, item, into, rest))))
                while len(window) > 2 * self.threads:  # scratch buffers held at once stay bounded
                    _land(planner, *window.popleft())
            while window:
                _land(planner, *window.popleft())
        done: Future[None] = Future()
        done.set_result(None)
        return done


def _stored_item(step: DcpStep, request: ReadItem) -> dcp_format.Item:
    offsets = request.storage_index.offset
    return step.item(request.storage_index.fqn, tuple(offsets) if offsets is not None else None)


def _plan_tensor(
    step: DcpStep, item: dcp_format.Item, request: ReadItem, planner: LoadPlanner
) -> tuple[torch.Tensor, torch.Tensor, tuple[tuple[int, int], ...] | None]:
    """(the destination, the tensor to decode into, and the part of it to copy into the
    destination, or None where the destination itself is decoded into)."""
    assert item.chunk is not None
    dtype = dtype_from_name(step.metadata.tensors[item.fqn].dtype)
    target = planner.resolve_tensor(request).detach()
    if tuple(target.size()) != tuple(request.lengths):  # FileSystemReader refuses it too: before any byte lands
        raise StoreError(
            f"step {step.step}, item {item.fqn}: size mismatch: the load asks for a chunk of {list(request.lengths)} "
            f"elements of the stored {list(item.chunk.sizes)}, into a destination tensor of {list(target.size())}; "
            "give a destination of the size the load plan names (the stored tensor's)."
        )
    whole = tuple(request.lengths) == item.chunk.sizes and not any(request.storage_offsets)
    if whole and target.device.type == "cpu" and target.dtype == dtype and target.is_contiguous():
        return target, target, None  # straight into the memory the state dict keeps
    part = tuple(zip(request.storage_offsets, request.lengths, strict=True))
    return target, torch.empty(item.chunk.sizes, dtype=dtype), part


def _decode(
    step: DcpStep, item: dcp_format.Item, into: torch.Tensor, part: tuple[tuple[int, int], ...] | None
) -> torch.Tensor | None:
    """Decode the item into ``into``; the part to copy into the destination (None: done)."""
    step.tensor_into(item, _bytes_of(into))
    if part is None:
        return None
    for dim, (start, length) in enumerate(part):
        into = into.narrow(dim, start, length)
    return into


def _land(planner: LoadPlanner, request: ReadItem, target: torch.Tensor, decoding: Any) -> None:
    chunk = decoding.result()
    if chunk is not None:
        target.copy_(chunk)
    planner.commit_tensor(request, target)


def _done(value: Any) -> Any:
    finished: ConcurrentFuture[Any] = ConcurrentFuture()
    finished.set_result(value)
    return finished


def torch_metadata(meta: dcp_format.DcpMetadata) -> Metadata:
    """DCP's own ``Metadata``, built from what our restricted reader checked (the stored pickle is
    never handed to DCP's unpickler)."""
    described: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
    for fqn, info in meta.tensors.items():
        chunks = [ChunkStorageMetadata(torch.Size(c.offsets), torch.Size(c.sizes)) for c in info.chunks]
        described[fqn] = TensorStorageMetadata(
            TensorProperties(dtype=dtype_from_name(info.dtype)), torch.Size(info.size), chunks
        )
    for fqn in meta.objects:
        described[fqn] = BytesStorageMetadata()
    storage = {}
    for items in meta.items.values():
        for item in items:
            offset = torch.Size(item.chunk.offsets) if item.chunk is not None else None
            storage[MetadataIndex(item.fqn, offset)] = _StorageInfo(item.file, item.offset, item.length)
    return Metadata(described, planner_data=dict(meta.paths), storage_data=storage)


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, writable, for decoding into."""
    if tensor.numel() == 0:
        return memoryview(bytearray())
    return memoryview(tensor.view(-1).view(torch.uint8).numpy()).cast("B")
