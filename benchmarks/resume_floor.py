"""Where a resume from the store spends its time, against DeepSpeed's raw load, in one process.

``python -m benchmarks.resume_floor SAVE_DIR TAG [--repeats 3]`` commits ``SAVE_DIR/TAG`` into a
fresh local store, then, with the page cache warm, times the two halves of what ``attach`` does
at a resume against what DeepSpeed's own load does, one file after another on one thread of
torch: the raw files loaded (``torch.load`` through tailorstore's allowlist, as the engine loads),
the step checked out into ``/dev/shm`` (decoding every blob, on the checkout's threads), and the
checked-out files loaded: read, and mapped as the engine loads a resume's staged files (every page
then touched once). Wall and CPU seconds (every thread of this process), medians.

It says how far the store's resume can come down: its checkout alone, which must decode what
the raw load only copies, against the raw load.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from tailorstore import Store
from tailorstore.formats.safe_load import load_torch_file


def timed(run: object) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    run()  # type: ignore[operator]
    return time.perf_counter() - wall, time.process_time() - cpu


def load_all(files: list[Path]) -> None:
    for path in files:
        obj = load_torch_file(path, mmap=False)[0]
        del obj


def tensors_in(obj: object) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in tensors_in(v)]
    if isinstance(obj, list | tuple):
        return [t for v in obj for t in tensors_in(v)]
    return []


def load_all_mapped(files: list[Path]) -> None:
    """As the engine loads a resume's staged files: mapped. Every page of every tensor is then
    touched once, so the mapping's faults are counted, as DeepSpeed's copy out of them would."""
    for path in files:
        obj = load_torch_file(path, mmap=True)[0]
        for t in tensors_in(obj):
            if t.numel():
                int(t.detach().reshape(-1).view(torch.uint8)[::4096].sum())
        del obj


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("save", type=Path)
    parser.add_argument("tag")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    source = args.save / args.tag
    files = sorted(p for p in source.iterdir() if p.suffix == ".pt")
    raw_bytes = sum(p.stat().st_size for p in files)
    work = Path(tempfile.mkdtemp(prefix="tailor-floor-"))
    staging = Path(tempfile.mkdtemp(prefix="tailor-floor-", dir="/dev/shm"))
    rows: dict[str, list[tuple[float, float]]] = {
        "raw load": [], "checkout": [], "load the checkout": [], "load the checkout mapped": []
    }  # fmt: skip
    try:
        with Store.init(work / "store") as store:
            store.commit(source)
            out = staging / "step"
            for _ in range(args.repeats):
                for path in files:
                    path.read_bytes()  # the page cache warm, as after a save
                rows["raw load"].append(timed(lambda: load_all(files)))
                rows["checkout"].append(timed(lambda: store.checkout("latest", out)))
                rows["load the checkout"].append(timed(lambda: load_all(sorted(out.rglob("*.pt")))))
                rows["load the checkout mapped"].append(timed(lambda: load_all_mapped(sorted(out.rglob("*.pt")))))
                shutil.rmtree(out)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(staging, ignore_errors=True)
    report = {
        "raw_bytes": raw_bytes,
        "files": [p.name for p in files],
        **{f"{k} wall": statistics.median(w for w, _ in v) for k, v in rows.items()},
        **{f"{k} cpu": statistics.median(c for _, c in v) for k, v in rows.items()},
    }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
