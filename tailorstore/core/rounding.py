"""FP32 to bf16 or fp16 with numpy, bit for bit as torch's ``Tensor.to`` rounds on the CPU.

Derived weights are the FP32 master rounded to the weight's dtype. Doing the rounding here,
not with torch, lets checkout and verify run without importing torch (two seconds of every
``tailor`` process). Both conversions round to nearest, ties to even. NaNs follow torch too:
bf16 gives 0xFFFF for every NaN, fp16 keeps the sign and the top payload bits and sets the
quiet bit. ``tests/unit/core/test_rounding.py`` checks every one of these cases against torch.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import numpy as np

from tailorstore.core.errors import CorruptStoreError
from tailorstore.core.piece_slab import private_copy_buffer
from tailorstore.core.thread_buffers import thread_buffer

#: How the index marks a derived weight (atoms.derived).
ROUND_FROM_MASTER = "round-from-master"
#: The dtypes a weight can be derived in, by the names the index records.
ROUNDED_DTYPES = ("bfloat16", "float16")


def round_into(master: memoryview | bytes, dtype: str, out: memoryview) -> None:
    """Round the FP32 elements of ``master`` into ``out`` (2 bytes an element) as ``dtype``.

    Works through ``_CHUNK`` elements at a time with a scratch and a NaN mask that fit the L2
    cache and are kept per thread, so no call faults in new pages (far slower than the rounding
    itself: docs/PERFORMANCE.md, "Fresh pages"), as a piece-sized scratch and a fresh NaN mask per
    call did; on warm buffers both ways run at the same speed.
    """
    u = np.frombuffer(master, dtype=np.uint32)
    dest = np.frombuffer(out, dtype=np.uint16)
    if dest.size != u.size:
        raise ValueError(f"rounding {u.size} elements into room for {dest.size}")
    if dtype not in ROUNDED_DTYPES:
        raise CorruptStoreError(f"cannot derive a {dtype} weight from an FP32 master; upgrade tailorstore")
    t = _scratch(min(u.size, _CHUNK))
    nan = thread_buffer("round-nan", min(u.size, _CHUNK)).view(np.bool_)
    for start in range(0, u.size, _CHUNK):
        part = u[start : start + _CHUNK]
        into = dest[start : start + _CHUNK]
        n = part.size
        if dtype == "bfloat16":
            _bf16_chunk(part, into, t[:n])
        else:
            with np.errstate(over="ignore"):
                np.copyto(into.view(np.float16), part.view(np.float32), casting="unsafe")
        mask = nan[:n]
        np.isnan(part.view(np.float32), out=mask)
        if mask.any():
            _fix_nans(part, into, mask, dtype)


#: Elements rounded per pass: 128 Ki FP32 elements, 512 KiB of input and as much scratch (L2 is 1 MiB).
_CHUNK = 1 << 17


def _bf16_chunk(u: np.ndarray, dest: np.ndarray, t: np.ndarray) -> None:
    """(u + 0x7FFF + lowest kept bit) >> 16, in place in the scratch ``t``: no temporaries.
    Wraps only for NaNs, which the caller sets afterwards."""
    np.right_shift(u, 16, out=t)
    np.bitwise_and(t, 1, out=t)
    np.add(t, 0x7FFF, out=t)
    np.add(t, u, out=t)
    np.right_shift(t, 16, out=t)
    np.copyto(dest, t, casting="unsafe")


def _fix_nans(u: np.ndarray, dest: np.ndarray, nan: np.ndarray, dtype: str) -> None:
    """NaNs as torch gives them: bf16 0xFFFF for every NaN; fp16 keeps the sign and the top
    payload bits and sets the quiet bit."""
    if dtype == "bfloat16":
        dest[nan] = 0xFFFF
        return
    sign = (u[nan] >> np.uint32(16)) & np.uint32(0x8000)
    dest[nan] = (sign | np.uint32(0x7E00) | ((u[nan] >> np.uint32(13)) & np.uint32(0x3FF))).astype(np.uint16)


def _scratch(n: int) -> np.ndarray:
    """This thread's uint32 buffer of ``n`` elements (reused: fresh pages are slow here)."""
    return thread_buffer("round-scratch", n * 4).view(np.uint32)


def rounded_chunks(pieces: Iterable[memoryview], dtype: str, buffer: str = "rounded") -> Iterator[memoryview]:
    """Each FP32 piece rounded to ``dtype`` into this thread's reused buffer named ``buffer``:
    a stream of weights from a stream of masters, each view valid until the next. Streams that
    can nest (a rebuilt weight read by export) use different names."""
    for piece in pieces:
        out = memoryview(thread_buffer(buffer, len(piece) // 2))
        round_into(piece, dtype, out)
        yield out


def rounded(master: memoryview | bytes, dtype: str) -> memoryview:
    """A new buffer holding ``master`` rounded to ``dtype`` (reused memory: piece_slab.py)."""
    out = private_copy_buffer(len(master) // 2)
    round_into(master, dtype, out)
    return out


def widened(data: memoryview | bytes, dtype: str) -> np.ndarray:
    """Floating-point elements as float32 (bf16 and fp16 widen exactly), for measuring change."""
    if dtype == "bfloat16":
        return (np.frombuffer(data, dtype=np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)
    try:
        return np.frombuffer(data, dtype=np.dtype(dtype)).astype(np.float32, copy=False)
    except TypeError:
        raise CorruptStoreError(f"cannot read {dtype} elements as numbers; upgrade tailorstore") from None
