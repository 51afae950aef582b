"""Training stall: one DeepSpeed training (2 ranks, a save every few steps) timed four ways.

``python -m benchmarks.stall`` runs the same training with

* plain ``engine.save_checkpoint``, keeping every save on disk;
* DeepSpeed's ``FastCheckpointEngine`` (its ``DecoupledCheckpointEngine`` fails on this CPU
  build: it refuses to send the module's non-leaf tensors to its writer process);
* ``TailorCheckpointEngine`` with ``snapshot=False``: each file serialized inside the save;
* ``TailorCheckpointEngine`` (default): a snapshot inside the save, the files written and committed after;

and writes the table into docs/benchmarks.md between the ``stall`` markers. Each way is the
whole ``torchrun`` job (start-up included) and, inside it, the training loop and each save's
stall (how long ``save_checkpoint`` blocked rank 0). Disk use (the save folder plus the
store) and the staging folder in memory are sampled every 50 ms while the job runs.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import statistics
import subprocess
import threading
import time
from pathlib import Path

from tailorstore.api import Store
from testbed.runs import torchrun_command

from .report import write_section
from .suite import SIZES, params_of

DOC = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"
BEGIN, END = "<!-- stall:begin -->", "<!-- stall:end -->"
WAYS = ("plain", "fast", "tailor-sync", "tailor")
LABELS = {
    "plain": "plain `save_checkpoint`, every save kept",
    "fast": "DeepSpeed `FastCheckpointEngine`, every save kept",
    "tailor-sync": "`TailorCheckpointEngine`, each file serialized inside the save (`snapshot=False`)",
    "tailor": "`TailorCheckpointEngine`, a snapshot inside the save, files written after (default)",
}


def used_bytes(*roots: Path) -> int:
    """Bytes the files below ``roots`` occupy (allocated blocks, as `du` counts them)."""
    total = 0
    for root in roots:
        for folder, _dirs, names in os.walk(root):
            for name in names:
                try:
                    total += os.lstat(os.path.join(folder, name)).st_blocks * 512
                except FileNotFoundError:
                    continue
    return total


class Sampler:
    """Peak disk use and peak staging (memory) use while a job runs."""

    def __init__(self, disk: list[Path], memory: list[Path]) -> None:
        self.disk, self.memory = disk, memory
        self.peak_disk = self.peak_memory = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            self.peak_disk = max(self.peak_disk, used_bytes(*self.disk))
            self.peak_memory = max(self.peak_memory, used_bytes(*self.memory))

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def run_way(way: str, work: Path, size_name: str, steps: int, every: int, fp32_compute: bool = False) -> dict:
    size = SIZES[size_name]
    root = work / way
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    save, store = root / "save", root / "store"
    staging = Path("/dev/shm") / f"tailor-stall-{os.getpid()}"  # memory, as the engine's default
    args = ["--save-dir", str(save), "--steps", str(steps), "--save-every", str(every)]
    args += ["--timings-out", str(root / "timings.json"), "--losses-out", str(root / "losses.json"), "--floor-together"]
    args += ["--stage", "2", "--dtype", "bf16", "--seq", "64", "--micro-batch", "2", "--lr", "1e-3"]
    args += ["--dim", str(size.dim), "--layers", str(size.layers), "--hidden", str(size.hidden)]
    args += ["--vocab", str(size.vocab), "--heads", str(size.heads)]
    if fp32_compute:  # bf16 parameters and checkpoint layout, fp32 arithmetic (see main's --fp32-compute)
        args.append("--fp32-compute")
    if way == "fast":
        args.append("--fast-writer")
    if way.startswith("tailor"):
        Store.init(store).close()
        args += ["--tailor-engine", "--commit-to", str(store)]
    if way == "tailor-sync":
        args.append("--no-snapshot")
    cmd, env = torchrun_command("testbed.train_tiny", args)
    staging.mkdir(exist_ok=True)
    env["TAILOR_STAGING"] = str(staging)
    with Sampler([save, store], [staging]) as sampler:
        began = time.perf_counter()
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
        wall = time.perf_counter() - began
    shutil.rmtree(staging, ignore_errors=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{way}: training failed:\n" + "\n".join((proc.stdout + proc.stderr).splitlines()[-30:]))
    timings = json.loads((root / "timings.json").read_text())
    raw_save = used_bytes(*sorted(save.glob("global_step*"))[:1]) if not way.startswith("tailor") else 0
    return {
        "wall": wall,
        "loop": timings["loop_seconds"],
        "stalls": timings["stalls"],
        "copy_floor": timings.get("copy_floor_seconds"),
        "copy_floor_bytes": timings.get("copy_floor_bytes"),
        "copy_floor_together": timings.get("copy_floor_together_seconds"),
        "peak_disk": sampler.peak_disk,
        "peak_memory": sampler.peak_memory,
        "final_disk": used_bytes(save, store),
        "raw_save": raw_save,
        "losses": json.loads((root / "losses.json").read_text()),
    }


def median_run(found: list[dict]) -> dict:
    """Medians of the times over the repeats; peaks are the largest seen; stalls pooled."""
    first = found[0]
    return {
        **first,
        "wall": statistics.median(r["wall"] for r in found),
        "loop": statistics.median(r["loop"] for r in found),
        "copy_floor": min(r["copy_floor"] for r in found) if all(r["copy_floor"] for r in found) else None,
        "copy_floor_together": (
            min(r["copy_floor_together"] for r in found) if all(r.get("copy_floor_together") for r in found) else None
        ),
        "stalls": [s for r in found for s in r["stalls"]],
        "later_stalls": [s for r in found for s in r["stalls"][1:]],  # the saves after the first, which reuse memory
        "peak_disk": max(r["peak_disk"] for r in found),
        "peak_memory": max(r["peak_memory"] for r in found),
        "losses": first["losses"] if all(r["losses"] == first["losses"] for r in found) else None,
        "repeats": len(found),
    }


def render(
    results: dict[str, dict], size_name: str, steps: int, every: int, command: str, fp32_compute: bool = False
) -> str:
    plain = results["plain"]
    raw = plain["raw_save"]
    saves = len(plain["stalls"]) // plain["repeats"]  # stalls are pooled over the repeats
    arithmetic = "bf16 parameters multiplied in fp32" if fp32_compute else "bf16"
    lines = [
        BEGIN,
        "## Training stall: saving inside the training loop",
        "",
        f"Command: `{command}` (measured {dt.datetime.now().isoformat(timespec='seconds')}).",
        f"The same DeepSpeed training four ways: size {size_name} ({params_of(SIZES[size_name]) / 1e6:.0f}M "
        f"parameters, {arithmetic}, ZeRO-2, 2 ranks), {steps} steps, a save every {every} ({saves} saves of "
        f"{raw / 1e6:,.1f} MB raw), median of {plain['repeats']} runs of each, alternating the order. "
        "Wall is the whole `torchrun` job; loop is the training loop inside it "
        "(including waiting for the last commit or write); the stall is how long `save_checkpoint` "
        "blocked rank 0, over every save of every run. Peak disk is sampled every 50 ms over the save "
        "folder and the store; the "
        "staging column is the memory-backed folder (/dev/shm) the tailor engine serializes into.",
        "",
        "| way | wall | wall / plain | loop | median stall per save | max stall | stall / copy floor "
        "| peak disk | final disk | peak staging (memory) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for way in WAYS:
        r = results[way]
        floor = r.get("copy_floor")
        over = f"{statistics.median(r['stalls']) / floor:.1f}x" if floor else "-"
        lines.append(
            f"| {LABELS[way]} | {r['wall']:.1f} s | {r['wall'] / plain['wall']:.2f} | {r['loop']:.1f} s | "
            f"{statistics.median(r['stalls']):.2f} s | {max(r['stalls']):.2f} s | {over} | "
            f"{r['peak_disk'] / 1e6:,.0f} MB | {r['final_disk'] / 1e6:,.0f} MB | {r['peak_memory'] / 1e6:,.0f} MB |"
        )
    tailor, fast = results["tailor"], results["fast"]
    floor = tailor.get("copy_floor")
    if floor:
        stall = statistics.median(tailor["stalls"])
        lines += [
            "",
            f"Copy floor: rank 0's {tailor['copy_floor_bytes'] / 1e6:,.0f} MB of a save (bf16 weights, its fp32 "
            f"master and moments) copied into memory already mapped, best of 3, in the same job: {floor:.3f} s. "
            f"Target for the snapshot: median stall <= 1.5x the floor ({stall:.3f} s against {1.5 * floor:.3f} s: "
            f"{'met' if stall <= 1.5 * floor else 'not met'}).",
        ]
        together = tailor.get("copy_floor_together")
        later = statistics.median(tailor["later_stalls"]) if tailor["later_stalls"] else None
        if together and later:
            lines += [
                "",
                f"The same copy on both ranks at once, as a save runs it (each rank its own share, the same "
                f"job): {together:.3f} s. The median stall of the saves after the first (which reuse the "
                f"snapshot's memory; the first allocates it): {later:.3f} s, {later / floor:.2f}x the one-rank "
                f"floor and {later / together:.2f}x the both-ranks one. The median stall over every save is "
                f"{stall / together:.2f}x the both-ranks floor.",
            ]
    same = all(results[w]["losses"] == plain["losses"] for w in WAYS)
    lines += [
        "",
        f"Losses identical in every way: {'yes' if same else 'NO'}.",
        f"Targets for the tailor engine: wall <= 1.1x plain ({tailor['wall'] / plain['wall']:.2f}x: "
        f"{'met' if tailor['wall'] <= 1.1 * plain['wall'] else 'not met'}); wall <= the DeepSpeed engine's "
        f"({tailor['wall']:.1f} s against {fast['wall']:.1f} s: "
        f"{'met' if tailor['wall'] <= fast['wall'] else 'not met'}); "
        f"peak disk <= the final store plus one raw save ({tailor['peak_disk'] / 1e6:,.0f} MB against "
        f"{(tailor['final_disk'] + raw) / 1e6:,.0f} MB: "
        f"{'met' if tailor['peak_disk'] <= tailor['final_disk'] + raw else 'not met'}).",
        END,
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--size", default="medium", choices=sorted(SIZES))
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--save-every", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workdir", default=".bench/stall")
    parser.add_argument(
        "--fp32-compute",
        action="store_true",
        help="multiply the bf16 parameters in fp32: the same saves, but on a CPU without bf16 units the "
        "loop runs about 15x faster, so the saves' share of the wall is as on a GPU node",
    )
    args = parser.parse_args()
    work = Path(args.workdir).resolve()
    runs: dict[str, list[dict]] = {way: [] for way in WAYS}
    for repeat in range(args.repeats):
        order = WAYS if repeat % 2 == 0 else tuple(reversed(WAYS))  # neither side always goes first
        for way in order:
            runs[way].append(run_way(way, work, args.size, args.steps, args.save_every, args.fp32_compute))
            print(f"[stall] {way} #{repeat + 1}: {runs[way][-1]['wall']:.1f} s", flush=True)
    results = {way: median_run(found) for way, found in runs.items()}
    (work / "results.json").write_text(json.dumps(runs, indent=1))  # every run, for a later look
    command = (
        f"python -m benchmarks.stall --size {args.size} --steps {args.steps} --save-every {args.save_every} "
        f"--repeats {args.repeats}" + (" --fp32-compute" if args.fp32_compute else "")
    )
    block = render(results, args.size, args.steps, args.save_every, command, args.fp32_compute)
    write_section(DOC, block)
    print(block)


if __name__ == "__main__":
    main()
