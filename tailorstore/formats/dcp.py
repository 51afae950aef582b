"""PyTorch distributed checkpoints (DCP): ``.metadata`` read without torch, ``.distcp`` files cut into atoms.

``dcp.save`` with the default ``FileSystemWriter`` writes, in one folder, a ``.metadata``
pickle and one ``__R_K.distcp`` file per writer (R the rank). A ``.distcp`` file is items back
to back, each one ``torch.save`` zip: a tensor chunk (one storage, cloned so that it holds just
the chunk) or a pickled object (``BytesStorageMetadata``: optimizer hyperparameters, a step
count). ``.metadata`` says, for every item, its flattened name (``model.layers.0.mlp.w``,
``optim.state.<param>.exp_avg``), its chunk offsets, and ``(file, offset, length)``.

A commit reads ``.metadata`` with a restricted unpickler (only DCP's own metadata classes, as
stand-ins, plus ``torch.Size``, dtypes, layouts and paths as plain values; anything else is
refused) and checks every number in it against the files. Each tensor item becomes one atom,
keyed by its parameter, kind, writer rank and first element; everything else in the file (the
zips' headers and pickles, the object items) is its container. The ``.metadata`` file itself
is kept whole. So a checkout writes the files back byte for byte, and ``dcp.load`` reshards
from them at any world size as it does from the save.

An object item is unpickled by DCP's loader with ``torch.load(weights_only=False)``, which runs
whatever the pickle names; so each is read at commit through the one allowlisted unpickler of
torch zips (``torch_pickle.object_refusal``, once a distinct item). One beyond the allowlist is
still committed whole, as opaque bytes in the container, with a warning, and its file is recorded
as needing trusted pickles; ``TailorStorageReader`` checks it again at load and refuses it unless
the caller trusts the store's objects (``trust_objects=True``).
"""

from __future__ import annotations

import itertools
import logging
import math
import re
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Any

from tailorstore.core import atom_types as A
from tailorstore.core.errors import BadCheckpointError, UnsafePickleError
from tailorstore.core.layers import STATE, layer_of
from tailorstore.core.tensor_ref import DTYPES, TensorRef
from tailorstore.formats.dcp_items import skeleton_bytes
from tailorstore.formats.megatron import chunk_name
from tailorstore.formats.pickles import AllowlistUnpickler
from tailorstore.formats.source import InputFile
from tailorstore.formats.torch_pickle import DTypeName, ObjectVerdicts, read_torch_zip

log = logging.getLogger("tailorstore")

METADATA = ".metadata"
SUFFIX = ".distcp"
MAX_METADATA = 1 << 30  # a 1 TB model's metadata is tens of MB
MAX_NUMEL = 1 << 48
MAX_DIMS = 64
MAX_GRID_SLACK = 1024  # cells beyond four a chunk that a tensor's chunk edges may make (_check_tiling)
MAX_NAME = 4096  # characters of an entry's name
_FILE = re.compile(r"__(\d{1,6})_(\d{1,6})\.distcp")
OPTIMIZER_TOPS = ("optim", "optimizer", "optimizers", "optim_state", "optimizer_state")
_MODEL_TOPS = ("model", "module", "models")
_TOPS = (*_MODEL_TOPS, *OPTIMIZER_TOPS, "state")  # what a Stateful's name wraps
_OPTIMIZER_KINDS = {A.EXP_AVG, A.EXP_AVG_SQ, A.STEP, "momentum_buffer", "max_exp_avg_sq", "sum", "square_avg"}


def is_distcp(name: str) -> bool:
    return name.endswith(SUFFIX)


def file_rank(name: str) -> int:
    """The writer's rank of ``__R_K.distcp`` (0 for a name DCP did not make)."""
    match = _FILE.fullmatch(name)
    return int(match.group(1)) if match else 0


# -- .metadata: a restricted unpickler with stand-ins for DCP's classes ---------------------------------------


