"""Packs: many small blobs in one object, as restic does.

One object per blob costs too much for checkpoints full of small tensors (biases, norms,
per-parameter optimizer ``step`` counters): on a file system every object is an inode and
a block rounded up, on S3 every object is a request. A commit therefore writes blobs whose
raw size is under ``PACK_BELOW`` into packs of about ``PACK_TARGET`` bytes.

A pack is ``packs/XX/<name>``, ``name`` the xxh3-128 of the pack's bytes::

    blob bytes, back to back (each exactly as a loose blob object would hold it)
    trailer: zstd frame of JSON {"blobs": [[hash, offset, stored_size, raw_size, codec], ...]}
    8 bytes: the trailer's length, little-endian
    8 bytes: b"TLRPACK1"

The trailer makes a pack self-describing: an index can be rebuilt from the packs and the
manifest objects alone, and gc can move a blob to another pack (repack) without touching
any manifest, since manifests name blobs by hash only.
"""

from __future__ import annotations

import json
import struct
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import xxhash
import zstandard

from tailorstore.core.errors import Call, CorruptStoreError
from tailorstore.core.object_keys import HASH_NAME, PACK_PREFIX, pack_key, pack_name
from tailorstore.store.backends.base import Backend, Batch
from tailorstore.store.codec import decompress_bounded

PACK_BELOW = 1 << 20  # blobs of a smaller raw size go into packs
PACK_TARGET = 16 << 20  # a pack is sealed once it holds this many bytes
MAGIC = b"TLRPACK1"
_FOOT = struct.Struct("<Q8s")


@dataclass(frozen=True)
class PackEntry:
    hash: str
    offset: int
    stored_size: int
    raw_size: int
    codec: str


def pack_names(backend: Backend) -> Iterator[str]:
    for key in backend.list(PACK_PREFIX):
        name = pack_name(key)
        if name is not None:
            yield name


def seal(entries: list[tuple[str, bytes, int, str]]) -> tuple[str, list[bytes], list[PackEntry]]:
    """(hash, stored bytes, raw size, codec) of each blob -> the pack's name, its bytes as chunks
    to write one after another, and its entries.

    The blobs are not joined into one buffer: a 16 MB pack built by appending, then copied
    out, faulted in about 40 MB of fresh memory per pack, a tenth of a commit's CPU on this
    machine kind (docs/benchmarks.md). The name is hashed over the same chunks, in order."""
    placed = []
    chunks: list[bytes] = []
    offset = 0
    name = xxhash.xxh3_128()
    for digest, data, raw_size, codec in entries:
        placed.append(PackEntry(digest, offset, len(data), raw_size, codec))
        chunks.append(data)
        name.update(data)
        offset += len(data)
    trailer = zstandard.ZstdCompressor(level=3).compress(
        json.dumps({"blobs": [[e.hash, e.offset, e.stored_size, e.raw_size, e.codec] for e in placed]}).encode()
    )
    tail = trailer + _FOOT.pack(len(trailer), MAGIC)
    chunks.append(tail)
    name.update(tail)
    return name.hexdigest(), chunks, placed


def read_trailer(backend: Backend, name: str) -> tuple[int, list[PackEntry]]:
    """The pack's size and entries, read with two ranged gets (foot, then trailer)."""
    key = pack_key(name)
    size = backend.size(key)
    if size < _FOOT.size:
        raise CorruptStoreError(f"pack {name} is cut short ({size} bytes); run ", Call("verify", deep=True))
    length, magic = _FOOT.unpack(backend.get(key, size - _FOOT.size, _FOOT.size))
    if magic != MAGIC or length > size - _FOOT.size:
        raise CorruptStoreError(
            f"pack {name} has no valid trailer; it is damaged. Run ", Call("verify", deep=True), "."
        )
    try:
        raw = decompress_bounded(backend.get(key, size - _FOOT.size - length, length), 1 << 30)
        rows = json.loads(raw)["blobs"]
        entries = [PackEntry(h, o, s, r, c) for h, o, s, r, c in rows]
        body = size - _FOOT.size - length
        for e in entries:  # the index takes these rows as they are: a reader of the pack trusts them
            numbers = (e.offset, e.stored_size, e.raw_size)
            if not (isinstance(e.hash, str) and isinstance(e.codec, str)) or not all(
                type(n) is int and 0 <= n < 1 << 62 for n in numbers
            ):
                raise ValueError(f"entry {e.hash!r:.40} at {e.offset!r:.40} of {e.stored_size!r:.40} bytes")
            if not HASH_NAME.fullmatch(e.hash):
                raise ValueError(f"entry {e.hash!r:.40} at {e.offset} of {e.stored_size} bytes")
            if e.offset + e.stored_size > body:
                raise ValueError(f"blob {e.hash} ends at {e.offset + e.stored_size}, past the body's {body} bytes")
    except (zstandard.ZstdError, ValueError, KeyError, TypeError, RecursionError) as exc:
        raise CorruptStoreError(
            f"pack {name}: its trailer is damaged ({exc}); run ", Call("verify", deep=True)
        ) from None
    return size, entries


class PackWriter:
    """Collects small encoded blobs and puts a pack into the batch whenever one is full.

    Thread-safe: compression workers add blobs concurrently. ``placed`` maps each blob's
    hash to (pack name, offset) once its pack is sealed; ``sealed`` lists (name, size).
    """

    def __init__(self, batch: Batch) -> None:
        self._batch = batch
        self._lock = threading.Lock()
        self._open: list[tuple[str, bytes, int, str]] = []
        self._bytes = 0
        self.placed: dict[str, tuple[str, int]] = {}
        self.sealed: list[tuple[str, int]] = []

    def add(self, digest: str, data: bytes, raw_size: int, codec: str) -> None:
        with self._lock:
            self._open.append((digest, data, raw_size, codec))
            self._bytes += len(data)
            if self._bytes < PACK_TARGET:
                return
            full, self._open, self._bytes = self._open, [], 0
        self._write(full)

    def flush(self) -> None:
        with self._lock:
            rest, self._open, self._bytes = self._open, [], 0
        if rest:
            self._write(rest)

    def _write(self, entries: list[tuple[str, bytes, int, str]]) -> None:
        name, chunks, placed = seal(entries)
        size = sum(len(c) for c in chunks)
        self._batch.put(pack_key(name), chunks, size)
        with self._lock:
            self.sealed.append((name, size))
            for e in placed:
                self.placed[e.hash] = (name, e.offset)
