"""One measured operation in a fresh process, so that peak RSS belongs to it alone.

``python -m benchmarks.worker commit STORE CKPT`` or ``... checkout STORE STEP OUT`` prints
one JSON line: the seconds the library call took (interpreter start-up excluded).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from tailorstore.checkout import checkout_step
from tailorstore.commit import commit_checkpoint
from tailorstore.memory import reuse_freed_memory
from tailorstore.safe_load import allowed_globals
from tailorstore.store.repo import Repository


def main(argv: list[str]) -> None:
    reuse_freed_memory()  # as the tailor CLI does
    allowed_globals()  # DeepSpeed imported before the clock starts, as in a training process
    op, store_path = argv[0], Path(argv[1])
    with Repository.open(store_path) as store:
        began = time.perf_counter()
        if op == "commit":
            result = commit_checkpoint(store, Path(argv[2]))
            extra = {"new_bytes": result.new_bytes, "raw_bytes": result.raw_bytes, "derived": result.derived_bytes}
        elif op == "checkout":
            checkout_step(store, f"step={argv[2]}", Path(argv[3]))
            extra = {}
        else:
            raise SystemExit(f"unknown op {op}")
        seconds = time.perf_counter() - began
    print(json.dumps({"seconds": seconds, "peak_rss": peak_rss(), **extra}))


def peak_rss() -> int:
    """This process's high-water RSS (VmHWM), in bytes.

    Not the ru_maxrss that wait4 reports: Linux folds the pre-exec address space into that,
    and subprocess starts a child from a copy of the parent, so a parent that had grown to
    3 GB made every worker report 3 GB.
    """
    for line in open("/proc/self/status").read().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


if __name__ == "__main__":
    main(sys.argv[1:])