class _Record:
    """A DCP metadata object as plain attributes: built by NEWOBJ, filled by BUILD (dict state)."""

    def __init__(self, *args: Any) -> None:
        self.args = args

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, dict):
            self.__dict__.update({k: v for k, v in state.items() if isinstance(k, str)})
        elif isinstance(state, tuple) and len(state) == 2 and isinstance(state[1], dict):  # (dict, slots)
            self.__dict__.update({k: v for k, v in (state[0] or {}).items() if isinstance(k, str)})
            self.__dict__.update({k: v for k, v in state[1].items() if isinstance(k, str)})
        else:
            self.state = state

    @classmethod
    def by_name(cls, name: str) -> _Record:
        """An Enum member pickled by name (``getattr(cls, name)``: pickles.AllowlistUnpickler)."""
        member = cls()
        member.member = name
        return member


def _record(name: str) -> type[_Record]:
    return type(name, (_Record,), {"__module__": __name__})


_Metadata = _record("Metadata")
_MetadataIndex = _record("MetadataIndex")
_TensorStorage = _record("TensorStorageMetadata")
_BytesStorage = _record("BytesStorageMetadata")
_Chunk = _record("ChunkStorageMetadata")
_Properties = _record("TensorProperties")  # its state is a tuple: (dtype, layout, requires_grad, format, pinned)
_StorageMeta = _record("StorageMeta")
_StorageInfo = _record("_StorageInfo")
_MemoryFormat = _record("_MEM_FORMAT_ENCODING")
_PathValue = _record("PathValue")
# Megatron-Core's widening (docs/FORMAT.md, "Layout megatron"): its planner pickles every rank's
# local SavePlan into .metadata as ``all_local_plans``, to reuse the global plan on the next save
_SavePlan = _record("SavePlan")
_WriteItem = _record("WriteItem")
_TensorWriteData = _record("TensorWriteData")
_WRITE_ITEM_TYPES = {1: "TENSOR", 2: "SHARD", 3: "BYTE_IO"}  # torch's WriteItemType, an Enum pickled by value

_META = "torch.distributed.checkpoint.metadata."


def _allowed(megatron: bool = False) -> dict[str, Any]:
    """A new allowlist for one load (docs/FORMAT.md section 8, I5). The classes are shared: a class's
    ``__setstate__`` takes an instance, so ``BUILD`` on the class itself fails. The dtypes and the
    functions are made anew, since slot state can set a function's ``__defaults__``. ``megatron``:
    a Megatron save's metadata, which also pickles its planner's classes, and only then."""
    if not megatron:
        return {**_CLASSES, **_values()}
    return {**_CLASSES, **_MEGATRON_CLASSES, **_values(), _PLANNER + "WriteItemType": _WriteItemType}


class _WriteItemType:
    """torch's ``WriteItemType`` as the name of its member: called with its value (as Python pickles
    an Enum) or looked up by name (as Python 3.11.0-3.11.4 do); anything else is no item type."""

    def __new__(cls, value: Any = None) -> str:  # type: ignore[misc]
        if isinstance(value, bool) or value not in _WRITE_ITEM_TYPES:
            raise ValueError(f"WriteItemType({str(value)[:20]}) is no item type")
        return _WRITE_ITEM_TYPES[value]

    @classmethod
    def by_name(cls, name: str) -> str:
        if name not in _WRITE_ITEM_TYPES.values():
            raise ValueError(f"WriteItemType.{name[:20]} is no item type")
        return name


def _values() -> dict[str, Any]:
    def size(dims: Any = ()) -> tuple:
        return tuple(dims)

    def layout(name: Any = "") -> str:
        return str(name)

    values: dict[str, Any] = {"torch.Size": size, "torch.serialization._get_layout": layout}
    values.update({f"torch.{dtype}": DTypeName(dtype) for dtype in DTYPES})
    return values


