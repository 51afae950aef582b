"""Writing safetensors files, and the Hugging Face shard plan, without torch.

A safetensors file is an 8-byte little-endian header length, a JSON header (padded with
spaces to a multiple of 8 bytes, as the reference writer does) and the tensors' bytes end to
end in header order. Writing it ourselves lets export stream one tensor at a time: the header
is known before any tensor is read, since shapes and dtypes come from the manifest.

Sharding follows transformers' ``save_pretrained``: tensors in order, a new shard when the
next tensor would take the current one past the limit; shards are named
``model-00001-of-0000N.safetensors`` and listed in ``model.safetensors.index.json``.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass

from tailorstore.core.errors import StoreError
from tailorstore.core.tensor_ref import nbytes_of

DEFAULT_SHARD_SIZE = "5GB"  # transformers' save_pretrained default

SAFETENSORS_CODES = {
    "bool": "BOOL",
    "uint8": "U8",
    "int8": "I8",
    "int16": "I16",
    "int32": "I32",
    "int64": "I64",
    "float16": "F16",
    "bfloat16": "BF16",
    "float32": "F32",
    "float64": "F64",
}
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20,
          "GIB": 2**30, "TIB": 2**40}  # fmt: skip


@dataclass(frozen=True)
class TensorSpec:
    """One tensor as it will be written: name, dtype (torch's name) and shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return nbytes_of(self.dtype, self.shape)


def parse_size(text: str) -> int:
    """``"5GB"`` (10^9), ``"500MiB"`` (2^20), ``"2000000"`` (bytes), as transformers reads them."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)\s*", text.upper())
    if not match or match.group(2) not in _UNITS or float(match.group(1)) <= 0:
        raise StoreError(f"shard size {text!r}: give a positive size such as 5GB, 500MB or 2GiB.")
    return int(float(match.group(1)) * _UNITS[match.group(2)])


def plan_shards(tensors: list[TensorSpec], max_shard_bytes: int) -> list[list[TensorSpec]]:
    """The tensors split into shards of at most ``max_shard_bytes`` (a bigger tensor gets its own)."""
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for spec in tensors:
        if shards[-1] and size + spec.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += spec.nbytes
    return shards if shards[0] else []


def shard_names(count: int) -> list[str]:
    if count == 1:
        return [SINGLE_FILE]
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def header_bytes(tensors: list[TensorSpec], metadata: dict[str, str] | None = None) -> bytes:
    """The length prefix and JSON header for ``tensors`` laid out end to end in this order."""
    header: dict[str, object] = {"__metadata__": metadata or {"format": "pt"}}
    offset = 0
    for spec in tensors:
        header[spec.name] = {
            "dtype": SAFETENSORS_CODES[spec.dtype],
            "shape": list(spec.shape),
            "data_offsets": [offset, offset + spec.nbytes],
        }
        offset += spec.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def index_json(shards: list[list[TensorSpec]], names: list[str]) -> str:
    """``model.safetensors.index.json``: the total size and which shard holds each tensor."""
    weight_map = {spec.name: name for shard, name in zip(shards, names, strict=True) for spec in shard}
    total = sum(spec.nbytes for shard in shards for spec in shard)
    return json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2, sort_keys=True) + "\n"
