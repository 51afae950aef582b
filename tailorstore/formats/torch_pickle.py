"""Reading a ``torch.save`` checkpoint without torch: a restricted unpickler over its zip.

``torch.save`` writes a zip of stored records: ``<archive>/data.pkl`` (the object tree,
pickled, with each storage as a persistent id) and one ``<archive>/data/<key>`` record per
storage holding its raw bytes. A commit needs the tree and each tensor's dtype, shape and
file offset, never the tensors' values as tensors. So this module unpickles ``data.pkl``
with Python's own unpickler, restricted to an allowlist *named as strings*: the tensor
rebuild functions become :class:`TensorRef` descriptors pointing into the storage records,
``torch.Size`` a tuple, and the few DeepSpeed classes (``LossScaler``, ``ZeroStageEnum``,
``fragment_address``) plain :class:`Opaque` objects holding their arguments and state.
Neither torch nor DeepSpeed is imported, which keeps both off ``tailor commit``'s start-up.

Anything else is refused before it runs (:class:`UnsafePickleError`), exactly as torch's
``weights_only`` loader refuses it. A file this reader cannot take as a plain torch.save
zip (compressed records, a non-contiguous tensor, a dtype outside :data:`DTYPES`) returns
None, and the caller falls back to torch.
"""

from __future__ import annotations

import codecs
import pickletools
import struct
import zipfile
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tailorstore.core.errors import BadCheckpointError, Call, CorruptStoreError, UnsafePickleError
from tailorstore.core.tensor_ref import DTYPES, TensorRef, contiguous_strides, numel_of
from tailorstore.formats.pickles import AllowlistUnpickler
from tailorstore.formats.source import InputFile, InputWindow
from tailorstore.formats.torch_zip import BytesWindow, window_records

# DeepSpeed's own classes seen in DeepSpeed 0.14 to 0.19 checkpoints; kept as Opaque objects.
DEEPSPEED_GLOBALS = (
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.utils.tensor_fragment.fragment_address",
)

_STORAGES = {
    "DoubleStorage": "float64",
    "FloatStorage": "float32",
    "HalfStorage": "float16",
    "BFloat16Storage": "bfloat16",
    "LongStorage": "int64",
    "IntStorage": "int32",
    "ShortStorage": "int16",
    "CharStorage": "int8",
    "ByteStorage": "uint8",
    "BoolStorage": "bool",
}


class NotPlainTorchSave(Exception):
    """The file is not one this reader takes (the caller falls back to torch); never shown to users."""


class Opaque:
    """An allowlisted object that is not a tensor: its global's name, its arguments and its state.

    The layout code reads attributes of some (``fragment_address.start``); nothing calls them.
    """

    name = ""

    def __init__(self, *args: Any) -> None:
        self.args = args

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, dict):
            self.__dict__.update(state)
        else:
            self.state = state

    def __repr__(self) -> str:
        return f"<{self.name} {self.__dict__}>"

    @classmethod
    def by_name(cls, name: str) -> Opaque:
        """An Enum member pickled by name (``getattr(cls, name)``, Python 3.11.0-3.11.4:
        pickles.AllowlistUnpickler); written back the same way (torch_save_writer)."""
        member = cls.__new__(cls)
        member.member = name
        return member


def untrusted(where: str) -> UnsafePickleError:
    """A file committed with trusted pickles is checked out only when the caller trusts it again (here,
    apart from the torch loader, so that a checkout that needs no torch names it too)."""
    return UnsafePickleError(
        f"{where}: this file holds pickles with globals outside the allowlist (committed with ",
        Call(trust_pickles=True),
        ", or a DCP object item kept as opaque bytes); pass ",
        Call(trust_pickles=True),
        " to check it out.",
    )


def opaque_class(name: str) -> type[Opaque]:
    return type(name.rsplit(".", 1)[-1], (Opaque,), {"name": name, "__module__": __name__})


class _Unbuildable:
    """An allowlisted value a pickle may name but never change: ``BUILD`` on it (``GLOBAL
    torch.FloatStorage`` then ``BUILD {"dtype": "int32"}``) is refused. torch.save never builds
    state on a storage type or a dtype; a pickle that does is damaged or hostile."""

    def __setstate__(self, state: Any) -> None:
        raise BadCheckpointError(f"the pickle changes {self!r}, which torch.save never does")


@dataclass(frozen=True)
class _StorageType(_Unbuildable):
    dtype: str