_CLASSES: dict[str, Any] = {
    _META + "Metadata": _Metadata,
    _META + "MetadataIndex": _MetadataIndex,
    _META + "TensorStorageMetadata": _TensorStorage,
    _META + "BytesStorageMetadata": _BytesStorage,
    _META + "ChunkStorageMetadata": _Chunk,
    _META + "TensorProperties": _Properties,
    _META + "StorageMeta": _StorageMeta,
    _META + "_MEM_FORMAT_ENCODING": _MemoryFormat,
    "torch.distributed.checkpoint.filesystem._StorageInfo": _StorageInfo,
    "pathlib.PosixPath": _PathValue,
    "pathlib.WindowsPath": _PathValue,
    "pathlib.PurePosixPath": _PathValue,
    "collections.OrderedDict": dict,
}
_PLANNER = "torch.distributed.checkpoint.planner."
_MEGATRON_CLASSES: dict[str, Any] = {
    _PLANNER + "SavePlan": _SavePlan,
    _PLANNER + "WriteItem": _WriteItem,
    _PLANNER + "TensorWriteData": _TensorWriteData,
}


class _MetadataUnpickler(AllowlistUnpickler):
    """``.metadata`` through DCP's metadata classes alone."""

    def __init__(self, data: bytes, where: str, *, own: bool = False, megatron: bool = False) -> None:
        super().__init__(data, where, _allowed(megatron), self._refused, scanned=own)
        self.megatron = megatron

    def _refused(self, module: str, name: str) -> UnsafePickleError:
        whose = "DCP's metadata classes or the planner classes Megatron adds" if self.megatron else (
            "DCP's metadata classes"
        )
        return UnsafePickleError(
            f"{self.where}: the DCP metadata needs {module}.{name}, which is not one of {whose}; it was not "
            "loaded and nothing was committed."
        )

    def persistent_load(self, pid: Any) -> Any:
        raise BadCheckpointError(f"{self.where}: a persistent id in DCP metadata, which DCP never writes")


@dataclass(frozen=True)
class Chunk:
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)


@dataclass(frozen=True)
class Item:
    """One stored item: a tensor chunk (``chunk`` set) or a pickled object, at a range of a file."""

    fqn: str
    file: str
    offset: int
    length: int
    chunk: Chunk | None = None
    data_at: int | None = None  # where in the file the tensor's bytes start, told by the writer that made it


@dataclass
class TensorInfo:
    dtype: str
    size: tuple[int, ...]
    chunks: list[Chunk]
    _by_offsets: dict[tuple[int, ...], Chunk] | None = field(default=None, init=False, repr=False, compare=False)

    def chunk_at(self, offsets: tuple[int, ...]) -> Chunk | None:
        """The chunk at ``offsets`` (a dict built once: a storage item per chunk looked each up in
        the whole list, quadratic in the chunks)."""
        if self._by_offsets is None:
            self._by_offsets = {c.offsets: c for c in self.chunks}
        return self._by_offsets.get(offsets)


@dataclass
class DcpMetadata:
    """What ``.metadata`` says, every number checked: tensors by name, and the items by file."""

    tensors: dict[str, TensorInfo] = field(default_factory=dict)
    objects: set[str] = field(default_factory=set)
    items: dict[str, list[Item]] = field(default_factory=dict)  # file name -> its items, by offset
    paths: dict[str, tuple[str, ...]] = field(default_factory=dict)  # the flattening: fqn -> its keys
    megatron: bool = False  # a Megatron save's: chunks named by ShardedTensor key and layer (formats/megatron)

    @property
    def world_size(self) -> int:
        """How many ranks wrote the save: one more than the highest R of the ``__R_K.distcp`` files
        its items lie in (every rank writes a file, even one without tensors of its own)."""
        return 1 + max((file_rank(name) for name in self.items), default=0)


def _bad(where: str, why: str) -> BadCheckpointError:
    return BadCheckpointError(
        f"{where}: {why}; this is not DCP metadata as dcp.save writes it, so nothing was committed."
    )


def _dims(value: Any, where: str, what: str) -> tuple[int, ...]:
    if not isinstance(value, tuple | list) or len(value) > MAX_DIMS:
        raise _bad(where, f"{what} is not a list of dimensions")
    if not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < MAX_NUMEL for d in value):
        raise _bad(where, f"{what} holds a dimension that is not a whole number from 0 to 2^48")
    return tuple(value)


