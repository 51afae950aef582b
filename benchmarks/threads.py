"""Commit and checkout throughput against the thread count: ``python -m benchmarks.threads SAVE``.

SAVE is a DeepSpeed tag folder (the stall benchmark leaves one in
``.bench/stall/plain/save/global_step12``). Each commit goes into a fresh store in this
process, page cache warm, with ``threads=`` 1, 2, ... up to the usable cores (and one more);
each checkout of that step likewise. Reported: wall seconds, CPU seconds of the process (user
plus system, all threads), and GB/s of raw state, median of ``--repeats``.
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from tailorstore import Store
from tailorstore.core.threads import usable_cores


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def timed(work) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    wall, cpu = time.perf_counter(), cpu_seconds()
    work()
    return time.perf_counter() - wall, cpu_seconds() - cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("save", type=Path)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--counts", default=None, help="comma-separated (default: 1, 2, the cores, one more)")
    args = parser.parse_args()
    raw = sum(p.stat().st_size for p in args.save.rglob("*") if p.is_file())
    if args.counts:
        counts = sorted({int(c) for c in args.counts.split(",")})
    else:
        counts = sorted({1, 2, usable_cores(), usable_cores() + 1})
    rows = []
    for threads in counts:
        commits, checkouts = [], []
        for _ in range(args.repeats):
            work = Path(tempfile.mkdtemp(prefix="tailor-threads-"))
            try:
                with Store.init(work / "store") as store:
                    commits.append(timed(lambda: store.commit(args.save, threads=threads)))  # noqa: B023
                    checkouts.append(timed(lambda: store.checkout("latest", work / "out", threads=threads)))  # noqa: B023
            finally:
                shutil.rmtree(work, ignore_errors=True)
        for kind, found in (("commit", commits), ("checkout", checkouts)):
            wall = statistics.median(w for w, _ in found)
            cpu = statistics.median(c for _, c in found)
            rows.append({"op": kind, "threads": threads, "wall_s": wall, "cpu_s": cpu, "gb_per_s": raw / wall / 1e9})
    print(json.dumps({"raw_bytes": raw, "usable_cores": usable_cores(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
