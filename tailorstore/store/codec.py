"""Codecs, each recorded per blob as a versioned descriptor.

A descriptor is a small JSON object stored in the index beside the blob, e.g.
``{"id": "bytegroup-zstd", "v": 1, "typesize": 4, "level": 1}``. It says exactly how to
decode the blob, so codecs can be added without breaking old stores: a reader that meets an
``id`` or ``v`` it does not know refuses that blob with a clear message.

Codecs:

* ``raw`` v1: the bytes as they are (used whenever compression does not pay).
* ``zstd`` v1: one zstd frame, for non-float data (skeletons, configs, integer tensors).
* ``bytegroup-zstd`` v1 (written by default for float tensors): chunks of at most 4 MiB
  raw; in each, byte *k* of every element goes to plane *k* (byte grouping, as ZipNN and HF
  Xet do) and each plane is stored zstd-compressed or raw, whichever is smaller. In fp32
  training state only the sign/exponent plane compresses much; grouping exposes it. All of
  it runs in numpy and zstandard, which release the GIL, so two threads compress on two
  cores. Level 1 (the default) compresses the top plane with zstd's fast strategy, a small
  hash table and 7-byte minimum matches, and the lower planes of 4- and 8-byte floats with
  zstd level -5, which skips entropy coding where there is no entropy to code; on real
  training state that keeps within 2% of zstd-1 on every plane at about three times its
  speed (docs/benchmarks.md). A lower plane whose first 64 KiB do not shrink is stored raw
  without compressing the rest, and planes are split with shifts of whole words rather than
  strided byte copies; together 1.2-1.3x the encoding speed on trained FP32 state, with
  the ratio unchanged (docs/benchmarks.md). Any other level applies that zstd level to every plane.
  Chunks are independent, so a blob streams in and out with one chunk of memory.
* ``blosc2-shuffle-zstd`` v1 (read only; written by tailorstore 0.1): blosc2 chunks of at
  most 16 MiB raw with the SHUFFLE filter and zstd, back to back.

Every chunked codec validates sizes as it goes: a truncated or damaged blob raises
:class:`CorruptStoreError` instead of producing short output.
"""

from __future__ import annotations

import json
import struct
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, BinaryIO

import xxhash
import zstandard

from tailorstore.core.errors import CorruptStoreError
from tailorstore.core.thread_buffers import thread_buffer
from tailorstore.core.threads import usable_cores


class _NumpyOnUse:
    """numpy, imported the first time a plane is split or joined. Importing it takes more than a
    whole ``tailor log`` may spend (docs/PERFORMANCE.md, "Start-up: importing on first use"), and
    listing, tagging or showing steps decodes nothing."""

    def __getattr__(self, name: str) -> object:
        import numpy

        globals()["np"] = numpy  # every later use in this module goes straight to numpy
        return getattr(numpy, name)


np: Any = _NumpyOnUse()

RAW = "raw"
ZSTD = "zstd"
BYTEGROUP = "bytegroup-zstd"
BLOSC2 = "blosc2-shuffle-zstd"
DEFAULT_LEVEL = 1
GROUP_CHUNK = 4 << 20  # raw bytes per bytegroup chunk
MAX_CHUNK = 16 << 20  # the largest raw chunk any codec produces (blosc2's); decode buffers hold one
_CHUNK_HEAD = struct.Struct("<IB")  # raw bytes of the chunk, number of planes
_PLANE_HEAD = struct.Struct("<BI")  # mode, stored bytes
_PLANE_RAW, _PLANE_ZSTD = 0, 1
_BLOSC_HEADER = 16
_LOW_PLANES_LEVEL = -5
_local = threading.local()
BytesLike = bytes | bytearray | memoryview


def content_hash(data: BytesLike) -> str:
    """Blob names: xxh3-128 of the raw bytes, as 32 lowercase hex digits."""
    return xxhash.xxh3_128_hexdigest(data)


# zstd reaches about 32,768:1 at best (a block of zeros: measured 32,692:1 on 256 MiB), and the archive
# codec stores at least one byte of code for four raw bytes before zstd; so no real blob's raw size is
# more than this many times its stored size, plus a little for tiny blobs.
MOST_EXPANSION = 1 << 17
_SLACK = 1 << 20


