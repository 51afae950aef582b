"""Where a commit's own thread spends its time: ``python -m benchmarks.commit_profile TAG_DIR``.

cProfile sees only the thread it runs on, which is what this wants: the commit's loop, whose
work (reading, hashing, planning, index writes, waiting on the pool) is serial however many
threads compress. Commits TAG_DIR into a fresh store with ``--threads`` threads, page cache
warm, and prints the wall time and the functions with the most own time on that thread.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import shutil
import tempfile
import time
from pathlib import Path

from tailorstore import Store


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("tag_dir", type=Path)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="tailor-profile-"))
    try:
        with Store.init(work / "warm") as store:  # the page cache and the code warm
            store.commit(args.tag_dir, threads=args.threads)
        with Store.init(work / "store") as store:
            profile = cProfile.Profile()
            began = time.perf_counter()
            profile.enable()
            store.commit(args.tag_dir, threads=args.threads)
            profile.disable()
            wall = time.perf_counter() - began
    finally:
        shutil.rmtree(work, ignore_errors=True)
    out = io.StringIO()
    stats = pstats.Stats(profile, stream=out)
    stats.sort_stats("tottime").print_stats(args.top)
    print(f"commit wall {wall:.3f} s with threads={args.threads}")
    print("\n".join(line for line in out.getvalue().splitlines() if line.strip())[:6000])


if __name__ == "__main__":
    main()
