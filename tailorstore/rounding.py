"""FP32 to bf16 or fp16 with numpy, bit for bit as torch's ``Tensor.to`` rounds on the CPU.

Derived weights are the FP32 master rounded to the weight's dtype. Doing the rounding here,
not with torch, lets checkout and verify run without importing torch (two seconds of every
``tailor`` process). Both conversions round to nearest, ties to even. NaNs follow torch too:
bf16 gives 0xFFFF for every NaN, fp16 keeps the sign and the top payload bits and sets the
quiet bit. ``tests/test_rounding.py`` checks every one of these cases against torch.
"""

from __future__ import annotations

import threading

import numpy as np

from .errors import CorruptStoreError

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


_local = threading.local()


def _scratch(n: int) -> np.ndarray:
    """This thread's uint32 buffer of at least ``n`` elements (reused: fresh pages are slow here)."""
    buf = getattr(_local, "buf", None)
    if buf is None or buf.size < n:
        buf = _local.buf = np.empty(n, dtype=np.uint32)
    return buf[:n]


def rounded(master: memoryview | bytes, dtype: str) -> memoryview:
    """A new buffer holding ``master`` rounded to ``dtype``."""
    out = memoryview(bytearray(len(master) // 2))
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
