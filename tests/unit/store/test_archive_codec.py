"""The archive codec (store/archive_codec.py): its error bound over a long chain, values it cannot
archive, hostile descriptors and damaged payloads, weights larger than a run. The archive tier on
real DeepSpeed runs is in tests/system/test_archive.py."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tailorstore.core.errors import CorruptStoreError
from tailorstore.store import archive_codec


def test_a_long_chain_does_not_accumulate_error() -> None:
    """Each link is quantized against the previous link's reconstruction, so every step of a
    40-link chain of drifting weights is within its own bound of its exact values."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal(10_000).astype(np.float32) * 0.02
    base: bytearray | None = None
    bases: tuple[str, ...] = ()
    sizes = []
    for _ in range(40):
        x = x + rng.standard_normal(x.size).astype(np.float32) * 1e-4  # a training step's drift
        out = archive_codec.encode(memoryview(x.tobytes()), "float32", base and memoryview(base), bases)
        assert out is not None
        got = np.frombuffer(out.raw, dtype=np.float32)
        groups = np.abs(np.pad(x, (0, (-x.size) % 256))).reshape(-1, 256).max(axis=1)
        limit = np.repeat(groups / archive_codec.DEFAULT_LEVELS * 0.5 * (1 + 2**-10), 256)[: x.size]
        assert (np.abs(got - x) <= limit).all()
        back = bytearray(len(out.raw))
        archive_codec.decode_into(out.spec, out.payload, base and memoryview(base), memoryview(back), "test")
        assert back == out.raw, "the reader rebuilds exactly what the writer named"
        sizes.append(len(out.payload))
        base, bases = out.raw, (*bases, "0" * 32)
    assert max(sizes[1:]) < sizes[0] / 2, "residuals are smaller than the keyframe"


def test_values_that_cannot_be_archived_are_refused() -> None:
    nan = np.array([1.0, float("nan")] * 2048, dtype=np.float32)
    assert archive_codec.encode(memoryview(nan.tobytes()), "float32", None, ()) is None
    zeros = np.zeros(4096, dtype=np.float32)
    out = archive_codec.encode(memoryview(zeros.tobytes()), "float32", None, ())
    assert out is not None and bytes(out.raw) == zeros.tobytes()  # a group of zeros is exact


@pytest.mark.parametrize(
    "fields",
    [
        {"bases": ["x" * 32]},
        {"bases": ["0" * 32] * 65},
        {"width": 3},
        {"dtype": "int8"},
        {"group": 0},
        {"v": 2},
        {"levels": "127"},
    ],
)
def test_hostile_archive_descriptors_are_a_damaged_store(fields: dict) -> None:
    good = {"id": "archive-delta", "v": 1, "dtype": "bfloat16", "group": 256, "width": 1, "levels": 127, "bases": []}
    archive_codec.parse(json.dumps(good), 8192, "test")
    with pytest.raises(CorruptStoreError):
        archive_codec.parse(json.dumps(good | fields), 8192, "test")


def test_a_damaged_payload_is_a_damaged_store() -> None:
    x = np.linspace(-1, 1, 4096, dtype=np.float32)
    out = archive_codec.encode(memoryview(x.tobytes()), "float32", None, ())
    assert out is not None
    dest = memoryview(bytearray(len(out.raw)))
    with pytest.raises(CorruptStoreError):
        archive_codec.decode_into(out.spec, out.payload[:-3], None, dest, "test")
    with pytest.raises(CorruptStoreError):  # a keyframe given a base, or a residual without one
        archive_codec.decode_into(out.spec, out.payload, memoryview(out.raw), dest, "test")


def test_a_weight_larger_than_a_run_is_worked_through_in_runs() -> None:
    """Over CHUNK_ELEMENTS (and not a whole number of groups), a keyframe and a residual are within
    their bound everywhere and read back as written: the runs join without a seam."""
    n = archive_codec.CHUNK_ELEMENTS + 1000
    rng = np.random.default_rng(2)
    x0 = rng.standard_normal(n).astype(np.float32)
    x1 = x0 + rng.standard_normal(n).astype(np.float32) * 1e-3
    key = archive_codec.encode(memoryview(x0.tobytes()), "float32", None, ())
    assert key is not None
    step = archive_codec.encode(memoryview(x1.tobytes()), "float32", memoryview(key.raw), ("0" * 32,))
    assert step is not None and step.spec.bases == ("0" * 32,)
    for out, x, base in ((key, x0, None), (step, x1, memoryview(key.raw))):
        groups = np.abs(np.pad(x, (0, (-n) % 256))).reshape(-1, 256).max(axis=1)
        limit = np.repeat(groups / archive_codec.DEFAULT_LEVELS * 0.5 * (1 + 2**-10), 256)[:n]
        assert (np.abs(np.frombuffer(out.raw, dtype=np.float32) - x) <= limit).all()
        back = bytearray(len(out.raw))
        archive_codec.decode_into(out.spec, out.payload, base, memoryview(back), "test")
        assert back == out.raw
