"""safetensors files as a header plus one atom per tensor.

A safetensors file is an 8-byte header length, a JSON header and the tensors' bytes end
to end. Keeping the header bytes verbatim and each tensor as an atom gives back the very
same file, and an HF ``model.safetensors`` dedups against the DeepSpeed module weights
that hold the same bytes.
"""

from __future__ import annotations

import json
import mmap
import struct
from pathlib import Path

import torch

from .. import atoms as A
from ..errors import BadCheckpointError
from ..layers import layer_of

_DTYPES = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "I32": torch.int32,
    "I64": torch.int64,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
}


def parse_header(data: bytes, where: str) -> tuple[int, list[tuple[str, str, list[int], int, int]]]:
    """(data start, [(name, dtype, shape, begin, end)] ordered by offset); raises if not contiguous."""
    if len(data) < 8:
        raise BadCheckpointError(f"{where}: too short to be a safetensors file")
    (n,) = struct.unpack("<Q", data[:8])
    try:
        header = json.loads(bytes(data[8 : 8 + n]))
    except (ValueError, UnicodeDecodeError):
        raise BadCheckpointError(f"{where}: the safetensors header is not valid JSON; the file is damaged") from None
    tensors = []
    for name, spec in header.items():
        if name == "__metadata__":
            continue
        begin, end = spec["data_offsets"]
        tensors.append((name, spec["dtype"], list(spec["shape"]), int(begin), int(end)))
    tensors.sort(key=lambda t: t[3])
    cursor = 0
    for name, _, _, begin, end in tensors:
        if begin != cursor or end < begin:
            raise BadCheckpointError(f"{where}: tensor {name} does not follow the previous one; not contiguous")
        cursor = end
    return 8 + n, tensors


def read_safetensors(path: Path, where: str) -> tuple[bytes, list[A.TensorEntry]] | None:
    """Header bytes and entries, or None when the file must be kept whole (unknown dtype)."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        if size == 0:
            raise BadCheckpointError(f"{where}: empty file")
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    header_len = struct.unpack("<Q", mm[:8])[0] if size >= 8 else 0
    data_start, tensors = parse_header(mm[: min(size, 8 + header_len)], where)  # the header only, not the data
    if data_start + (tensors[-1][4] if tensors else 0) != size:
        raise BadCheckpointError(f"{where}: the header and the file size disagree; the file is truncated or damaged")
    if any(dtype not in _DTYPES for _, dtype, _, _, _ in tensors):
        return None
    header = bytes(mm[:data_start])
    entries = []
    for slot, (name, dtype, shape, begin, end) in enumerate(tensors):
        raw = (
            torch.frombuffer(mm, dtype=torch.uint8, count=end - begin, offset=data_start + begin)
            if end > begin
            else torch.empty(0, dtype=torch.uint8)
        )
        tensor = raw.view(_DTYPES[dtype]).reshape(shape)
        entry = A.TensorEntry(slot=slot, path=name, tensor=tensor, file_offset=data_start + begin)
        n = tensor.numel()
        entry.segments = [A.Segment(0, n, name, A.WEIGHT, 0, 0, layer_of(name))] if n else []
        entries.append(entry)
    return header, entries


def tensor_layout(header: bytes, where: str) -> list[tuple[str, torch.dtype, list[int]]]:
    _, tensors = parse_header(header, where)
    return [(name, _DTYPES[dtype], shape) for name, dtype, shape, _, _ in tensors]
