"""Which part of a commit stops growing with threads: ``python -m benchmarks.scaling_parts TAG_DIR``.

A commit of the 58M save moved about 1 GB/s on a 16-core GPU node from 4 threads on, no more
with 8 or 16 (benchmarks/threads.py). This times each part of the work alone, on a pool of 1,
2, 4, 8 and 16 threads over the save's tensor bytes in 8 MB pieces (page cache warm): the copy
out of the page cache (``preadv``, as formats/source.py reads), the hash (xxh3-128), plain zstd
at the store's level on the raw bytes, and the store's codec (byte planes, then zstd). A part
whose GB/s stops growing while the cores are free holds the GIL or shares something.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from tailorstore.formats.layout import detect
from tailorstore.formats.reader import read_checkpoint
from tailorstore.store import codec

PIECE = 8 << 20


def pieces_of(tag_dir: Path) -> list[tuple[Path, int, int, int, bool]]:
    """(file, offset, length, itemsize, is_float) of every 8 MB piece of every tensor."""
    found = []
    for f in read_checkpoint(detect(tag_dir)):
        for entry in f.entries:
            nbytes = entry.tensor.numel() * entry.tensor.element_size()
            base = entry.file_offset or 0
            for at in range(0, nbytes, PIECE):
                size = entry.tensor.element_size()
                found.append((f.source, base + at, min(PIECE, nbytes - at), size, entry.tensor.is_floating_point()))
    return found


def rate(threads: int, items: list, work: Callable[[object], int]) -> float:
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(work, items[: threads * 2]))  # warm each thread's buffers and compressors
        began = time.perf_counter()
        total = sum(pool.map(work, items))
        return total / (time.perf_counter() - began) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("tag_dir", type=Path)
    parser.add_argument("--counts", default="1,2,4,8,16")
    args = parser.parse_args()
    pieces = pieces_of(args.tag_dir)
    fds = {path: os.open(path, os.O_RDONLY) for path in {p[0] for p in pieces}}
    loaded = []
    for path, offset, length, size, floating in pieces:
        buf = np.empty(length, dtype=np.uint8)
        os.preadv(fds[path], [buf], offset)
        loaded.append((memoryview(buf), size, floating))

    def read(item: object) -> int:
        path, offset, length, _, _ = item  # type: ignore[misc]
        buf = np.empty(length, dtype=np.uint8)
        return os.preadv(fds[path], [buf], offset)

    def hashed(item: object) -> int:
        data = item[0]  # type: ignore[index]
        codec.content_hash(data)
        return len(data)

    def zstd(item: object) -> int:
        data = item[0]  # type: ignore[index]
        codec._compressor(codec.DEFAULT_LEVEL).compress(data)
        return len(data)

    def encoded(item: object) -> int:
        data, size, floating = item  # type: ignore[misc]
        sum(len(c) for c in codec.encode(data, itemsize=size, is_float=floating))
        return len(data)

    def split(item: object) -> int:  # the byte-plane split alone, as the codec runs it
        data, size, floating = item  # type: ignore[misc]
        if not floating or size not in (2, 4, 8):
            return 0
        rows = np.frombuffer(data, dtype=np.uint8).reshape(-1, size)
        for first in range(0, len(rows), codec.GROUP_CHUNK // size):
            part = rows[first : first + codec.GROUP_CHUNK // size]
            codec._split(part, np.empty((size, len(part)), dtype=np.uint8))
        return len(data)

    def split_whole(item: object) -> int:  # one strided copy a plane: a few calls, each releasing the GIL
        data, size, floating = item  # type: ignore[misc]
        if not floating or size not in (2, 4, 8):
            return 0
        rows = np.frombuffer(data, dtype=np.uint8).reshape(-1, size)
        planes = np.empty((size, len(rows)), dtype=np.uint8)
        for k in range(size):
            np.copyto(planes[k], rows[:, k])
        return len(data)

    parts = {
        "read": (pieces, read),
        "hash": (loaded, hashed),
        "zstd": (loaded, zstd),
        "codec": (loaded, encoded),
        "split": (loaded, split),
        "split, one strided copy a plane": (loaded, split_whole),
    }
    counts = [int(c) for c in args.counts.split(",")]
    report = {"bytes": sum(len(d) for d, _, _ in loaded), "cores": len(os.sched_getaffinity(0)), "gb_per_s": {}}
    for name, (items, work) in parts.items():
        report["gb_per_s"][name] = {n: round(rate(n, items, work), 3) for n in counts}
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
