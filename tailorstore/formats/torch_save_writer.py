"""Writing ``torch.save`` files without torch: a protocol-2 pickle and a stored zip.

``torch.load`` reads a zip of stored records under one folder (``data.pkl``, ``byteorder``,
``version``, ``data/<key>`` per storage). The pickle names torch's globals as plain
``GLOBAL module name`` opcodes and each storage as a persistent id, so writing one needs no
torch: this module pickles an object tree with Python's own (pure-Python) pickler, taught to
write :class:`TensorOut` as ``torch._utils._rebuild_tensor_v2`` over a storage record, a
:class:`GlobalName` as the global it names, and the torch-free reader's :class:`Opaque` stand-ins
(DeepSpeed's ``LossScaler``, ``ZeroStageEnum``) back as the objects they stood for.
Storage records start on 64-byte boundaries, as torch writes them.
"""

from __future__ import annotations

import io
import pickle
import struct
import zipfile
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, ClassVar

from tailorstore.core.tensor_ref import contiguous_strides, nbytes_of, numel_of
from tailorstore.formats.torch_pickle import DTypeName, Opaque

STORAGE_TYPES = {
    "float64": "DoubleStorage",
    "float32": "FloatStorage",
    "float16": "HalfStorage",
    "bfloat16": "BFloat16Storage",
    "int64": "LongStorage",
    "int32": "IntStorage",
    "int16": "ShortStorage",
    "int8": "CharStorage",
    "uint8": "ByteStorage",
    "bool": "BoolStorage",
}
ALIGNMENT = 64


@dataclass(frozen=True)
class GlobalName:
    """A global written by name (``torch.FloatStorage``), never imported."""

    module: str
    name: str


Bytes = memoryview | bytes | bytearray


@dataclass(frozen=True)
class Parts:
    """A tensor's bytes as chunk streams to run one after another (a flat partition: its
    parameters' pieces end to end). A read-ahead may decode different parts on different
    helpers at once, where one stream would keep one helper busy and the writer waiting."""

    streams: tuple[Callable[[], Iterable[Bytes]], ...]

    def __call__(self) -> Iterator[Bytes]:
        for stream in self.streams:
            yield from stream()


@dataclass
class TensorOut:
    """A contiguous tensor to write: dtype (torch's name), shape and its bytes, or a function that
    returns them when the record is written, whole or as an iterable of chunks (so a file's
    tensors are held one at a time, or only a chunk of one at a time).

    ``any_thread``: the function may run on a helper thread, ahead of the writer (it touches
    nothing bound to the writer's thread, such as the SQLite index), so a file's next tensors
    are decoded while the current one is written."""

    dtype: str
    shape: tuple[int, ...]
    data: Bytes | Callable[[], Bytes | Iterable[Bytes]]
    any_thread: bool = False
    # for a loader that keeps the bytes (restore/file_objects.py): write them straight into a buffer
    # of ``nbytes``, checked, with no chunk in between; None: the loader copies ``chunks``
    fill: Callable[[memoryview], None] | None = None

    @property
    def nbytes(self) -> int:
        return nbytes_of(self.dtype, self.shape)

    def __post_init__(self) -> None:
        if not callable(self.data) and _size(self.data) != self.nbytes:
            raise ValueError(f"{_size(self.data)} bytes for a {self.dtype} tensor of shape {self.shape}")

    def chunks(self) -> Iterator[Bytes]:
        """The tensor's bytes in order; raises once they come out at another length than its shape's."""
        data = self.data() if callable(self.data) else self.data
        total = 0
        for piece in (data,) if isinstance(data, memoryview | bytes | bytearray) else data:
            total += _size(piece)
            yield piece
        if total != self.nbytes:
            raise ValueError(f"{total} bytes for a {self.dtype} tensor of shape {self.shape}")


def _size(data: Bytes) -> int:
    return data.nbytes if isinstance(data, memoryview) else len(data)