def read_metadata(
    data: bytes, where: str, file_sizes: dict[str, int], *, own: bool = False, megatron: bool = False
) -> DcpMetadata:
    """Parse and check ``.metadata`` against the folder's ``.distcp`` files (name -> size).

    ``megatron``: the folder is a Megatron-Core save (layout ``megatron``), whose metadata also
    pickles its planner's local plans; the allowlist is widened by those classes alone.

    ``own``: bytes this process's ``pickle.dumps`` has just made (the DCP writer reading back what it
    will store, so that a step is recorded only if it loads). Its memo check is skipped: the pickler
    numbers memo slots one by one and writes no out-of-band buffer without a callback, and the scan
    is on the save's critical path (docs/PERFORMANCE.md, "Saving inside training")."""
    if len(data) > MAX_METADATA:
        raise _bad(where, f"it is {len(data)} bytes, more than DCP metadata ever needs")
    try:
        top = _MetadataUnpickler(data, where, own=own, megatron=megatron).load()
    except (UnsafePickleError, BadCheckpointError):
        raise
    except Exception as exc:  # a truncated or hostile pickle raises any of several types
        raise _bad(where, f"the pickle does not load ({type(exc).__name__}: {str(exc)[:100]})") from None
    if not isinstance(top, _Metadata):
        raise _bad(where, f"it holds a {type(top).__name__}, not a Metadata")
    described, stored = getattr(top, "state_dict_metadata", None), getattr(top, "storage_data", None)
    if not isinstance(described, dict) or not isinstance(stored, dict):
        raise _bad(where, "its state_dict_metadata or storage_data is missing (a save without FileSystemWriter?)")
    meta = DcpMetadata(megatron=megatron)
    for fqn, desc in described.items():
        if not isinstance(fqn, str) or len(fqn) > MAX_NAME:
            raise _bad(where, f"an entry's name is not a string of at most {MAX_NAME} characters")
        if isinstance(desc, _BytesStorage):
            meta.objects.add(fqn)
        elif isinstance(desc, _TensorStorage):
            meta.tensors[fqn] = _tensor_info(fqn, desc, where)
        else:
            raise _bad(where, f"{fqn} is described by a {type(desc).__name__}")
    for index, info in stored.items():
        meta_item = _item(index, info, meta, where, file_sizes)
        meta.items.setdefault(meta_item.file, []).append(meta_item)
    _check_cover(meta, where, file_sizes)
    planner = getattr(top, "planner_data", None)
    if isinstance(planner, dict):
        for fqn, keys in planner.items():
            if isinstance(fqn, str) and isinstance(keys, tuple) and all(isinstance(k, str | int) for k in keys):
                meta.paths[fqn] = tuple(str(k) for k in keys)
    return meta


def _tensor_info(fqn: str, desc: Any, where: str) -> TensorInfo:
    props, size, chunks = getattr(desc, "properties", None), getattr(desc, "size", None), getattr(desc, "chunks", None)
    state = getattr(props, "state", None) if props is not None else None
    dtype = state[0] if isinstance(state, tuple) and state else getattr(props, "dtype", None)
    if not isinstance(dtype, DTypeName) or dtype.name not in DTYPES:
        raise _bad(where, f"{fqn} has no dtype tailorstore knows")
    shape = _dims(size, where, f"the size of {fqn}")
    if math.prod(shape) >= MAX_NUMEL:
        raise _bad(where, f"{fqn} has more than 2^48 elements")
    if not isinstance(chunks, list):
        raise _bad(where, f"{fqn} has no list of chunks")
    out = []
    for chunk in chunks:
        offsets = _dims(getattr(chunk, "offsets", None), where, f"a chunk offset of {fqn}")
        sizes = _dims(getattr(chunk, "sizes", None), where, f"a chunk size of {fqn}")
        if len(offsets) != len(shape) or len(sizes) != len(shape):
            raise _bad(where, f"a chunk of {fqn} has {len(offsets)} dimensions where the tensor has {len(shape)}")
        if any(o + s > d for o, s, d in zip(offsets, sizes, shape, strict=True)):
            raise _bad(where, f"a chunk of {fqn} at {list(offsets)} reaches past the tensor's size {list(shape)}")
        out.append(Chunk(offsets, sizes))
    _check_tiling(fqn, shape, out, where)
    return TensorInfo(dtype.name, shape, out)