def check_raw_size(raw_size: int, stored_size: int, where: str) -> None:
    """Before memory is allocated for a blob's raw bytes, as its index row gives them (a row a
    stranger's manifest object or pack trailer may have written): a 9-byte object claiming 2 GiB
    would cost ``verify --deep`` gigabytes, and 2**40 a MemoryError traceback
    (tests/system/test_planted_sizes.py)."""
    if not 0 <= raw_size <= stored_size * MOST_EXPANSION + _SLACK:
        raise CorruptStoreError(
            f"{where}: claims {raw_size} raw bytes from {stored_size} stored, more than any codec gives; the "
            "store's record of it is damaged"
        )


def decompress_bounded(data: BytesLike, limit: int) -> bytes:
    """One zstd frame, refused before anything is allocated when it declares more than ``limit``
    bytes, or more than its own length could decode to: zstandard allocates the size a frame
    declares whatever ``max_output_size`` says, so a hostile frame of a few bytes could ask for a
    terabyte. A frame that declares no size is decoded as a stream, memory growing with what it
    really holds: given ``max_output_size``, zstandard allocated all of it at once, 2 GiB for a
    753-byte manifest object (found by ``benchmarks.fuzz``). Raises ``zstandard.ZstdError``."""
    declared = zstandard.frame_content_size(data)
    most = min(limit, len(data) * MOST_EXPANSION + _SLACK)
    if declared > most:
        raise zstandard.ZstdError(f"the frame declares {declared} bytes, more than the {most} it may hold")
    if declared >= 0:
        return zstandard.ZstdDecompressor().decompress(data, max_output_size=max(declared, 1))
    out = bytearray()
    with zstandard.ZstdDecompressor().stream_reader(bytes(data), read_across_frames=False) as reader:
        while chunk := reader.read(1 << 20):
            out += chunk
            if len(out) > most:
                raise zstandard.ZstdError(f"the frame holds more than the {most} bytes it may")
    return bytes(out)


@dataclass
class Encoded:
    """A blob's descriptor and its stored bytes, produced lazily chunk by chunk."""

    descriptor: str  # JSON, as stored in the index
    chunks: Iterator[BytesLike] | list[BytesLike]
    size: int = field(default=0)  # stored bytes, complete once ``chunks`` is exhausted

    def __iter__(self) -> Iterator[BytesLike]:
        for chunk in self.chunks:
            self.size += len(chunk)
            yield chunk


def _descriptor(**fields: object) -> str:
    return json.dumps(fields, sort_keys=True)


def _compressor(level: int) -> zstandard.ZstdCompressor:
    """One compressor per thread and level: zstandard's objects are not safe to share."""
    cache = getattr(_local, "zstd", None)
    if cache is None:
        cache = _local.zstd = {}
    if level not in cache:
        if level == 1:  # fast strategy, small hash table, long minimum match: zstd 1's ratio, twice its speed
            params = zstandard.ZstdCompressionParameters(
                strategy=zstandard.STRATEGY_FAST,
                window_log=17,
                hash_log=8,
                chain_log=8,
                search_log=1,
                min_match=7,
                target_length=0,
                write_content_size=True,
            )
            cache[level] = zstandard.ZstdCompressor(compression_params=params)
        else:
            cache[level] = zstandard.ZstdCompressor(level=level, write_content_size=True)
    return cache[level]


def encode(data: memoryview, *, itemsize: int = 1, is_float: bool = False, level: int = DEFAULT_LEVEL) -> Encoded:
    """The codec for these bytes; float data streams out chunk by chunk. Thread-safe; parallelism
    comes from the caller's threads, since every codec here releases the GIL."""
    n = len(data)
    if is_float and itemsize in (2, 4, 8) and n >= 256 and n % itemsize == 0:
        return Encoded(
            _descriptor(id=BYTEGROUP, v=1, typesize=itemsize, level=level), _bytegroup_chunks(data, itemsize, level)
        )
    if n >= 64:
        packed = _compressor(level).compress(data)
        if len(packed) < n:
            return Encoded(_descriptor(id=ZSTD, v=1, level=level), [packed])
    return Encoded(_descriptor(id=RAW, v=1), [data])


