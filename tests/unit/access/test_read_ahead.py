"""The read-ahead pipeline export writes through: order, bounded lookahead, errors raised where
they are read, and a helper that stops when the caller leaves early."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from tailorstore.access.read_ahead import ReadAhead


def pieces(tag: int, sizes: list[int], log: list[str] | None = None) -> Iterator[memoryview]:
    """Chunks of distinct bytes, yielded from one reused buffer as the store's decoders do."""
    buf = bytearray(max(sizes, default=0))
    for n, size in enumerate(sizes):
        buf[:size] = bytes([(tag * 31 + n) % 256]) * size
        if log is not None:
            log.append(f"made {tag}.{n}")
        yield memoryview(buf)[:size]


def expected(tag: int, sizes: list[int]) -> bytes:
    return b"".join(bytes(c) for c in pieces(tag, sizes))


def test_every_source_comes_back_whole_and_in_order() -> None:
    sizes = {0: [10, 3], 1: [0], 2: [25, 7, 25], 3: [], 4: [9] * 40}
    ahead = [True, True, False, True, True]  # source 2 runs on the caller's thread
    sources = [lambda t=t: pieces(t, sizes[t]) for t in sizes]
    with ReadAhead(sources, ahead, slots=2, slot_bytes=8) as reader:  # chunks above 8 bytes are split
        got = [b"".join(bytes(c) for c in reader.chunks(i)) for i in range(len(sources))]
    assert got == [expected(t, sizes[t]) for t in sizes]


def test_the_helper_never_runs_more_than_its_slots_ahead() -> None:
    log: list[str] = []
    with ReadAhead([lambda: pieces(0, [4] * 30, log)], [True], slots=3, slot_bytes=4) as reader:
        for n, chunk in enumerate(reader.chunks(0)):
            log.append(f"read 0.{n}")
            made = sum(1 for e in log if e.startswith("made"))
            # one slot in the caller's hands, the rest filled, and one chunk made and waiting for a slot
            assert made - n <= 3 + 1, log
            assert bytes(chunk) == bytes([n % 256]) * 4
            threading.Event().wait(0.002)


def test_a_helper_error_is_raised_where_the_caller_reads_it() -> None:
    def failing() -> Iterator[memoryview]:
        yield memoryview(b"good")
        raise OSError("blob went away")

    with ReadAhead([lambda: pieces(1, [4]), failing], [True, True]) as reader:
        assert bytes(b"".join(bytes(c) for c in reader.chunks(0))) == expected(1, [4])
        chunks = reader.chunks(1)
        assert bytes(next(chunks)) == b"good"
        with pytest.raises(OSError, match="blob went away"):
            next(chunks)


def test_leaving_early_stops_a_blocked_helper() -> None:
    endless = lambda: (memoryview(b"x" * 4) for _ in iter(int, 1))  # noqa: E731
    with pytest.raises(RuntimeError, match="writer failed"):
        with ReadAhead([endless], [True], slots=2, slot_bytes=4) as reader:
            next(reader.chunks(0))
            raise RuntimeError("writer failed")
    assert not [t for t in threading.enumerate() if t.name == "tailor-read-ahead"]


def test_sources_are_read_in_order() -> None:
    with ReadAhead([lambda: pieces(0, [1]), lambda: pieces(1, [1])], [False, False]) as reader:
        with pytest.raises(ValueError, match="out of order"):
            next(reader.chunks(1))


def test_two_helpers_read_two_sources_at_once() -> None:
    """The second source is being read while the first still is: what makes export's reads overlap."""
    second_started = threading.Event()

    def first() -> Iterator[memoryview]:
        assert second_started.wait(5), "the second source never started while the first was being read"
        yield memoryview(b"one")

    def second() -> Iterator[memoryview]:
        second_started.set()
        yield memoryview(b"two")

    with ReadAhead([first, second], [True, True], helpers=2) as reader:
        assert [bytes(b"".join(bytes(c) for c in reader.chunks(i))) for i in range(2)] == [b"one", b"two"]


def test_failures_on_two_helpers_surface_at_the_first_failing_source() -> None:
    def failing(message: str, good: int) -> Iterator[memoryview]:
        for _ in range(good):
            yield memoryview(b"good")
        raise OSError(message)

    sources = [lambda: pieces(0, [4] * 5), lambda: failing("first", 2), lambda: failing("second", 0)]
    sources.append(lambda: pieces(3, [4]))
    with pytest.raises(OSError, match="first"):
        with ReadAhead(sources, [True] * 4, slots=2, slot_bytes=4, helpers=2) as reader:
            assert b"".join(bytes(c) for c in reader.chunks(0)) == expected(0, [4] * 5)
            assert [bytes(c) for c in reader.chunks(1)]  # raises after the good chunks
    assert not [t for t in threading.enumerate() if t.name == "tailor-read-ahead"]


def test_a_torch_file_decodes_its_any_thread_tensors_on_helpers(tmp_path) -> None:
    """write_torch_file hands the tensors marked any_thread to read-ahead helpers and runs the others
    (which may need the caller's SQLite connection) on the caller's thread; torch loads the result."""
    import numpy as np
    import torch

    from tailorstore.access.output_dir import write_torch_file
    from tailorstore.formats.torch_save_writer import TensorOut

    ran_on: dict[str, str] = {}

    def values(name: str, n: int, offset: float):
        def chunks() -> Iterator[memoryview]:
            ran_on[name] = threading.current_thread().name
            data = np.arange(n, dtype=np.float32) + np.float32(offset)
            for at in range(0, n, 1000):  # several chunks, one buffer reused as the decoders do
                yield memoryview(data[at : at + 1000].copy()).cast("B")

        return chunks

    tree = {
        "ahead": TensorOut("float32", (5000,), values("ahead", 5000, 0.5), any_thread=True),
        "here": TensorOut("float32", (3, 7), values("here", 21, -2.0)),
        "also_ahead": [TensorOut("float32", (2500,), values("also_ahead", 2500, 7.0), any_thread=True)],
        "step": 12,
    }
    write_torch_file(tmp_path / "f.pt", tree)
    loaded = torch.load(tmp_path / "f.pt", weights_only=True)
    assert torch.equal(loaded["ahead"], torch.arange(5000, dtype=torch.float32) + 0.5)
    assert torch.equal(loaded["here"], (torch.arange(21, dtype=torch.float32) - 2.0).reshape(3, 7))
    assert torch.equal(loaded["also_ahead"][0], torch.arange(2500, dtype=torch.float32) + 7.0)
    assert loaded["step"] == 12
    assert ran_on["ahead"].startswith("tailor-read-ahead") and ran_on["also_ahead"].startswith("tailor-read-ahead")
    assert ran_on["here"] == threading.current_thread().name