def _check_tiling(fqn: str, shape: tuple[int, ...], chunks: list[Chunk], where: str) -> None:
    """The chunks cover the tensor once: disjoint boxes whose sizes add up to the tensor's.

    ``dcp.save`` checks the same of its global plan (``_validate_global_plan``); a folder that
    fails it would be recorded as a step that no export, average or load could assemble.

    DCP's planners cut a tensor as a grid (rows under FSDP, columns under tensor parallelism, both
    under 2-D parallelism), so the check lays the chunks on the grid their own edges make and
    marks each cell once: work in proportion to the cells, which for a grid is the chunk count.
    A layout whose edges make far more cells than there are chunks is no planner's and is refused,
    so the work stays bounded whatever a hostile ``.metadata`` says. (A sweep along the first
    dimension compared every pair of chunks sharded by columns: quadratic, docs/benchmarks.md.)
    """
    boxes = [c for c in chunks if c.numel]
    if sum(c.numel for c in boxes) != math.prod(shape):
        raise _bad(where, f"the chunks of {fqn} do not cover its size {list(shape)} exactly once")
    edges = [sorted({0, size, *(c.offsets[d] for c in boxes), *(c.offsets[d] + c.sizes[d] for c in boxes)})
             for d, size in enumerate(shape)]  # fmt: skip
    cells = math.prod(len(cut) - 1 for cut in edges)
    if cells > 4 * len(boxes) + MAX_GRID_SLACK:
        raise _bad(where, f"the chunks of {fqn} are not laid out as a grid ({cells} cells for {len(boxes)} chunks)")
    at = [{edge: i for i, edge in enumerate(cut)} for cut in edges]
    marked: set[tuple[int, ...]] = set()
    for chunk in boxes:
        spans = [range(at[d][o], at[d][o + n]) for d, (o, n) in enumerate(zip(chunk.offsets, chunk.sizes, strict=True))]
        for cell in itertools.product(*spans):
            if cell in marked:
                raise _bad(where, f"two chunks of {fqn} overlap at {list(chunk.offsets)}")
            marked.add(cell)


def _item(index: Any, info: Any, meta: DcpMetadata, where: str, file_sizes: dict[str, int]) -> Item:
    fqn = getattr(index, "fqn", None)
    if not isinstance(index, _MetadataIndex) or not isinstance(fqn, str):
        raise _bad(where, "a storage entry is not keyed by a MetadataIndex")
    if not isinstance(info, _StorageInfo):
        raise _bad(where, f"the storage entry of {fqn} is not a _StorageInfo")
    name, offset, length = (getattr(info, k, None) for k in ("relative_path", "offset", "length"))
    if getattr(info, "transform_descriptors", None):
        raise BadCheckpointError(
            f"{where}: {fqn} was written through DCP stream extensions (compression), which tailorstore does not "
            "read; save without them to commit this checkpoint."
        )
    if not isinstance(name, str) or name not in file_sizes:
        raise _bad(where, f"{fqn} is stored in {str(name)[:80]!r}, which is not a .distcp file of this folder")
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (offset, length)):
        raise _bad(where, f"the offset or length of {fqn} is not a whole number")
    if offset < 0 or length <= 0 or offset + length > file_sizes[name]:
        raise _bad(where, f"{fqn} at bytes {offset}..{offset + length} lies outside {name} ({file_sizes[name]} bytes)")
    if fqn in meta.objects:
        return Item(fqn, name, offset, length)
    tensor = meta.tensors.get(fqn)
    if tensor is None:
        raise _bad(where, f"{fqn} is stored but not described")
    at = getattr(index, "offset", None)
    chunk = tensor.chunk_at(tuple(at)) if isinstance(at, tuple | list) else None
    if chunk is None:
        raise _bad(where, f"{fqn} is stored at chunk offset {at}, which its description does not list")
    return Item(fqn, name, offset, length, chunk)