def encode_stream(chunks: Iterator[memoryview], *, level: int = DEFAULT_LEVEL) -> Encoded:
    """One zstd frame over chunks that arrive one at a time (large raw files): memory stays at a chunk."""

    def frames() -> Iterator[bytes]:
        compressor = _compressor(level).compressobj()
        for chunk in chunks:
            out = compressor.compress(chunk)
            if out:
                yield out
        yield compressor.flush()

    return Encoded(_descriptor(id=ZSTD, v=1, level=level), frames())


def _bytegroup_chunks(data: memoryview, itemsize: int, level: int) -> Iterator[BytesLike]:
    elements = np.frombuffer(data, dtype=np.uint8).reshape(-1, itemsize)
    per_chunk = GROUP_CHUNK // itemsize
    top = _compressor(level)
    # Below the sign/exponent plane a 4- or 8-byte float's bytes are noise or runs of zeros: a
    # negative zstd level (no entropy coding, fast match search) keeps their ratio at 2.5x the speed,
    # and a plane whose sample does not shrink is stored raw without compressing it at all.
    fast = level == 1 and itemsize > 2
    low = _compressor(_LOW_PLANES_LEVEL) if fast else top
    for first in range(0, len(elements), per_chunk):
        rows = elements[first : first + per_chunk]
        m = len(rows)
        planes = thread_buffer("codec-planes", m * itemsize).reshape(itemsize, m)
        heads: list[bytes] = [_CHUNK_HEAD.pack(m * itemsize, itemsize)]
        payloads: list[BytesLike] = []
        for k, plane in enumerate(_split(rows, planes)):
            is_top = k == itemsize - 1
            worth_trying = is_top or not fast or _shrinks(low, plane)
            packed = (top if is_top else low).compress(plane) if worth_trying else None
            if packed is not None and len(packed) < m:
                heads.append(_PLANE_HEAD.pack(_PLANE_ZSTD, len(packed)))
                payloads.append(packed)
            else:
                heads.append(_PLANE_HEAD.pack(_PLANE_RAW, m))
                payloads.append(plane.data)
        yield b"".join(heads)
        yield from payloads


_WORDS = {2: "<u2", 4: "<u4", 8: "<u8"}  # numpy dtypes by name: views of a word of each size
_SAMPLE = 64 << 10  # bytes of a lower plane compressed to decide whether the rest is worth it
_SAMPLE_GAIN = 0.98  # the sample must shrink to this fraction or below


def _split(rows: np.ndarray, planes: np.ndarray) -> np.ndarray:
    """Byte k of every element into ``planes[k]``, for every k; returns ``planes``.

    On a little-endian machine byte k of an element is its word shifted right by 8k bits, so a
    shift and a narrowing copy, both contiguous, replace a copy with a stride of the element size.
    The words go through ``_SPLIT_BYTES`` at a time, every plane of a slice before the
    next slice, so the shifted scratch stays in the L2 cache and the words are read from memory
    once, faster than whole-chunk passes (docs/PERFORMANCE.md, "Byte planes").

    Above four usable cores each plane is one strided copy instead. The slices cost about 60
    numpy calls a 4 MiB chunk, each taking and dropping the GIL, and on a 16-core node the
    pool's threads queued for it: the split alone slowed down past 4 threads, while one strided
    copy a plane kept scaling (docs/PERFORMANCE.md, "Byte planes"). The planes are the same bytes
    either way."""
    itemsize = rows.shape[1]
    words_ok = sys.byteorder == "little" and rows.ctypes.data % itemsize == 0
    if not words_ok or _MANY_CORES:
        for k in range(itemsize):
            np.copyto(planes[k], rows[:, k])
        return planes
    words = rows.reshape(-1).view(_WORDS[itemsize])
    per_slice = _SPLIT_BYTES // itemsize
    scratch = thread_buffer("codec-shift", min(len(words), per_slice) * itemsize).view(_WORDS[itemsize])
    for first in range(0, len(words), per_slice):
        part = words[first : first + per_slice]
        shifted = scratch[: len(part)]
        end = first + len(part)
        np.copyto(planes[0, first:end], part, casting="unsafe")  # the narrowing keeps the low 8 bits: byte 0
        for k in range(1, itemsize):
            np.right_shift(part, 8 * k, out=shifted)
            np.copyto(planes[k, first:end], shifted, casting="unsafe")
    return planes


#: Bytes of words split per slice: the slice and its shifted scratch fit the 1 MiB L2 of a core.
_SPLIT_BYTES = 512 << 10
_MANY_CORES = usable_cores() > 4


