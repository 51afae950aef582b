"""Codecs, each recorded per blob as a versioned descriptor.

A descriptor is a small JSON object, e.g. ``{"id": "zstd", "v": 1, "level": 1}``, stored
in the index beside the blob. It says exactly how to decode the blob, so new codecs can
be added without breaking old stores: a reader that meets an ``id`` or ``v`` it does not
know refuses that blob with a clear message instead of guessing.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from typing import BinaryIO

import xxhash
import zstandard

from .errors import CorruptStoreError

RAW = "raw"
ZSTD = "zstd"
DEFAULT_LEVEL = 1
_local = threading.local()
BytesLike = bytes | bytearray | memoryview


def content_hash(data: BytesLike) -> str:
    """Blob names: xxh3-128 of the raw bytes, as 32 lowercase hex digits."""
    return xxhash.xxh3_128_hexdigest(data)


@dataclass(frozen=True)
class Encoded:
    descriptor: str  # JSON, as stored in the index
    payload: BytesLike


def _compressor(level: int) -> zstandard.ZstdCompressor:
    cache = getattr(_local, "compressors", None)
    if cache is None:
        cache = _local.compressors = {}
    if level not in cache:
        cache[level] = zstandard.ZstdCompressor(level=level, write_content_size=True)
    return cache[level]


def encode(data: memoryview, level: int = DEFAULT_LEVEL) -> Encoded:
    """zstd when it pays, raw when it does not. Thread-safe: one compressor per thread."""
    if len(data) >= 64:
        packed = _compressor(level).compress(data)
        if len(packed) < len(data):
            return Encoded(json.dumps({"id": ZSTD, "v": 1, "level": level}, sort_keys=True), packed)
    return Encoded(json.dumps({"id": RAW, "v": 1}), data)


def decode_into(descriptor: str, source: BinaryIO, dest: memoryview, where: str) -> None:
    """Decode a whole blob into ``dest``, which must be exactly the raw size."""
    spec = json.loads(descriptor)
    codec, version = spec.get("id"), spec.get("v")
    if codec == RAW and version == 1:
        reader = source
    elif codec == ZSTD and version == 1:
        reader = zstandard.ZstdDecompressor().stream_reader(source, read_across_frames=False, closefd=False)
    else:
        raise CorruptStoreError(
            f"{where}: codec {descriptor} is not known to this tailorstore version; upgrade tailorstore"
        )
    filled = 0
    while filled < len(dest):
        n = reader.readinto(dest[filled:])
        if not n:
            break
        filled += n
    if filled != len(dest) or (codec == RAW and source.read(1)):
        raise CorruptStoreError(
            f"{where}: blob decodes to {filled} bytes where {len(dest)} were recorded; it is truncated or damaged"
        )
