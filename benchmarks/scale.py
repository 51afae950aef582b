"""The scale curve: commit, stall, staging and time to resume against model size.

``python -m benchmarks.scale [--sizes mid medium large xl]`` trains the same model at each size
(2 ranks on this machine's CPUs, ZeRO-2 bf16, bf16 parameters multiplied in fp32) and measures:

* **commit**: ``tailor commit`` of DeepSpeed's own save, as a whole process: wall, CPU seconds,
  peak RSS (the committing process's ``ru_maxrss``), GB/s of raw state;
* **stall and staging**: the same training through ``attach`` (the snapshot, the default),
  a save every 2 steps: each save's stall on rank 0, and the staging folder's peak bytes;
* **time to resume**: from ``engine.load_checkpoint`` called to the first step done, from
  DeepSpeed's save on local disk, and from the store through ``attach``.

Each figure is one run (the sizes take minutes each here). Writes JSON to stdout.

``python -m benchmarks.scale --case ...`` (or ``--quick``) is the other scale, of metadata: ranks
and steps with tiny tensors (benchmarks/metadata_scale.py).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tailorstore import Store
from testbed.runs import train_tiny

from .resume import model_options
from .stall import Sampler, used_bytes
from .suite import SIZES, params_of

COMMIT = """
import json, resource, sys, time
from tailorstore import Store
began = time.perf_counter()
with Store.open(sys.argv[1]) as store:
    store.commit(sys.argv[2])
wall = time.perf_counter() - began
usage = resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({"wall": wall, "cpu": usage.ru_utime + usage.ru_stime, "maxrss": usage.ru_maxrss * 1024}))
"""


def largest_file(folder: Path) -> int:
    return max(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def one_size(name: str, work: Path, saves: int) -> dict:
    options = model_options(name)
    every = 2
    steps = every * saves
    # DeepSpeed's own save, on disk
    plain = work / "plain"
    train_tiny(plain, losses_out=work / "plain.json", steps=steps, save_every=every, timings_out=work / "pt.json",
               timeout=3600, **options)  # fmt: skip
    tag = f"global_step{steps}"
    raw = used_bytes(plain / tag)
    # tailor commit of it, a whole process (start-up included)
    Store.init(work / "store").close()
    began = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", COMMIT, str(work / "store"), str(plain / tag)],
                          capture_output=True, text=True, check=True)  # fmt: skip
    commit = json.loads(done.stdout.strip().splitlines()[-1]) | {"process_wall": time.perf_counter() - began}
    # the same training through attach: stalls, staging
    staging = Path("/dev/shm") / f"tailor-scale-{os.getpid()}"
    staging.mkdir(exist_ok=True)
    os.environ["TAILOR_STAGING"] = str(staging)
    Store.init(work / "engine-store").close()
    try:  # a run killed (out of memory) must not leave its staging in memory for the next size
        with Sampler([], [staging]) as sampler:
            train_tiny(work / "engine", losses_out=work / "engine.json", steps=steps, save_every=every,
                       commit_to=work / "engine-store", tailor_engine=True, timings_out=work / "et.json",
                       timeout=3600, **options)  # fmt: skip
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    engine = json.loads((work / "et.json").read_text())
    plain_timings = json.loads((work / "pt.json").read_text())
    # time to resume from the last save: DeepSpeed's own from disk, and the store's through attach
    resume_raw = train_tiny(work / "r1", losses_out=work / "r1.json", steps=steps + 1, save_every=0,
                            resume_from=plain, resume_tag=tag, timings_out=work / "r1t.json", timeout=3600,
                            **options)  # fmt: skip
    try:  # the resume stages in the same folder ($TAILOR_STAGING)
        resume_store = train_tiny(work / "r2", losses_out=work / "r2.json", steps=steps + 1, save_every=0,
                                  commit_to=work / "store", tailor_engine=True, resume_from=work / "nothing",
                                  resume_tag=tag, timings_out=work / "r2t.json", timeout=3600, **options)  # fmt: skip
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return {
        "size": name,
        "params": params_of(SIZES[name]),
        "raw_bytes": raw,
        "largest_file": largest_file(plain / tag),
        "commit": commit,
        "commit_gb_per_s": raw / commit["wall"] / 1e9,
        "commit_cpu_s_per_gb": commit["cpu"] / (raw / 1e9),
        "engine_stalls": engine["stalls"],
        "plain_stalls": plain_timings["stalls"],
        "copy_floor": engine.get("copy_floor_seconds"),
        "peak_staging": sampler.peak_memory,
        "resume_raw": json.loads((work / "r1t.json").read_text())["resume_seconds"],
        "resume_store": json.loads((work / "r2t.json").read_text())["resume_seconds"],
        "resume_losses_equal": resume_raw == resume_store,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", nargs="+", default=["mid", "medium", "large", "xl"], choices=sorted(SIZES))
    parser.add_argument("--saves", type=int, default=3, help="saves in each training (xl: 1, for memory)")
    args = parser.parse_args()
    rows = []
    for name in args.sizes:
        work = Path(tempfile.mkdtemp(prefix=f"tailor-scale-{name}-", dir="/tmp"))
        try:
            rows.append(one_size(name, work, 1 if name == "xl" else args.saves))
        finally:
            shutil.rmtree(work, ignore_errors=True)
        row = rows[-1]
        print(json.dumps({k: v for k, v in row.items()}), flush=True)
    print(json.dumps(rows, indent=1))
    print(
        json.dumps(
            {
                r["size"]: {"median_stall": statistics.median(r["engine_stalls"]), "gbps": r["commit_gb_per_s"]}
                for r in rows
            }
        )
    )


if __name__ == "__main__":
    if any(a == "--quick" or a.startswith("--case") for a in sys.argv[1:]):
        from .metadata_scale import main as metadata_main

        sys.exit(metadata_main())
    main()
