"""Pure pieces: layer labels, ZeRO partition cutting, path checks, codec round trips."""

from __future__ import annotations

import io
import json
import os
import struct

import pytest

from tailorstore.core.errors import CorruptStoreError, LayoutError, UnsafePathError
from tailorstore.core.layers import layer_of, sort_key
from tailorstore.core.paths import check_relative
from tailorstore.formats.zero_partitions import Piece, zero3_pieces, zero12_pieces
from tailorstore.store import codec


@pytest.mark.parametrize(
    ("name", "label"),
    [
        ("model.layers.7.mlp.up_proj.weight", "block.7"),
        ("transformer.h.12.attn.c_attn.weight", "block.12"),
        ("layers.3.attention.wq.weight", "block.3"),
        ("model.embed_tokens.weight", "embedding"),
        ("transformer.wte.weight", "embedding"),
        ("model.norm.weight", "final_norm"),
        ("transformer.ln_f.bias", "final_norm"),
        ("lm_head.weight", "lm_head"),
        ("output.weight", "lm_head"),
        ("rotary.inv_freq", "other"),
    ],
)
def test_layer_labels(name: str, label: str) -> None:
    assert layer_of(name) == label


def test_layer_order() -> None:
    labels = ["lm_head", "block.10", "state", "embedding", "block.2", "final_norm"]
    assert sorted(labels, key=sort_key) == ["embedding", "block.2", "block.10", "final_norm", "lm_head", "state"]


def test_zero12_cut_through_a_parameter() -> None:
    shapes = [("a", 5), ("b", 6), ("c", 3)]  # 14 elements, two ranks of 7
    assert zero12_pieces(shapes, None, 0, 7) == [Piece(0, 5, "a", 0), Piece(5, 2, "b", 0)]
    assert zero12_pieces(shapes, None, 1, 7) == [Piece(0, 4, "b", 2), Piece(4, 3, "c", 0)]


def test_zero12_alignment_and_unpadded_last_rank() -> None:
    shapes = [("a", 3), ("b", 3)]  # a + 1 alignment element + b = 7, padded to 8
    assert zero12_pieces(shapes, [1, 0], 0, 4) == [Piece(0, 3, "a", 0), Piece(3, 1, None, 3)]
    # The last rank saved only 3 of its 4 elements (its group padding stripped).
    assert zero12_pieces(shapes, [1, 0], 1, 4, saved_numel=3) == [Piece(0, 3, "b", 0)]


def test_zero3_ceil_split_with_padding() -> None:
    shapes = [("a", 5), ("b", 4)]
    assert zero3_pieces(shapes, 2, 0, 5) == [Piece(0, 3, "a", 0), Piece(3, 2, "b", 0)]
    assert zero3_pieces(shapes, 2, 1, 5) == [Piece(0, 2, "a", 3), Piece(2, 1, None, 2), Piece(3, 2, "b", 2)]
    with pytest.raises(LayoutError):
        zero3_pieces(shapes, 2, 1, 4)


@pytest.mark.parametrize("rel", ["../x", "a/../../x", "/etc/passwd", "a\\b", "", "a//b", "./a"])
def test_unsafe_paths(rel: str) -> None:
    with pytest.raises(UnsafePathError):
        check_relative(rel)


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


def test_a_failed_rank_ends_the_job_and_the_others_are_killed(tmp_path) -> None:
    """The rank launcher (torchrun's job, without torchrun's start-up) never leaves a rank waiting."""
    import time

    from testbed.runs import TrainingFailed, torchrun

    module = tmp_path / "one_rank_fails.py"
    module.write_text(
        "import os, sys, time\n"
        "if os.environ['RANK'] == '1':\n    print('rank 1 gives up'); sys.exit(3)\n"
        "time.sleep(60)\n"
    )
    began = time.monotonic()
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = str(tmp_path)
    try:
        with pytest.raises(TrainingFailed, match="rank 1 exited with code 3") as caught:
            torchrun("one_rank_fails", [], nproc=2, log=tmp_path / "job.log")
    finally:
        os.environ.pop("PYTHONPATH") if old is None else os.environ.update(PYTHONPATH=old)
    assert time.monotonic() - began < 20, "rank 0 was not left sleeping"
    assert "rank 1 gives up" in caught.value.args[0] and "[rank 0]" in (tmp_path / "job.log").read_text()


@pytest.mark.slow
def test_the_headline_trainings_options_keep_deepspeeds_bf16_layout(tmp_path) -> None:
    """benchmarks/headline.py trains with text-like data, fp32 arithmetic and a held-out score;
    the checkpoint must still be the bf16 one (bf16 weights, FP32 masters) the policies are for."""
    import math

    from tailorstore.core import atom_types as A
    from tailorstore.formats.layout import detect
    from tailorstore.formats.reader import read_checkpoint
    from testbed.runs import train_tiny

    losses = train_tiny(
        tmp_path / "save",
        losses_out=tmp_path / "losses.json",
        steps=2,
        save_every=2,
        data="chain",
        fp32_compute=True,
        vocab=512,
        eval_batches=2,
        eval_out=tmp_path / "eval.json",
    )
    assert len(losses) == 2
    held_out = json.loads((tmp_path / "eval.json").read_text())
    assert held_out["batches"] == 2 and math.isfinite(held_out["held_out_loss"]) and held_out["held_out_loss"] > 0
    dtypes: dict[str, set[str]] = {}
    for f in read_checkpoint(detect(tmp_path / "save"), trust_pickles=False):
        for entry in f.entries:
            for seg in entry.segments:
                dtypes.setdefault(seg.kind, set()).add(entry.dtype_name)
    assert dtypes[A.WEIGHT] == {"bfloat16"} and dtypes[A.MASTER] == {"float32"}


def test_available_memory_is_read_from_the_kernel() -> None:
    """What the snapshot's readied buffers are weighed against (core/host_memory.py)."""
    from tailorstore.core.host_memory import available_memory

    with open("/proc/meminfo") as f:
        total = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemTotal:"))
    found = available_memory()
    assert found is not None and 0 < found <= total


@pytest.mark.parametrize(
    ("name", "read", "good", "bad"),
    [
        ("TAILOR_LOCK_TTL", "tailorstore.store.lease:lease_ttl", "90", ["0", "-1", "nan", "inf", "1e9", "ten"]),
        (
            "TAILOR_COLLECTIVE_TIMEOUT",
            "tailorstore.integrations.common.ranks:collective_timeout",
            "1",
            ["0.5", "nan", "inf", "604801", "x"],
        ),
        (
            "TAILOR_S3_RETRY_SECONDS",
            "tailorstore.store.backends.s3:_retry_config",
            "0",
            ["-1", "nan", "inf", "3601", "soon"],
        ),
        ("TAILOR_SAVE_SECONDS", "tailorstore.core.save_bound:bound_seconds", "1", ["0.5", "nan", "inf", "86401", "x"]),
    ],
)
def test_every_seconds_variable_is_read_alike(monkeypatch, name: str, read: str, good: str, bad: list[str]) -> None:
    """One reader of seconds from the environment (core/env_seconds.py): each variable refuses text,
    NaN, infinity and numbers out of its range with the same words, naming itself and its range."""
    import importlib

    from tailorstore.core.errors import StoreError

    module, function = read.split(":")
    reader = getattr(importlib.import_module(module), function)
    monkeypatch.setenv(name, good)
    reader()
    for value in bad:
        monkeypatch.setenv(name, value)
        with pytest.raises(StoreError, match=rf"^{name}='{value}' is not allowed: give seconds (from|more than 0)"):
            reader()