def _shrinks(compressor: zstandard.ZstdCompressor, plane: np.ndarray) -> bool:
    """Whether compressing a lower plane of FP32 or FP64 state can pay: those bytes are noise in
    trained weights and moments (they shrink by 0.2% at best), and trying costs more than the
    rest of the encoding. A plane of zeros or repeated values shrinks in any sample of it."""
    if len(plane) <= 2 * _SAMPLE:
        return True
    return len(compressor.compress(plane[:_SAMPLE])) <= _SAMPLE * _SAMPLE_GAIN


# -- decoding -------------------------------------------------------------------------------

Space = Callable[[int], memoryview]  # gives the destination for the next n decoded bytes


def decode_pieces(descriptor: str, source: BinaryIO, raw_size: int, space: Space, where: str) -> Iterator[memoryview]:
    """Decode a blob piece by piece (each at most MAX_CHUNK bytes) into ``space(n)``.

    Yields each filled piece; raises CorruptStoreError when the blob decodes to anything
    but ``raw_size`` bytes or does not parse.
    """
    spec = _parse(descriptor, where)
    codec = spec["id"]
    if codec == RAW:
        yield from _stream(source, raw_size, space, where)
        return
    if codec == ZSTD:
        reader = zstandard.ZstdDecompressor().stream_reader(source, read_across_frames=False, closefd=False)
        try:
            yield from _stream(reader, raw_size, space, where)
        except zstandard.ZstdError as exc:
            raise CorruptStoreError(f"{where}: the zstd frame does not decode ({exc}); the blob is damaged") from None
        return
    filled = 0
    chunk_reader = _bytegroup_chunk if codec == BYTEGROUP else _blosc2_chunk
    while True:
        piece = chunk_reader(source, space, raw_size - filled, where)
        if piece is None:
            break
        filled += len(piece)
        yield piece
    if filled != raw_size:
        _short(where, filled, raw_size)


def _stream(reader: BinaryIO, raw_size: int, space: Space, where: str) -> Iterator[memoryview]:
    """Unframed bytes (raw, or a zstd stream): exactly ``raw_size`` of them, in MAX_CHUNK pieces."""
    filled = 0
    while filled < raw_size:
        dest = space(min(MAX_CHUNK, raw_size - filled))
        got = _read_into(reader, dest)
        if got != len(dest):
            _short(where, filled + got, raw_size)
        filled += got
        yield dest
    if reader.read(1):
        _long(where, raw_size)


def decode_into(descriptor: str, source: BinaryIO, dest: memoryview, where: str) -> None:
    """Decode a whole blob into ``dest``, which must be exactly the raw size."""
    filled = 0

    def space(n: int) -> memoryview:
        nonlocal filled
        view = dest[filled : filled + n]
        filled += n
        return view

    for _ in decode_pieces(descriptor, source, len(dest), space, where):
        pass


def _parse(descriptor: str, where: str) -> dict:
    try:
        spec = json.loads(descriptor)
    except ValueError:
        spec = {}
    known = {RAW: 1, ZSTD: 1, BYTEGROUP: 1, BLOSC2: 1}
    if not isinstance(spec, dict) or known.get(spec.get("id")) != spec.get("v"):
        raise CorruptStoreError(f"{where}: codec {descriptor} is not known to this tailorstore version; upgrade it")
    return spec


def _short(where: str, got: int, want: int) -> None:
    raise CorruptStoreError(
        f"{where}: decodes to {got} bytes where {want} were recorded; the blob is truncated or damaged"
    )


def _long(where: str, want: int) -> None:
    raise CorruptStoreError(
        f"{where}: decodes to more than the {want} bytes recorded; the blob is truncated or damaged"
    )


def _read_into(reader: BinaryIO, dest: memoryview) -> int:
    filled = 0
    while filled < len(dest):
        n = reader.readinto(dest[filled:])  # type: ignore[attr-defined]
        if not n:
            break
        filled += n
    return filled


def _read_exact(source: BinaryIO, n: int, where: str, what: str) -> memoryview:
    buf = memoryview(thread_buffer("codec-payload", n))
    if _read_into(source, buf) != n:
        raise CorruptStoreError(f"{where}: {what} is cut short; the blob is truncated")
    return buf


