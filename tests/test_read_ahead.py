"""The read-ahead pipeline export writes through: order, bounded lookahead, errors raised where
they are read, and a helper that stops when the caller leaves early."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from tailorstore.read_ahead import ReadAhead


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
