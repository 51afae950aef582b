"""The blob codec (store/codec.py): round trips, byte planes, the raw fallback, old blobs, and what
it refuses."""

from __future__ import annotations

import io
import json
import os
import struct

import pytest

from tailorstore.core.errors import CorruptStoreError
from tailorstore.store import codec


def test_codec_round_trip_and_raw_fallback() -> None:
    compressible = memoryview(bytes(100_000))
    encoded = codec.encode(compressible)
    assert json.loads(encoded.descriptor) == {"id": "zstd", "v": 1, "level": 1}
    assert encoded.size < 1000
    out = bytearray(len(compressible))
    codec.decode_into(encoded.descriptor, io.BytesIO(bytes(encoded.chunks[0])), memoryview(out), "test")
    assert out == compressible
    noise = memoryview(os.urandom(4096))
    assert json.loads(codec.encode(noise).descriptor)["id"] == "raw"


def test_byte_grouped_codec_round_trip_across_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    monkeypatch.setattr(codec, "GROUP_CHUNK", 4096)  # several chunks from a small tensor
    tensor = torch.randn(10_000) * 1e-3
    tensor[:3000] = 0  # a run of zeros, as in embedding rows no batch touched
    data = memoryview(tensor.numpy()).cast("B")
    encoded = codec.encode(data, itemsize=4, is_float=True)
    assert json.loads(encoded.descriptor) == {"id": "bytegroup-zstd", "v": 1, "typesize": 4, "level": 1}
    payload = b"".join(bytes(c) for c in encoded)
    assert encoded.size == len(payload) and len(payload) < 0.8 * len(data)
    out = bytearray(len(data))
    codec.decode_into(encoded.descriptor, io.BytesIO(payload), memoryview(out), "test")
    assert out == data
    with pytest.raises(CorruptStoreError, match="truncated"):
        codec.decode_into(encoded.descriptor, io.BytesIO(payload[:-10]), memoryview(bytearray(len(data))), "t")
    damaged = bytearray(payload)
    damaged[40] ^= 0xFF  # inside the first chunk's first plane
    decoded = bytearray(len(data))
    try:
        codec.decode_into(encoded.descriptor, io.BytesIO(bytes(damaged)), memoryview(decoded), "t")
    except CorruptStoreError:
        pass
    else:  # then the content hash is what catches it
        assert codec.content_hash(decoded) != codec.content_hash(data)


def _plane_modes(payload: bytes) -> list[list[int]]:
    """Each chunk's plane modes (0 raw, 1 zstd), read from the bytegroup format (docs/FORMAT.md)."""
    modes, at = [], 0
    while at < len(payload):
        _, planes = struct.unpack_from("<IB", payload, at)
        heads = [struct.unpack_from("<BI", payload, at + 5 + 5 * k) for k in range(planes)]
        modes.append([mode for mode, _ in heads])
        at += 5 + 5 * planes + sum(length for _, length in heads)
    return modes


@pytest.mark.parametrize("dtype", ["bfloat16", "float32", "float64"])
def test_byte_planes_split_by_shifts_round_trip_aligned_or_not(dtype: str) -> None:
    """Planes are split by shifts, a slice at a time; input not aligned to a word takes the
    byte-strided copies. Decoding writes into output aligned to a word or not."""
    import torch

    tensor = (torch.randn(1_500_000) * 1e-2).to(getattr(torch, dtype))
    tensor[:200_000] = 0.5  # a repeated value: every plane of that stretch compresses
    data = bytes(memoryview(tensor.numpy() if dtype != "bfloat16" else tensor.view(torch.int16).numpy()).cast("B"))
    itemsize = tensor.element_size()
    for view in (memoryview(data), memoryview(bytearray(b"x" + data))[1:]):  # the second is not word-aligned
        encoded = codec.encode(view, itemsize=itemsize, is_float=True)
        payload = b"".join(bytes(c) for c in encoded)
        for skew in (0, 1):  # the output word-aligned, then not
            out = memoryview(bytearray(skew + len(data)))[skew:]
            codec.decode_into(encoded.descriptor, io.BytesIO(payload), out, "test")
            assert out == data