@dataclass(frozen=True)
class _Storage:
    key: str
    dtype: str
    numel: int
    start: int  # the file offset of its record's bytes


@dataclass(frozen=True)
class DTypeName(_Unbuildable):
    """``torch.bfloat16`` and the like, as objects in a tree (optimizer configs hold a few)."""

    name: str


class _Located(TensorRef):
    """A TensorRef still tied to its storage record; the offset is resolved after the load."""

    storage: _Storage
    storage_offset: int


def _rebuild_tensor_v2(
    storage: Any,
    storage_offset: int,
    size: Any,
    stride: Any,
    requires_grad: Any = False,
    backward_hooks: Any = None,
    metadata: Any = None,
) -> _Located:
    if not isinstance(storage, _Storage) or not isinstance(storage_offset, int):
        raise NotPlainTorchSave("a tensor without a storage record")
    shape = tuple(int(d) for d in size)
    if any(d < 0 for d in shape):  # (-2, -2) has four elements by product, and numpy refuses (-1, 4)
        raise BadCheckpointError(f"a tensor of shape {list(shape)[:8]}, a negative size torch never saves")
    if numel_of(shape) > 1 and tuple(int(s) for s in stride) != contiguous_strides(shape):
        raise NotPlainTorchSave("a non-contiguous tensor")
    ref = _Located(storage.dtype, shape)
    ref.storage, ref.storage_offset = storage, storage_offset
    return ref


def _rebuild_parameter(data: Any, requires_grad: Any = False, backward_hooks: Any = None, *state: Any) -> Any:
    return data


def _rebuild_from_type_v2(func: Callable[..., Any], new_type: Any, args: tuple, state: Any) -> Any:
    """A tensor of a subclass (or with attributes): its bytes are a plain tensor's; the type is dropped
    here, and the file's own pickle (kept in its container) still names it."""
    return func(*args)


def _bytearray(source: Any = b"", *args: Any) -> bytearray:
    """``bytearray`` as pickles rebuild it (from a string or bytes), never ``bytearray(n)``: a
    hostile pickle would allocate n bytes from a few bytes of input."""
    if not isinstance(source, str | bytes | bytearray):
        raise BadCheckpointError("the pickle builds a bytearray from a size, which torch.save never writes")
    return bytearray(source, *args)


def _allowed() -> dict[str, Any]:
    """A new allowlist, for one load only (docs/FORMAT.md section 8, I5): every object a pickle can
    reach through it (the storage types, the dtypes, the functions and the classes) is made for that
    load, so nothing one file's pickle does to them (``BUILD``, slot state) reaches a later read."""
    allowed: dict[str, Any] = {
        "collections.OrderedDict": OrderedDict,
        "collections.Counter": _fresh(Counter),  # a Python class: slot state could set its attributes
        "builtins.set": set,
        "builtins.frozenset": frozenset,
        "builtins.bytearray": _fresh(_bytearray),
        "builtins.complex": complex,
        "_codecs.encode": codecs.encode,  # how protocol 2 pickles bytes
        "torch.Size": _size_maker(),
        "torch._utils._rebuild_parameter": _fresh(_rebuild_parameter),
        "torch._utils._rebuild_parameter_with_state": _fresh(_rebuild_parameter),
        "torch._tensor._rebuild_from_type_v2": _fresh(_rebuild_from_type_v2),
        "torch.device": opaque_class("torch.device"),
    }
    allowed.update({f"torch.{kind}": _StorageType(dtype) for kind, dtype in _STORAGES.items()})
    allowed.update({f"torch.{dtype}": DTypeName(dtype) for dtype in DTYPES})
    allowed.update({name: opaque_class(name) for name in DEEPSPEED_GLOBALS})
    return allowed


def _size_maker() -> Callable[..., tuple[int, ...]]:
    def size(dims: Any = ()) -> tuple[int, ...]:
        return tuple(int(d) for d in dims)

    return size