def _check_cover(meta: DcpMetadata, where: str, file_sizes: dict[str, int]) -> None:
    """Items in a file may not overlap, and every described chunk is stored exactly once."""
    seen: set[tuple[str, tuple[int, ...]]] = set()
    for name, items in meta.items.items():
        items.sort(key=lambda i: i.offset)
        for before, after in itertools.pairwise(items):
            if before.offset + before.length > after.offset:
                raise _bad(where, f"{before.fqn} and {after.fqn} overlap in {name}")
        for item in items:
            key = (item.fqn, item.chunk.offsets if item.chunk else ())
            if key in seen:
                raise _bad(where, f"{item.fqn} at {list(key[1])} is stored twice")
            seen.add(key)
    for fqn, tensor in meta.tensors.items():
        for chunk in tensor.chunks:
            if (fqn, chunk.offsets) not in seen:
                raise _bad(where, f"the chunk of {fqn} at {list(chunk.offsets)} is described but not stored")


# -- naming: which parameter, which kind ----------------------------------------------------------------------


def name_and_kind(fqn: str, keys: tuple[str, ...] | None, dtype: str) -> tuple[str, str, bool]:
    """(parameter name, kind, is model state) of a flattened DCP name.

    ``model.<param>`` is the parameter itself: a master when it is FP32 (FSDP keeps FP32
    parameters and computes in bf16 through its mixed-precision policy), else a weight.
    ``optim.state.<param>.<kind>`` is optimizer state (torchtitan's flattened
    ``state.<param>.<kind>`` too). Anything else (a step counter, a scheduler) is kept under
    its own name as state, never inherited. One leading key that wraps these (a ``Stateful``'s
    name) is looked through."""
    keys = keys or tuple(fqn.split("."))
    if len(keys) >= 3 and keys[0] not in _TOPS and keys[1] in _TOPS:
        # a Stateful wrapper, as the DCP tutorial saves it: dcp.save({"app": AppState(model, optim)})
        # flattens to app.model.<param> and app.optim.state.<param>.<kind>; read what it wraps
        return name_and_kind(fqn, keys[1:], dtype)
    top = keys[0]
    if top in OPTIMIZER_TOPS and len(keys) >= 4 and keys[1] == "state":
        return ".".join(keys[2:-1]) if len(keys) > 4 else keys[2], keys[-1], True
    if top == "state" and len(keys) >= 3 and keys[-1] in _OPTIMIZER_KINDS:
        return ".".join(keys[1:-1]), keys[-1], True
    if top in _MODEL_TOPS and len(keys) >= 2:
        return ".".join(keys[1:]), A.MASTER if dtype == "float32" else A.WEIGHT, True
    return fqn, A.TENSOR, False


def _start(chunk: Chunk, size: tuple[int, ...]) -> tuple[int, str]:
    """A chunk's first element within its flattened tensor, when it is one contiguous run (FSDP's
    row shards), else 0 with a suffix that keeps the chunk's atoms apart (a 2-D shard)."""
    inner = size[1:]
    if all(o == 0 for o in chunk.offsets[1:]) and tuple(chunk.sizes[1:]) == tuple(inner):
        return (chunk.offsets[0] * math.prod(inner) if size else 0), ""
    return 0, "@" + ",".join(str(o) for o in chunk.offsets)


# -- a .distcp file ------------------------------------------------------------------------------------------