@pytest.mark.parametrize("dtype", ["bfloat16", "float32", "float64"])
def test_the_many_core_split_writes_the_same_blobs(dtype: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Above four cores the planes are split by one strided copy each, which leaves the GIL to the
    other threads (16 threads: docs/PERFORMANCE.md, "Byte planes");
    the stored bytes must not depend on the machine that wrote them, nor the decoded ones on the
    machine that reads them."""
    import torch

    tensor = (torch.randn(1_200_003) * 1e-2).to(getattr(torch, dtype))
    data = bytes(memoryview(tensor.numpy() if dtype != "bfloat16" else tensor.view(torch.int16).numpy()).cast("B"))
    payloads = []
    for many in (False, True):
        monkeypatch.setattr(codec, "_MANY_CORES", many)
        encoded = codec.encode(memoryview(data), itemsize=tensor.element_size(), is_float=True)
        payloads.append(b"".join(bytes(c) for c in encoded))
    assert payloads[0] == payloads[1]
    for many in (False, True):  # and joined back by word shifts or by strided copies alike
        monkeypatch.setattr(codec, "_MANY_CORES", many)
        out = memoryview(bytearray(len(data)))
        codec.decode_into(encoded.descriptor, io.BytesIO(payloads[0]), out, "test")
        assert out == data


def test_noisy_lower_planes_are_stored_raw_without_compressing_them(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    sizes: list[int] = []

    class Counting:
        def __init__(self, inner: object) -> None:
            self.inner = inner

        def compress(self, data: object) -> bytes:
            sizes.append(len(memoryview(data).cast("B")))
            return self.inner.compress(data)

    real = codec._compressor
    monkeypatch.setattr(codec, "_compressor", lambda level: Counting(real(level)))
    noise = memoryview((torch.randn(1 << 20) * 1e-2).numpy()).cast("B")  # 4 MiB: one chunk, planes of 1 MiB
    payload = b"".join(bytes(c) for c in codec.encode(noise, itemsize=4, is_float=True))
    assert _plane_modes(payload) == [[0, 0, 0, 1]]  # the exponent plane compresses, the rest is noise
    assert sorted(sizes) == [64 << 10] * 3 + [1 << 20]  # a sample of each lower plane, the top plane whole
    # values with zero low bytes (bf16-exact floats): the lower planes shrink and are compressed whole
    sizes.clear()
    exact = memoryview((torch.randn(1 << 20) * 1e-2).bfloat16().float().numpy()).cast("B")
    payload = b"".join(bytes(c) for c in codec.encode(exact, itemsize=4, is_float=True))
    assert _plane_modes(payload) == [[1, 1, 0, 1]] and len(payload) < 0.6 * len(exact)
    out = bytearray(len(exact))
    codec.decode_into(
        '{"id": "bytegroup-zstd", "v": 1, "typesize": 4, "level": 1}', io.BytesIO(payload), memoryview(out), "t"
    )
    assert out == exact


def test_blosc2_blobs_of_tailorstore_0_1_still_decode() -> None:
    """Stores written before bytegroup-zstd hold blosc2 blobs; their descriptor still decodes them."""
    import blosc2
    import torch

    data = memoryview((torch.randn(50_000) * 1e-2).numpy()).cast("B")
    chunks = [
        blosc2.compress2(
            data[i : i + 65536],
            typesize=4,
            clevel=1,
            codec=blosc2.Codec.ZSTD,
            filters=[blosc2.Filter.SHUFFLE],
            splitmode=blosc2.SplitMode.ALWAYS_SPLIT,
        )
        for i in range(0, len(data), 65536)
    ]
    out = bytearray(len(data))
    descriptor = '{"id": "blosc2-shuffle-zstd", "level": 1, "typesize": 4, "v": 1}'
    codec.decode_into(descriptor, io.BytesIO(b"".join(chunks)), memoryview(out), "test")
    assert out == data


def test_codec_refuses_unknown_descriptor_and_short_blob() -> None:
    with pytest.raises(CorruptStoreError, match="upgrade it"):
        codec.decode_into('{"id": "zstd", "v": 9}', io.BytesIO(b""), memoryview(bytearray(4)), "test")
    with pytest.raises(CorruptStoreError, match="truncated"):
        codec.decode_into('{"id": "raw", "v": 1}', io.BytesIO(b"ab"), memoryview(bytearray(4)), "test")