class _Pickler(pickle._Pickler):  # type: ignore[misc]  # the pure-Python pickler: its dispatch is extendable
    dispatch: ClassVar[dict] = dict(pickle._Pickler.dispatch)  # type: ignore[attr-defined]

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, protocol=2)
        self.storages: list[TensorOut] = []

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, _StorageId):
            return ("storage", GlobalName("torch", STORAGE_TYPES[obj.tensor.dtype]), obj.key, "cpu", obj.numel)
        return None

    def _global(self, ref: GlobalName) -> None:
        self.write(pickle.GLOBAL + f"{ref.module}\n{ref.name}\n".encode())
        self.memoize(ref)

    def _tensor(self, tensor: TensorOut) -> None:
        key = str(len(self.storages))
        self.storages.append(tensor)
        shape = tuple(tensor.shape)
        self.save(GlobalName("torch._utils", "_rebuild_tensor_v2"))
        storage = _StorageId(tensor, key, numel_of(shape))
        self.save((storage, 0, shape, contiguous_strides(shape), False, OrderedDict()))
        self.write(pickle.REDUCE)

    def _opaque(self, obj: Opaque) -> None:
        module, name = obj.name.rsplit(".", 1)
        if set(obj.__dict__) == {"member"}:  # an Enum member pickled by name: getattr(class, name)
            self.save(GlobalName("builtins", "getattr"))
            self.save((GlobalName(module, name), obj.__dict__["member"]))
            self.write(pickle.REDUCE)
            return
        self.save(GlobalName(module, name))
        state = {k: v for k, v in obj.__dict__.items() if k != "args"}
        if "args" in obj.__dict__:  # it was rebuilt by calling the class (REDUCE)
            self.save(tuple(obj.args))
            self.write(pickle.REDUCE)
        else:  # by __new__ and then its state (NEWOBJ, BUILD)
            self.save(())
            self.write(pickle.NEWOBJ)
        if state:
            self.save(state.get("state", state) if set(state) == {"state"} else state)
            self.write(pickle.BUILD)

    def _dtype(self, obj: DTypeName) -> None:
        self.save(GlobalName("torch", obj.name))

    def save(self, obj: Any, save_persistent_id: bool = True) -> None:
        if isinstance(obj, Opaque):
            return self._opaque(obj)
        return super().save(obj, save_persistent_id)

    dispatch[GlobalName] = _global
    dispatch[TensorOut] = _tensor
    dispatch[DTypeName] = _dtype


@dataclass(frozen=True)
class _StorageId:
    tensor: TensorOut
    key: str
    numel: int


def dumps(tree: Any) -> tuple[bytes, list[TensorOut]]:
    """The ``data.pkl`` bytes of ``tree`` and its tensors in storage-key order."""
    buf = io.BytesIO()
    pickler = _Pickler(buf)
    pickler.dump(tree)
    return buf.getvalue(), pickler.storages


def _aligned_info(name: str, offset: int, size: int) -> zipfile.ZipInfo:
    """A stored record whose data starts on an :data:`ALIGNMENT` boundary (padding in an extra field)."""
    info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
    info.compress_type = zipfile.ZIP_STORED
    info.file_size = size
    header = 30 + len(name.encode())
    if size * 1.05 > zipfile.ZIP64_LIMIT:
        header += 20  # zipfile adds a zip64 extra field for it
    pad = -(offset + header + 4) % ALIGNMENT
    info.extra = struct.pack("<HH", 0x4246, pad) + b"Z" * pad  # id "FB", as torch's writer pads
    return info


def write_torch_save(path: Path, tree: Any) -> None:
    """``torch.save(tree, path)``, byte-compatible for ``torch.load``, without torch."""
    with open(path, "wb") as f:
        write_torch_save_to(f, path.stem or "archive", tree)


def write_torch_save_to(f: BinaryIO, archive: str, tree: Any) -> None:
    """:func:`write_torch_save` into ``f``, a new seekable binary file (the caller chooses how its
    bytes reach the disk), under the archive folder name torch would take from the file's name."""
    pickled, tensors = dumps(tree)
    write_pickled_to(f, archive, pickled, tensors)


def write_pickled_to(
    f: BinaryIO,
    archive: str,
    pickled: bytes,
    tensors: list[TensorOut],
    chunks_of: Callable[[int], Iterable[Bytes]] | None = None,
) -> None:
    """The records of a tree :func:`dumps` made: its pickle, then each tensor's bytes as its chunks
    come (zipfile keeps the CRC as it goes), so a tensor given as chunks is never whole in memory.
    ``chunks_of(i)``, when given, hands tensor ``i``'s chunks instead of ``tensors[i].chunks()``
    (a read-ahead that produced them on helper threads); it is asked for each tensor once, in order."""
    records: list[tuple[str, bytes | int]] = [
        (f"{archive}/data.pkl", pickled),
        (f"{archive}/.format_version", b"1"),
        (f"{archive}/.storage_alignment", str(ALIGNMENT).encode()),
        (f"{archive}/byteorder", b"little"),
    ]
    records += [(f"{archive}/data/{i}", i) for i in range(len(tensors))]
    records.append((f"{archive}/version", b"3\n"))
    with zipfile.ZipFile(f, "w", zipfile.ZIP_STORED) as zf:
        for name, record in records:
            size = tensors[record].nbytes if isinstance(record, int) else len(record)
            info = _aligned_info(name, f.tell(), size)
            with zf.open(info, "w") as out:
                if not isinstance(record, int):
                    out.write(record)
                    continue
                for piece in tensors[record].chunks() if chunks_of is None else chunks_of(record):
                    out.write(piece)
