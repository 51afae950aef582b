"""FP32 to bf16 or fp16 with numpy, bit for bit as torch's ``Tensor.to`` rounds on the CPU.

Derived weights are the FP32 master rounded to the weight's dtype. Doing the rounding here,
not with torch, lets checkout and verify run without importing torch (two seconds of every
``tailor`` process). Both conversions round to nearest, ties to even. NaNs follow torch too:
bf16 gives 0xFFFF for every NaN, fp16 keeps the sign and the top payload bits and sets the
quiet bit. ``tests/test_rounding.py`` checks every one of these cases against torch.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import numpy as np

from .errors import CorruptStoreError
from .reused_memory import private_copy_buffer
from .thread_buffers import thread_buffer

#: How the index marks a derived weight (atoms.derived).
ROUND_FROM_MASTER = "round-from-master"
#: The dtypes a weight can be derived in, by the names the index records.
ROUNDED_DTYPES = ("bfloat16", "float16")


def round_into(master: memoryview | bytes, dtype: str, out: memoryview) -> None:
    """Round the FP32 elements of ``master`` into ``out`` (2 bytes an element) as ``dtype``."""
    u = np.frombuffer(master, dtype=np.uint32)
    dest = np.frombuffer(out, dtype=np.uint16)
    if dest.size != u.size:
        raise ValueError(f"rounding {u.size} elements into room for {dest.size}")
    nan = np.isnan(u.view(np.float32))
    if dtype == "bfloat16":
        # (u + 0x7FFF + lowest kept bit) >> 16, in place in one scratch buffer: no temporaries
        t = _scratch(u.size)
        np.right_shift(u, 16, out=t)
        np.bitwise_and(t, 1, out=t)
        np.add(t, 0x7FFF, out=t)
        np.add(t, u, out=t)  # wraps only for NaNs, which are set below
        np.right_shift(t, 16, out=t)
        np.copyto(dest, t, casting="unsafe")
        if nan.any():
            dest[nan] = 0xFFFF
    elif dtype == "float16":
        with np.errstate(over="ignore"):
            np.copyto(dest, u.view(np.float32).astype(np.float16).view(np.uint16))
        if nan.any():
            sign = (u[nan] >> np.uint32(16)) & np.uint32(0x8000)
            dest[nan] = (sign | np.uint32(0x7E00) | ((u[nan] >> np.uint32(13)) & np.uint32(0x3FF))).astype(np.uint16)
    else:
        raise CorruptStoreError(f"cannot derive a {dtype} weight from an FP32 master; upgrade tailorstore")


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
    """A new buffer holding ``master`` rounded to ``dtype`` (reused memory: reused_memory.py)."""
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