def _fresh(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A function of this load's own: a pickle's slot state can set a function's ``__defaults__``."""

    def call(*args: Any) -> Any:
        return fn(*args)

    return call


class _Unpickler(AllowlistUnpickler):
    """``data.pkl`` through the allowlist: tensors become refs located in the zip's records."""

    def __init__(self, data: bytes, records: dict[str, tuple[int, int]] | None, prefix: str, where: str) -> None:
        super().__init__(data, where, _allowed(), self._refused)
        self.records, self.prefix = records, prefix
        self.refs: list[_Located] = []

    def _rebuild_tensor(self, *args: Any) -> _Located:
        ref = _rebuild_tensor_v2(*args)
        self.refs.append(ref)
        return ref

    def resolve(self, module: str, name: str) -> Any:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return self._rebuild_tensor
        found = super().resolve(module, name)
        if found is None and module == "torch":
            raise NotPlainTorchSave(f"torch.{name}")  # a dtype or storage we do not cut: torch's loader decides
        return found

    def _refused(self, module: str, name: str) -> UnsafePickleError:
        refused = UnsafePickleError(
            f"{self.where}: the pickle needs {module}.{name}, which is not on tailorstore's allowlist, so it "
            "was not loaded. If you trust this file, run again with ",
            Call(trust_pickles=True),
            ".",
        )
        refused.needs = f"{module}.{name}"  # for a caller that words its own hint (the DCP reader)
        return refused

    def persistent_load(self, pid: Any) -> _Storage:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise BadCheckpointError(f"a persistent id {str(pid)[:80]} that torch.save does not write")
        _, storage_type, key, _location, numel = pid
        if not isinstance(storage_type, _StorageType) or not isinstance(key, str) or not isinstance(numel, int):
            raise NotPlainTorchSave("an untyped or unknown storage")
        if self.records is None:  # a data.pkl kept apart from its zip: storages are named, not located
            return _Storage(key, storage_type.dtype, numel, 0)
        record = self.records.get(f"{self.prefix}data/{key}")
        if record is None or record[1] != numel * DTYPES[storage_type.dtype].itemsize:
            raise BadCheckpointError(f"storage {key} has no record of {numel} elements in the zip; the file is damaged")
        return _Storage(key, storage_type.dtype, numel, record[0])


class MemorySource:
    """A torch.save zip held in memory (a DCP object item read back from the store), read as
    :func:`read_torch_zip` reads a file."""

    def __init__(self, data: bytes) -> None:
        self.data = data

    @property
    def size(self) -> int:
        return len(self.data)

    def zip_records(self) -> dict[str, tuple[int, int]]:
        return window_records(BytesWindow(self.data), "an object item")

    def read(self, offset: int, length: int) -> memoryview:
        if offset < 0 or length < 0 or offset + length > len(self.data):
            raise BadCheckpointError(f"a read of {length} bytes at {offset}, past the end of the object item")
        return memoryview(self.data)[offset : offset + length]


def object_refusal(src: InputFile | InputWindow | MemorySource, where: str) -> str | None:
    """Why the ``torch.save`` record of a DCP object item (a ``BYTE_IO`` item: DCP's loader unpickles
    it with ``torch.load(weights_only=False)``, which runs whatever it names) does not pass the
    allowlist of :func:`read_torch_zip`, or None when it does. The one check of an object item's
    bytes, at commit (``formats/dcp.py``) and again at load (``restore/dcp_read.py``), since the
    store's bytes are read as hostile too."""
    try:
        parsed = read_torch_zip(src, where)
    except UnsafePickleError as exc:
        return f"its pickle needs {exc.needs}, which is not on tailorstore's allowlist" if exc.needs else str(exc)
    except BadCheckpointError as exc:
        return f"it does not read as a torch.save record ({str(exc)[:200]})"
    if parsed is None:
        return "it is not a plain torch.save record that tailorstore's allowlisted reader takes"
    return None


class ObjectVerdicts:
    """:func:`object_refusal` of each distinct small object item once, for one file's commit or one
    step's load: a flattened optimizer state saves the same few values (``lr``, ``betas``) as one
    item per parameter, each the same bytes, and each check costs a parse
    (docs/PERFORMANCE.md, "Saving inside training"). Keyed by the bytes
    themselves (never a hash a crafted item could collide with); a larger item is checked each time."""

    LIMIT = 1 << 16  # bytes of an item whose verdict is kept

    def __init__(self) -> None:
        self._seen: dict[bytes, str | None] = {}

    def refusal(self, src: InputFile | InputWindow | MemorySource) -> str | None:
        if src.size > self.LIMIT:
            return object_refusal(src, "the object item")
        data = bytes(src.read(0, src.size))
        if data not in self._seen:
            self._seen[data] = object_refusal(MemorySource(data), "the object item")
        return self._seen[data]


def read_torch_zip(src: InputFile | InputWindow | MemorySource, where: str) -> tuple[Any, bytes] | None:
    """(the object tree, with a TensorRef holding its file offset for every tensor, and the bytes of
    its pickle), or None when the file needs torch (the caller falls back). Raises
    UnsafePickleError for a global outside the allowlist, BadCheckpointError for a damaged file."""
    try:
        records = src.zip_records()
    except (zipfile.BadZipFile, OSError, ValueError):
        return None  # not a zip torch.save wrote: torch's loader says what it is
    pickles = [name for name in records if name.endswith("/data.pkl") and name.count("/") == 1]
    if not records or len(pickles) != 1:
        return None
    prefix = pickles[0].removesuffix("data.pkl")
    order = records.get(f"{prefix}byteorder")
    if order is not None and bytes(src.read(*order)) != b"little":
        return None
    data = bytes(src.read(*records[pickles[0]]))
    unpickler = _Unpickler(data, records, prefix, where)  # raises BadCheckpointError naming the file
    try:
        tree = unpickler.load()
    except UnsafePickleError:
        raise
    except BadCheckpointError as exc:  # raised while loading, without the file's name
        raise BadCheckpointError(f"{where}: {exc}; restore it from a good copy.") from None
    except NotPlainTorchSave:
        return None
    except Exception as exc:  # a truncated or corrupt pickle raises any of several types
        raise BadCheckpointError(
            f"{where}: the checkpoint's pickle does not load ({type(exc).__name__}: {str(exc)[:120]}); it may be "
            "truncated or corrupt; restore it from a good copy."
        ) from None
    for ref in unpickler.refs:
        if ref.storage_offset < 0 or ref.storage_offset + ref.numel() > ref.storage.numel:
            raise BadCheckpointError(
                f"{where}: a tensor reaches past the end of its storage {ref.storage.key}; the file is damaged; "
                "restore it from a good copy."
            )
        ref.file_offset = ref.storage.start + ref.storage_offset * ref.element_size()
    return tree, data


def load_pickle_tree(data: bytes, where: str) -> Any:
    """The object tree of a torch.save pickle record, tensors as :class:`TensorRef` (shape and
    dtype only), through the allowlist; for reading what a committed file's skeleton says.

    The record passed this reader when it was committed, so a failure here means the store
    holds something else now: a damaged-store error.
    """
    try:
        return _Unpickler(data, None, "", where).load()
    except UnsafePickleError:
        raise
    except Exception as exc:
        raise CorruptStoreError(
            f"{where}: the committed pickle does not load ({type(exc).__name__}: {str(exc)[:120]}); run ",
            Call("verify", deep=True),
            ".",
        ) from None


_STRINGS = ("SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE")
_MEMO = ("BINPUT", "LONG_BINPUT", "PUT")
_GETS = ("BINGET", "LONG_BINGET", "GET")
_INTS = {"BININT1": "<B", "BININT2": "<H", "BININT": "<i"}


def with_int_field(pickled: bytes, key: str, value: int) -> bytes | None:
    """``pickled`` with the int stored under the string ``key`` set to ``value``, the same length
    (the new value in the old one's opcode); None when the key is not followed by an int exactly
    once (or is used again through the memo), or when ``value`` does not fit that opcode. A
    resharded model-states file is the saved one with ``dp_world_size`` changed: patching that one
    field keeps every byte of its container, so the file can be written in place like a checkout's."""
    try:
        ops = list(pickletools.genops(pickled))
    except ValueError:  # not a pickle this can read op by op: the caller writes the tree anew
        return None
    spans, memos = [], set()
    for i, (op, arg, _) in enumerate(ops):
        if op.name not in _STRINGS or arg != key:
            continue
        j = i + 1
        while j < len(ops) and ops[j][0].name in _MEMO:
            memos.add(ops[j][1])
            j += 1
        if j < len(ops) and ops[j][0].name == "MEMOIZE":
            return None  # protocol 4's implicit memo indices: not worth tracking (torch.save pickles with 2)
        if j < len(ops) and ops[j][0].name in _INTS:
            spans.append((ops[j][2] + 1, _INTS[ops[j][0].name]))
    reused = any(op.name in _GETS and arg in memos for op, arg, _ in ops)  # the key again, from the memo
    if len(spans) != 1 or reused:
        return None
    at, form = spans[0]
    try:
        packed = struct.pack(form, value)
    except struct.error:
        return None
    return pickled[:at] + packed + pickled[at + len(packed) :]