def _bytegroup_chunk(source: BinaryIO, space: Space, left: int, where: str) -> memoryview | None:
    head = source.read(_CHUNK_HEAD.size)
    if not head:
        return None
    if len(head) < _CHUNK_HEAD.size:
        raise CorruptStoreError(f"{where}: a chunk header is cut short; the blob is truncated")
    nbytes, planes = _CHUNK_HEAD.unpack(head)
    if planes not in (2, 4, 8) or nbytes % planes or nbytes > GROUP_CHUNK or nbytes > left:
        raise CorruptStoreError(f"{where}: a chunk header is damaged ({nbytes} bytes in {planes} planes)")
    table = bytes(_read_exact(source, _PLANE_HEAD.size * planes, where, "a plane table"))
    specs = [_PLANE_HEAD.unpack_from(table, i * _PLANE_HEAD.size) for i in range(planes)]
    payload = _read_exact(source, sum(length for _, length in specs), where, "a chunk")
    m = nbytes // planes
    dest = space(nbytes)
    decoded: list[np.ndarray] = []
    at = 0
    for mode, length in specs:
        stored = payload[at : at + length]
        at += length
        if mode == _PLANE_RAW and length == m:
            plane = np.frombuffer(stored, dtype=np.uint8)
        elif mode == _PLANE_ZSTD:
            try:
                plane = np.frombuffer(decompress_bounded(stored, m), dtype=np.uint8)
            except zstandard.ZstdError as exc:
                raise CorruptStoreError(f"{where}: a plane does not decode ({exc}); the blob is damaged") from None
            if len(plane) != m:
                raise CorruptStoreError(f"{where}: a plane decodes to {len(plane)} bytes, not {m}; the blob is damaged")
        else:
            raise CorruptStoreError(f"{where}: a plane entry is damaged (mode {mode}, {length} bytes)")
        decoded.append(plane)
    _join(decoded, np.frombuffer(dest, dtype=np.uint8).reshape(m, planes))
    return dest


def _join(planes: list[np.ndarray], grid: np.ndarray) -> None:
    """Byte k of every element (``grid[:, k]``) from ``planes[k]``: the inverse of :func:`_split`,
    by its rule. On a little-endian machine with at most four usable cores each word is built from
    its bytes, the top plane widened and every lower one shifted in (seven contiguous passes over
    a 4 MiB chunk of FP32, in the L3 cache), instead of one copy a plane with a stride of the
    element size, which is slower (docs/PERFORMANCE.md, "Byte planes"), where joining was half of
    a DCP load's decoding time."""
    itemsize = grid.shape[1]
    if sys.byteorder != "little" or grid.ctypes.data % itemsize or _MANY_CORES:
        for k, plane in enumerate(planes):
            np.copyto(grid[:, k], plane)
        return
    words = grid.reshape(-1).view(_WORDS[itemsize])
    np.copyto(words, planes[-1], casting="unsafe")
    for plane in reversed(planes[:-1]):
        np.left_shift(words, 8, out=words)
        np.bitwise_or(words, plane, out=words, casting="unsafe")


def _blosc2_chunk(source: BinaryIO, space: Space, left: int, where: str) -> memoryview | None:
    import blosc2

    header = source.read(_BLOSC_HEADER)
    if not header:
        return None
    if len(header) < _BLOSC_HEADER:
        raise CorruptStoreError(f"{where}: a blosc2 chunk header is cut short; the blob is truncated")
    nbytes, _blocksize, cbytes = struct.unpack("<iii", header[4:16])
    if nbytes < 0 or nbytes > MAX_CHUNK or nbytes > left or cbytes < _BLOSC_HEADER:
        raise CorruptStoreError(f"{where}: a blosc2 chunk header is damaged; the blob is truncated or damaged")
    body = source.read(cbytes - _BLOSC_HEADER)
    if len(body) != cbytes - _BLOSC_HEADER:
        raise CorruptStoreError(f"{where}: a blosc2 chunk is cut short; the blob is truncated")
    dest = space(nbytes)
    try:
        blosc2.decompress2(header + body, dst=dest, nthreads=1)
    except Exception as exc:  # blosc2 raises RuntimeError or ValueError on damaged input
        raise CorruptStoreError(f"{where}: a blosc2 chunk does not decode ({exc}); the blob is damaged") from None
    return dest
