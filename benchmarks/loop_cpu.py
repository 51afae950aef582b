"""The commit loop's own CPU, with and without helpers: ``python -m benchmarks.loop_cpu TAG_DIR``.

However many threads compress, a commit's loop (the calling thread) handles every piece in
order, so its CPU seconds per GB bound the commit's throughput on any number of cores: at most
raw bytes / loop CPU seconds. On a 16-core GPU node the commit stopped at about 1 GB/s
(docs/benchmarks.md). This commits TAG_DIR into fresh stores, page cache warm, alternating
``threads=3`` (no helpers: the default on 2 cores) and ``threads=9`` (two helpers prepare the
pieces ahead: ingest/pieces_ahead.py), and reports for each the wall, the whole process's CPU and
the loop thread's CPU (``time.thread_time`` on the calling thread), medians of ``--repeats``.
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


def process_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("tag_dir", type=Path)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    raw = sum(p.stat().st_size for p in args.tag_dir.rglob("*") if p.is_file())
    found: dict[int, list[tuple[float, float, float]]] = {3: [], 9: []}
    work = Path(tempfile.mkdtemp(prefix="tailor-loop-"))
    try:
        with Store.init(work / "warm") as store:  # the page cache and the code warm
            store.commit(args.tag_dir)
        for i in range(args.repeats):
            for threads in (3, 9) if i % 2 == 0 else (9, 3):
                with Store.init(work / f"s{i}-{threads}") as store:
                    wall, cpu, loop = time.perf_counter(), process_cpu(), time.thread_time()
                    store.commit(args.tag_dir, threads=threads)
                    found[threads].append((time.perf_counter() - wall, process_cpu() - cpu, time.thread_time() - loop))
                shutil.rmtree(work / f"s{i}-{threads}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report = {"raw_bytes": raw, "rows": []}
    for threads, runs in found.items():
        loop = statistics.median(r[2] for r in runs)
        report["rows"].append({
            "threads": threads,
            "wall_s": statistics.median(r[0] for r in runs),
            "process_cpu_s": statistics.median(r[1] for r in runs),
            "loop_cpu_s": loop,
            "loop_cpu_s_per_gb": loop / (raw / 1e9),
            "loop_bound_gb_per_s": raw / loop / 1e9,
        })  # fmt: skip
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
