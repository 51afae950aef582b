"""numpy's rounding of FP32 masters to bf16 and fp16 must equal torch's ``Tensor.to`` bit for bit:
derived weights recorded by either are rebuilt by the other (and DeepSpeed rounds with torch)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tailorstore.core.rounding import rounded, widened


def _interesting_floats() -> np.ndarray:
    """Every bf16 value with the low halves where rounding decides (ties, one either side,
    all ones), every NaN and infinity class, fp16's subnormal and overflow edges, and noise."""
    high = np.arange(1 << 16, dtype=np.uint32) << np.uint32(16)
    lows = np.array([0, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF, 0x1000, 0x0FFF], dtype=np.uint32)
    grid = (high[:, None] | lows[None, :]).reshape(-1)
    fp16_edges = np.arange(0x33000000, 0x33000000 + (1 << 20), 97, dtype=np.uint32)  # around fp16's subnormals
    fp16_top = np.arange(0x477FE000, 0x47801000, dtype=np.uint32)  # around 65504 and the overflow to inf
    rng = np.random.default_rng(7)
    noise = rng.integers(0, 1 << 32, size=1 << 20, dtype=np.uint64).astype(np.uint32)
    return np.concatenate([grid, fp16_edges, fp16_top, noise])


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_numpy_rounding_equals_torch_bit_for_bit(dtype: str) -> None:
    bits = _interesting_floats()
    ours = np.frombuffer(rounded(bits.tobytes(), dtype), dtype=np.uint16)
    theirs = torch.from_numpy(bits.view(np.float32)).to(getattr(torch, dtype)).view(torch.int16).numpy()
    differ = np.nonzero(ours != theirs.view(np.uint16))[0]
    assert differ.size == 0, f"{differ.size} differ, first {hex(bits[differ[0]])}: {hex(ours[differ[0]])}"


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_widening_is_exact(dtype: str) -> None:
    values = torch.randn(4096).to(getattr(torch, dtype))
    raw = values.view(torch.int16).numpy().tobytes()
    assert np.array_equal(widened(raw, dtype), values.float().numpy())
