"""The archive codec: a weight stored lossily, as a quantized residual against an earlier blob.

Steps kept only for evaluation and averaging do not need their weights bit for bit. The
archive tier (curate/thinning.py) stores each large float weight as integer codes on a
per-group grid, against the weight of the previous archived step of the same run as it reads
back (its *reconstruction*, never its exact value), so error does not accumulate along a chain:
every archived weight is within half a grid step of its exact value, however long its chain.

A blob is still named by the xxh3-128 of its raw bytes. Here the raw bytes are the
*reconstruction* in the weight's own dtype, which the reader rebuilds and hash-checks as it
does every blob; the codec descriptor names the chain of blobs it is built on (``bases``, the
keyframe first), so the index knows what an archived blob needs without decoding it, and gc
keeps that chain alive (store/index/_index.py).

Encoding, per group of ``GROUP`` consecutive elements ``x`` (as FP32) over the base ``b`` (the
previous blob's elements as FP32, or zeros for a keyframe):

- ``scale = max|x| / levels`` (FP32); a group of zeros gets scale 0;
- ``code = rint((x - b) / scale)``, stored as int8 when every code fits, else int16;
- reconstruction ``y = b + code * scale`` (FP32, multiply then add), a scale-0 group giving +0.0,
  then rounded to the weight's dtype (round to nearest even).

So ``|x - y| <= scale / 2`` before the final rounding (checked when written), plus half a unit
in the last place of the dtype. FORMAT.md section 2.1 specifies the payload byte for byte.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import zstandard

from tailorstore.core.errors import CorruptStoreError
from tailorstore.store.codec import decompress_bounded

ARCHIVE = "archive-delta"
VERSION = 1
GROUP = 256  # elements per scale
DEFAULT_LEVELS = 31  # a keyframe's codes span [-31, 31]: each value within 1/62 of its group's largest
MAX_CHAIN = 64  # bases one blob may name (a reader refuses more: hostile input)
CHUNK_ELEMENTS = 1 << 22  # elements worked through at once: a few 16 MiB FP32 temporaries
PAYLOAD_LEVEL = 9  # zstd level of the payload: gc writes archives rarely, and residuals compress well
ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}
_HEX = frozenset("0123456789abcdef")


def _np() -> Any:
    import numpy

    return numpy


@dataclass(frozen=True)
class ArchiveSpec:
    """A parsed, checked descriptor of the archive codec."""

    dtype: str
    group: int
    width: int  # bytes per code: 1 (int8) or 2 (int16)
    levels: int
    bases: tuple[str, ...]  # keyframe first; empty for a keyframe

    def descriptor(self) -> str:
        fields = {"id": ARCHIVE, "v": VERSION, "dtype": self.dtype, "group": self.group, "width": self.width}
        fields |= {"levels": self.levels, "bases": list(self.bases)}
        return json.dumps(fields, sort_keys=True)


@dataclass(frozen=True)
class Archived:
    """One encoded weight: its reconstruction (the blob's raw bytes) and what is stored."""

    raw: bytearray
    payload: bytes
    spec: ArchiveSpec


def is_archive(descriptor: str) -> bool:
    return f'"{ARCHIVE}"' in descriptor


def parse(descriptor: str, raw_size: int, where: str) -> ArchiveSpec:
    """Check an archive descriptor read from the index (hostile: another host or anyone with
    bucket access may have written it)."""
    try:
        d = json.loads(descriptor)
    except ValueError:
        d = None
    if not isinstance(d, dict) or d.get("id") != ARCHIVE or d.get("v") != VERSION:
        raise CorruptStoreError(f"{where}: codec {descriptor[:200]} is not known to this tailorstore version")
    dtype, group, width, levels, bases = (d.get(k) for k in ("dtype", "group", "width", "levels", "bases"))
    ok = (
        dtype in ITEMSIZE
        and type(group) is int
        and 1 <= group <= 1 << 20
        and type(width) is int
        and width in (1, 2)
        and type(levels) is int
        and 1 <= levels <= 32767
        and isinstance(bases, list)
        and len(bases) <= MAX_CHAIN
        and all(isinstance(h, str) and len(h) == 32 and set(h) <= _HEX for h in bases)
        and raw_size % ITEMSIZE[dtype] == 0
    )
    if not ok:
        raise CorruptStoreError(f"{where}: archive codec {descriptor[:200]} is malformed; the store is damaged")
    return ArchiveSpec(dtype, group, width, levels, tuple(bases))


def _as_f32(data: memoryview | bytes | bytearray, dtype: str) -> Any:
    np = _np()
    if dtype == "float32":
        return np.frombuffer(data, dtype="<f4").astype(np.float32)
    if dtype == "float16":
        return np.frombuffer(data, dtype="<f2").astype(np.float32)
    return (np.frombuffer(data, dtype="<u2").astype(np.uint32) << 16).view(np.float32)  # bfloat16


def _store_as(values: Any, dtype: str, out: memoryview) -> None:
    """``values`` (FP32) into ``out`` in ``dtype``: as they are, or rounded to nearest even."""
    from tailorstore.core.rounding import round_into  # numpy: imported only where a weight is archived or read

    if dtype == "float32":
        out[:] = memoryview(values.astype("<f4")).cast("B")
    else:
        round_into(memoryview(values).cast("B"), dtype, out)


def reconstruct(codes: Any, scales: Any, base: Any | None, group: int) -> Any:
    """The FP32 reconstruction: ``base + codes * scale`` per group, multiply then add; a group of
    scale 0 is +0.0. Writer and reader both call this, so they agree bit for bit."""
    np = _np()
    n = codes.size
    padded = np.zeros(scales.size * group, dtype=np.float32)
    padded[:n] = codes
    grid = padded.reshape(scales.size, group)
    grid *= scales[:, None]
    if base is not None:
        padded[:n] += base
    grid[scales == 0] = 0.0
    return padded[:n]


def _payload_sizes(spec: ArchiveSpec, raw_size: int) -> tuple[int, int]:
    n = raw_size // ITEMSIZE[spec.dtype]
    groups = -(-n // spec.group)
    return n, groups


def _runs(n: int, group: int) -> Iterator[tuple[int, int]]:
    """The element runs ``[lo, hi)`` a weight is worked through, whole groups each: memory stays
    at a few runs of FP32 temporaries whatever the tensor's size."""
    step = max(1, CHUNK_ELEMENTS // group) * group
    for lo in range(0, n, step):
        yield lo, min(n, lo + step)


def _quantized_run(x: Any, b: Any | None, levels: int) -> tuple[Any, Any] | None:
    """One run's scales and int16 codes, or None beyond what int16 codes hold."""
    np = _np()
    n = x.size
    groups = -(-n // GROUP)
    padded = np.zeros(groups * GROUP, dtype=np.float32)
    np.abs(x, out=padded[:n])
    scales = (padded.reshape(groups, GROUP).max(axis=1) / np.float32(levels)).astype(np.float32)
    padded[:n] = x if b is None else x - b
    safe = np.where(scales == 0, np.float32(1), scales)
    with np.errstate(over="ignore", invalid="ignore"):
        steps = padded.reshape(groups, GROUP) / safe[:, None]
    steps[scales == 0] = 0
    codes = np.rint(steps).reshape(-1)[:n]
    widest = float(np.abs(codes).max())
    if not np.isfinite(widest) or widest > 32767:
        return None
    return scales, codes.astype(np.int16)  # integers, as a reader has them: rint's -0.0 would stay -0.0


def encode(
    exact: memoryview, dtype: str, base: memoryview | None, bases: tuple[str, ...], levels: int = DEFAULT_LEVELS
) -> Archived | None:
    """Quantize ``exact`` (a ``dtype`` weight's bytes) against ``base`` (the reconstruction it
    builds on, ``bases[-1]``'s bytes) or as a keyframe (``base`` None). None when it cannot be
    archived within its bound: a value that is not finite, or codes wider than int16.

    Worked through in runs of whole groups (each element's arithmetic is its own, so runs give
    the very bytes one pass would): besides the weight, its base and its reconstruction, memory
    holds its int16 codes and a run's temporaries."""
    np = _np()
    size = ITEMSIZE[dtype]
    n = len(exact) // size
    if n == 0 or (base is not None and len(base) != len(exact)):
        return None
    scales = np.empty(-(-n // GROUP), dtype=np.float32)
    codes = np.empty(n, dtype=np.int16)
    raw = bytearray(n * size)
    for lo, hi in _runs(n, GROUP):
        x = _as_f32(exact[lo * size : hi * size], dtype)
        b = _as_f32(base[lo * size : hi * size], dtype) if base is not None else None
        if not np.isfinite(x).all() or (b is not None and not np.isfinite(b).all()):
            return None
        run = _quantized_run(x, b, levels)
        if run is None:
            return None
        run_scales, run_codes = run
        y = reconstruct(run_codes, run_scales, b, GROUP)
        bound = np.repeat(run_scales * np.float32(0.5 * (1 + 2**-10)), GROUP)[: x.size]
        if not (np.isfinite(y).all() and (np.abs(x - y) <= bound).all()):
            return None  # the bound is an invariant of every archived blob, checked here once
        scales[lo // GROUP : lo // GROUP + run_scales.size] = run_scales
        codes[lo:hi] = run_codes
        _store_as(y, dtype, memoryview(raw)[lo * size : hi * size])
    width = 1 if int(np.abs(codes).max()) <= 127 else 2
    stored = codes.astype("<i1") if width == 1 else codes.astype("<i2", copy=False)
    frame = zstandard.ZstdCompressor(level=PAYLOAD_LEVEL).compressobj()
    payload = frame.compress(scales.astype("<f4", copy=False).tobytes()) + frame.compress(memoryview(stored).cast("B"))
    return Archived(raw, payload + frame.flush(), ArchiveSpec(dtype, GROUP, width, levels, bases))


def decode_into(spec: ArchiveSpec, payload: bytes, base: memoryview | None, dest: memoryview, where: str) -> None:
    """Rebuild an archived blob's raw bytes into ``dest`` from its payload and its base's raw bytes
    (None for a keyframe); the caller checks the hash."""
    np = _np()
    if (base is None) != (not spec.bases):
        raise CorruptStoreError(f"{where}: the archived blob's base is missing")
    n, groups = _payload_sizes(spec, len(dest))
    want = 4 * groups + spec.width * n
    try:
        body = decompress_bounded(payload, want)
    except zstandard.ZstdError as exc:
        raise CorruptStoreError(f"{where}: the archived payload does not decode ({exc}); the blob is damaged") from None
    if len(body) != want:
        raise CorruptStoreError(f"{where}: the archived payload holds {len(body)} bytes, not {want}; damaged")
    scales = np.frombuffer(body, dtype="<f4", count=groups).astype(np.float32)
    codes = np.frombuffer(body, dtype="<i1" if spec.width == 1 else "<i2", offset=4 * groups)
    if not np.isfinite(scales).all() or (scales < 0).any():
        raise CorruptStoreError(f"{where}: the archived payload's scales are not finite; the blob is damaged")
    size = ITEMSIZE[spec.dtype]
    for lo, hi in _runs(n, spec.group):
        b = _as_f32(base[lo * size : hi * size], spec.dtype) if base is not None else None
        first = lo // spec.group
        run_scales = scales[first : first + -(-(hi - lo) // spec.group)]
        _store_as(reconstruct(codes[lo:hi], run_scales, b, spec.group), spec.dtype, dest[lo * size : hi * size])
