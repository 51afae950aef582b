"""Cost per byte: whole-process commit and checkout against their floors, in CPU seconds per GB.

``python -m benchmarks.cost TAG_DIR [--repeats 5]`` commits the DeepSpeed tag folder TAG_DIR
with the ``tailor`` command into a fresh store, and checks it out again, ``--repeats`` times
each, alternating, as a user runs them (whole processes, bytecode compiled, input in the page
cache). ``/usr/bin/time`` gives each process's wall, user and system seconds. Measured in the
same run:

* the disk: writing with O_DIRECT and fsync, reading with O_DIRECT (``suite.io_paths``);
* the codec: the save's tensor bytes encoded by ``store.codec`` on a pool of the usable cores;
* start-up: ``tailor --version``, best of 5.

Floors (the issue's): a commit's is the larger of the stored bytes written at the O_DIRECT rate
and the state encoded at the codec rate, plus start-up; a checkout's is the stored bytes read
plus the raw bytes written, each at its O_DIRECT rate, plus start-up.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tailorstore.core.threads import usable_cores
from tailorstore.formats.layout import detect
from tailorstore.formats.reader import read_checkpoint
from tailorstore.store import codec

from .suite import dir_bytes, io_paths


def tailor_command() -> str:
    found = shutil.which("tailor")
    if found is None:
        raise SystemExit("the tailor command is not on PATH (pip install -e .)")
    return found


def timed_process(args: list[str], env: dict[str, str]) -> dict:
    """Wall, user, system seconds and peak RSS of one process, from /usr/bin/time."""
    with tempfile.NamedTemporaryFile("r", suffix=".time") as out:
        subprocess.run(["/usr/bin/time", "-f", "%e %U %S %M", "-o", out.name, *args], env=env, check=True,
                       stdout=subprocess.DEVNULL)  # fmt: skip
        wall, user, system, rss_kb = out.read().split()[-4:]
    return {"wall": float(wall), "user": float(user), "system": float(system), "rss": int(rss_kb) * 1024}


def codec_rate(tag_dir: Path) -> tuple[float, int]:
    """GB/s at which ``store.codec`` encodes the save's tensor bytes on the usable cores."""
    pieces: list[tuple[memoryview, int, bool]] = []
    for f in read_checkpoint(detect(tag_dir)):
        with f.open() as src:
            for entry in f.entries:
                nbytes = entry.tensor.numel() * entry.tensor.element_size()
                if nbytes:
                    data = src.read(entry.file_offset or 0, nbytes)
                    step = 8 << 20
                    floating = entry.tensor.is_floating_point()
                    size = entry.tensor.element_size()
                    pieces += [(data[i : i + step], size, floating) for i in range(0, len(data), step)]
    total = sum(len(p) for p, _, _ in pieces)
    with ThreadPoolExecutor(usable_cores()) as pool:
        began = time.perf_counter()
        list(pool.map(lambda p: sum(len(c) for c in codec.encode(p[0], itemsize=p[1], is_float=p[2])), pieces))
        seconds = time.perf_counter() - began
    return total / seconds / 1e9, total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("tag_dir", type=Path)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--work", type=Path, default=Path(".bench/cost"))
    args = parser.parse_args()
    tailor = tailor_command()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    raw = dir_bytes(args.tag_dir)
    args.work.mkdir(parents=True, exist_ok=True)
    io = io_paths(args.work / "io")
    encode_gbps, tensor_bytes = codec_rate(args.tag_dir)
    startups = []
    for _ in range(5):
        began = time.perf_counter()
        subprocess.run([tailor, "--version"], env=env, check=True, stdout=subprocess.DEVNULL)
        startups.append(time.perf_counter() - began)
    startup = min(startups)
    commits, checkouts, stored = [], [], 0
    for i in range(args.repeats):
        store = args.work / f"store{i}"
        shutil.rmtree(store, ignore_errors=True)
        subprocess.run([tailor, "init", str(store)], env=env, check=True, stdout=subprocess.DEVNULL)
        commits.append(
            timed_process([tailor, "commit", str(args.tag_dir), "--quiet"], env | {"TAILOR_STORE": str(store)})
        )
        stored = sum(dir_bytes(store / sub) for sub in ("blobs", "packs") if (store / sub).exists())
        out = args.work / f"out{i}"
        shutil.rmtree(out, ignore_errors=True)
        checkouts.append(
            timed_process(
                [tailor, "checkout", "latest", "--out", str(out), "--quiet"], env | {"TAILOR_STORE": str(store)}
            )
        )
        shutil.rmtree(out, ignore_errors=True)
        shutil.rmtree(store, ignore_errors=True)
    direct_write, direct_read = io["direct"] * 1e9, io["direct_read"] * 1e9
    commit_floor = max(stored / direct_write, tensor_bytes / (encode_gbps * 1e9)) + startup
    checkout_floor = stored / direct_read + raw / direct_write + startup

    def summary(found: list[dict], floor: float) -> dict:
        wall = statistics.median(r["wall"] for r in found)
        cpu = statistics.median(r["user"] + r["system"] for r in found)
        per_gb = cpu / (raw / 1e9)
        rss = max(r["rss"] for r in found)
        return {"wall": wall, "cpu": cpu, "cpu_s_per_gb": per_gb, "floor": floor, "wall_over_floor": wall / floor,
                "peak_rss": rss}  # fmt: skip

    report = {
        "raw_bytes": raw,
        "tensor_bytes": tensor_bytes,
        "stored_bytes": stored,
        "direct_write_gbps": io["direct"],
        "direct_read_gbps": io["direct_read"],
        "encode_gbps": encode_gbps,
        "cores": usable_cores(),
        "startup": startup,
        "commit": summary(commits, commit_floor),
        "checkout": summary(checkouts, checkout_floor),
    }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
