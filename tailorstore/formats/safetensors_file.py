"""safetensors files as a header plus one atom per tensor.

A safetensors file is an 8-byte header length, a JSON header and the tensors' bytes end
to end. Keeping the header bytes verbatim and each tensor as an atom gives back the very
same file, and an HF ``model.safetensors`` dedups against the DeepSpeed module weights
that hold the same bytes.
"""

from __future__ import annotations

import json
import struct

from tailorstore.core import atom_types as A
from tailorstore.core.errors import BadCheckpointError
from tailorstore.core.layers import layer_of
from tailorstore.core.tensor_ref import DTYPES, TensorRef
from tailorstore.formats.source import InputFile

_DTYPES = {  # safetensors' dtype codes, by torch's names
    "BOOL": "bool",
    "U8": "uint8",
    "I8": "int8",
    "I16": "int16",
    "I32": "int32",
    "I64": "int64",
    "F16": "float16",
    "BF16": "bfloat16",
    "F32": "float32",
    "F64": "float64",
}


_MAX_HEADER = 100 << 20  # the safetensors format's own limit on the JSON header


def parse_header(data: bytes, where: str) -> tuple[int, list[tuple[str, str, list[int], int, int]]]:
    """(data start, [(name, dtype, shape, begin, end)] ordered by offset); raises if not contiguous."""
    if len(data) < 8:
        raise BadCheckpointError(f"{where}: too short to be a safetensors file")
    (n,) = struct.unpack("<Q", data[:8])
    try:
        header = json.loads(bytes(data[8 : 8 + n]))
        tensors = [_tensor_spec(name, spec) for name, spec in header.items() if name != "__metadata__"]
    except (ValueError, UnicodeDecodeError, TypeError, KeyError, AttributeError):
        raise BadCheckpointError(
            f"{where}: the safetensors header is malformed (not JSON, or a tensor without dtype, shape and "
            "data_offsets); the file is damaged. Restore it from a good copy."
        ) from None
    tensors.sort(key=lambda t: t[3])
    cursor = 0
    for name, dtype, shape, begin, end in tensors:
        if begin != cursor or end < begin:
            raise BadCheckpointError(f"{where}: tensor {name} does not follow the previous one; not contiguous")
        width = DTYPES[_DTYPES[dtype]].itemsize if dtype in _DTYPES else None
        if width is not None and _count(shape) * width != end - begin:
            raise BadCheckpointError(f"{where}: tensor {name}'s shape and byte range disagree; the file is damaged")
        cursor = end
    return 8 + n, tensors


def _tensor_spec(name: str, spec: dict) -> tuple[str, str, list[int], int, int]:
    begin, end = spec["data_offsets"]
    shape = [int(d) for d in spec["shape"]]
    if not isinstance(spec["dtype"], str) or any(d < 0 for d in shape) or int(begin) < 0:
        raise ValueError(name)
    return name, spec["dtype"], shape, int(begin), int(end)


def _count(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def read_safetensors(src: InputFile, where: str) -> tuple[bytes, list[A.TensorEntry]] | None:
    """Header bytes and entries (described: the bytes stay in the file), or None when the file
    must be kept whole (unknown dtype)."""
    size = src.size
    if size < 8:
        raise BadCheckpointError(f"{where}: too short to be a safetensors file")
    (header_len,) = struct.unpack("<Q", src.read(0, 8))
    if header_len > min(_MAX_HEADER, size - 8):
        raise BadCheckpointError(
            f"{where}: the safetensors header claims {header_len} bytes, more than the file or the format allows; "
            "the file is damaged"
        )
    header = bytes(src.read(0, 8 + header_len))  # the header only, not the data
    data_start, tensors = parse_header(header, where)
    if data_start + (tensors[-1][4] if tensors else 0) != size:
        raise BadCheckpointError(f"{where}: the header and the file size disagree; the file is truncated or damaged")
    if any(dtype not in _DTYPES for _, dtype, _, _, _ in tensors):
        return None
    entries = []
    for slot, (name, dtype, shape, begin, _end) in enumerate(tensors):
        tensor = TensorRef(_DTYPES[dtype], tuple(shape), data_start + begin)
        entry = A.TensorEntry(slot=slot, path=name, tensor=tensor, file_offset=data_start + begin)
        n = tensor.numel()
        entry.segments = [A.Segment(0, n, name, A.WEIGHT, 0, 0, layer_of(name))] if n else []
        entries.append(entry)
    return header, entries


def tensor_layout(header: bytes, where: str) -> list[tuple[str, str, list[int]]]:
    """(name, torch dtype name, shape) of every tensor, in file order."""
    _, tensors = parse_header(header, where)
    return [(name, _DTYPES[dtype], shape) for name, dtype, shape, _, _ in tensors]