def read_distcp(src: InputFile, rel: str, meta: DcpMetadata, where: str) -> tuple[bytes, list[A.TensorEntry], bool]:
    """(skeleton, tensor entries, whether an object item lies beyond the pickle allowlist) of one
    ``.distcp`` file: every tensor item's zip parsed without torch, its one tensor checked against
    the metadata, its bytes located in the file; every object item read through the allowlist.
    A file with an object beyond it is recorded as needing trusted pickles, as a torch file
    committed with ``trust_pickles`` is: a checkout writes it only when the caller trusts it."""
    name = PurePosixPath(rel).name
    rank = file_rank(name)
    items = meta.items.get(name, [])
    entries: list[A.TensorEntry] = []
    described = []
    refused: list[str] = []
    verdicts = ObjectVerdicts()
    for item in items:
        row: dict[str, Any] = {"fqn": item.fqn, "offset": item.offset, "length": item.length}
        if item.chunk is None:
            why = verdicts.refusal(src.window(item.offset, item.length))
            if why is not None:
                refused.append(f"{item.fqn}: {why}")
        else:
            tensor = meta.tensors[item.fqn]
            told = item.data_at is not None  # by the writer that made the file: no zip to parse again
            ref = _told_tensor(item, tensor, where) if told else _chunk_tensor(src, item, tensor, where)
            slot = len(entries)
            row.update(slot=slot, chunk=list(item.chunk.offsets))
            entry = A.TensorEntry(slot=slot, path=item.fqn, tensor=ref)
            entry.file_offset = item.offset + ref.file_offset if ref.numel() else None
            if meta.megatron:
                start, (param, kind, layer) = 0, chunk_name(item.fqn, item.chunk.offsets, item.chunk.sizes, ref.dtype)
            else:
                param, kind, is_model = name_and_kind(item.fqn, meta.paths.get(item.fqn), ref.dtype)
                start, suffix = _start(item.chunk, tensor.size)
                param, layer = param + suffix, layer_of(param) if is_model else STATE
            entry.segments = [A.Segment(0, ref.numel(), param, kind, rank, start, layer)] if ref.numel() else []
            entries.append(entry)
        described.append(row)
    if refused:
        log.warning(
            "tailorstore: %s: %d object item(s) do not pass the pickle allowlist (%s%s); they are committed "
            "as opaque bytes; TailorStorageReader refuses to hand them to dcp.load unless trust_objects=True, "
            "and a checkout writes the file only with trust_pickles=True",
            where,
            len(refused),
            refused[0][:300],
            f" and {len(refused) - 1} more" if len(refused) > 1 else "",
        )
    return skeleton_bytes(described), entries, bool(refused)


def _told_tensor(item: Item, tensor: TensorInfo, where: str) -> TensorRef:
    """The chunk's tensor where the writer that made the file (the DCP writer, in memory) says its
    bytes are: it watched ``torch.save`` write them, so the zip need not be parsed again to find
    them. Only a writer in this process sets ``data_at``; a ``.metadata`` read from outside never does."""
    assert item.chunk is not None and item.data_at is not None
    ref = TensorRef(tensor.dtype, item.chunk.sizes, item.data_at - item.offset)
    if ref.file_offset is None or ref.file_offset < 0 or ref.file_offset + ref.nbytes() > item.length:
        raise BadCheckpointError(f"{where}: the item {item.fqn}: its tensor's bytes lie outside the item")
    return ref


def _chunk_tensor(src: InputFile, item: Item, tensor: TensorInfo, where: str) -> TensorRef:
    assert item.chunk is not None
    what = f"{where}: the item {item.fqn} (bytes {item.offset}..{item.offset + item.length})"
    parsed = read_torch_zip(src.window(item.offset, item.length), what)
    if parsed is None:
        raise BadCheckpointError(f"{what} is not a torch.save record of one tensor; the file is damaged")
    ref = parsed[0]
    if not isinstance(ref, TensorRef):
        raise BadCheckpointError(f"{what} holds a {type(ref).__name__}, not the tensor the metadata describes")
    if ref.dtype != tensor.dtype or tuple(ref.shape) != item.chunk.sizes:
        raise BadCheckpointError(
            f"{what} holds a {ref.dtype} tensor of shape {list(ref.shape)}, where the metadata says "
            f"{tensor.dtype} {list(item.chunk.sizes)}; the file does not match its metadata"
        )
    if ref.file_offset is None or ref.file_offset + ref.numel() * ref.element_size() > item.length:
        raise BadCheckpointError(f"{what}: its tensor's bytes lie outside the item")
    return ref
