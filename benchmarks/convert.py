"""Converting a stored step, against DeepSpeed's own tools on the same save: whole processes.

    python -m benchmarks.convert [--sizes medium,large] [--repeats 3]

* ``tailor export STEP --dtype fp32`` against ``python zero_to_fp32.py SAVE OUT
  --safe_serialization`` (the copy DeepSpeed writes next to every save, as users run it), both
  writing one consolidated fp32 model.safetensors;
* ``tailor checkout STEP --format universal`` against ``ds_to_universal --inject_missing_state``;
* ``tailor checkout STEP --world-size 1`` against ``ds_to_universal`` (DeepSpeed's way to another
  world size), alone and followed by a DeepSpeed process that loads the result on one rank.

Each time is a whole process, start-up included; each peak RSS is that process's own VmHWM, or
its largest worker process's ru_maxrss when that is higher (ds_to_universal works in a pool),
read by a wrapper at exit (the wrapper, not the benchmark, is the parent: Linux carries ru_maxrss
across fork and exec, so a child's ru_maxrss can report its parent's peak). Medians of
``--repeats``, alternating which side goes first. Every pair runs warm (DeepSpeed's input in the
page cache, as right after a save; tailorstore reads its blobs around the page cache, so from disk)
and then cold (the save's files evicted too). The report adds what the disk allows any
conversion (bytes read and written at the measured rate, plus start-up). Saves are the suite's (benchmarks/suite.py
SIZES: medium 58M, large 100M parameters, ZeRO-2 bf16, 2 ranks), trained once under --workdir.
The tables go into docs/benchmarks.md between the ``convert`` markers.
"""

from __future__ import annotations

import argparse
import compileall
import datetime as dt
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from tailorstore.access.contents import Contents
from tailorstore.store.repo import Repository
from testbed.runs import train_tiny

from . import suite
from .report import write_section

DOC = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"
BEGIN, END = "<!-- convert:begin -->", "<!-- convert:end -->"
CONVERSIONS = ("export", "universal", "world-size")  # the keys of measure()'s pairs, in report order

# Runs a command in this process, then reports its peak resident set (kB) on stderr's last line: its
# own VmHWM, or the largest of its worker processes' (ds_to_universal works in a multiprocessing pool).
_PEAK = (
    "import os, resource, runpy, sys\n"
    "def peak():\n"
    "    own = int([x.split()[1] for x in open('/proc/self/status') if x.startswith('VmHWM')][0])\n"
    "    workers = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss\n"
    "    print('VmHWM', max(own, workers), file=sys.stderr, flush=True)\n"
    "leave, me = os._exit, os.getpid()\n"
    "def peak_then_leave(code):\n"  # the tailor command leaves through os._exit (cli/app.run)
    "    if os.getpid() == me:\n"  # not in ds_to_universal's forked workers, which leave the same way
    "        peak()\n"
    "    leave(code)\n"
    "os._exit = peak_then_leave\n"
    "kind, target, *rest = sys.argv[1:]\n"
    "sys.argv = [target, *rest]\n"
    "try:\n"
    "    if kind == 'module':\n"
    "        runpy.run_module(target, run_name='__main__', alter_sys=True)\n"
    "    else:\n"
    "        runpy.run_path(target, run_name='__main__')\n"
    "finally:\n"
    "    peak()\n"
)


def run_measured(kind: str, target: str, args: list[str], env: dict[str, str]) -> tuple[float, int]:
    """(wall seconds, peak RSS bytes) of one whole process running ``target`` (a module or a script)."""
    began = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-c", _PEAK, kind, target, *args], capture_output=True, text=True, env=env, timeout=3600
    )
    wall = time.perf_counter() - began
    if proc.returncode != 0:
        raise RuntimeError(f"{target} {' '.join(args)} failed: {proc.stderr[-2000:]}")
    peak = [line for line in proc.stderr.splitlines() if line.startswith("VmHWM")][-1]
    return wall, int(peak.split()[1]) * 1024


def disk_counters(path: Path) -> tuple[int, int] | None:
    """(bytes read + written, milliseconds busy) so far on the block device holding ``path``
    (/proc/diskstats), or None where there is no such line (not Linux, a network file system)."""
    dev = os.stat(path).st_dev
    try:
        lines = Path("/proc/diskstats").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        f = line.split()
        if (int(f[0]), int(f[1])) == (os.major(dev), os.minor(dev)):
            return (int(f[5]) + int(f[9])) * 512, int(f[12])
    return None


def training(name: str, workdir: Path) -> tuple[Path, int]:
    """The size's save (trained once), and the step to convert."""
    if (workdir / name / "train" / "trained.json").exists():
        save, steps, _ = suite.train(suite.SIZES[name], workdir / name / "train", 2, 20)
    else:  # a size the main suite did not train: one save after two steps is enough to convert
        save, steps, _ = suite.train(suite.SIZES[name], workdir / f"convert-{name}" / "train", 1, 2)
    return save, steps[0]


def measure(name: str, workdir: Path, repeats: int) -> dict:
    save, step = training(name, workdir)
    work = workdir / f"convert-{name}"
    work.mkdir(parents=True, exist_ok=True)
    tag_dir = save / f"global_step{step}"
    single = work / "single"  # the step alone, as a save directory (zero_to_fp32 reads `latest` or --tag)
    if not single.exists():
        (single / tag_dir.name).mkdir(parents=True)
        for f in tag_dir.iterdir():
            os.link(f, single / tag_dir.name / f.name)
        (single / "latest").write_text(tag_dir.name)
        shutil.copy(save / "zero_to_fp32.py", single / "zero_to_fp32.py")
    store = work / "store"
    env = {**os.environ, "TAILOR_STORE": str(store)}
    if not store.exists():
        subprocess.run([*suite.TAILOR, "init", str(store)], check=True, env=env, capture_output=True)
        subprocess.run([*suite.TAILOR, "commit", str(single), "-q"], check=True, env=env, capture_output=True)
    universal_args = ["--input_folder", str(single / tag_dir.name), "--inject_missing_state", "--output_folder"]
    pairs = {
        "export": (
            ("tailor export --dtype fp32", "module", "tailorstore.cli.app",
             ["export", f"step={step}", "--dtype", "fp32", "-q", "--out"]),
            ("zero_to_fp32.py --safe_serialization", "path", str(single / "zero_to_fp32.py"),
             [str(single), "--safe_serialization"]),
        ),
        "universal": (
            ("tailor checkout --format universal", "module", "tailorstore.cli.app",
             ["checkout", f"step={step}", "--format", "universal", "-q", "--out"]),
            ("ds_to_universal", "module", "deepspeed.checkpoint.ds_to_universal", universal_args),
        ),
        "world-size": (
            ("tailor checkout --world-size 1", "module", "tailorstore.cli.app",
             ["checkout", f"step={step}", "--world-size", "1", "-q", "--out"]),
            ("ds_to_universal", "module", "deepspeed.checkpoint.ds_to_universal", universal_args),
        ),
    }  # fmt: skip
    results: dict[str, dict] = {}
    out_bytes: dict[str, int] = {}
    disk: dict[str, list[tuple[float, int, float]]] = {}  # our warm runs: (wall, bytes moved, seconds busy)
    for start in ("warm", "cold"):  # every warm run first: a cold run evicts what the next one would read
        for what, sides in pairs.items():
            times: dict[str, list[float]] = {label: [] for label, *_ in sides}
            peaks: dict[str, list[int]] = {label: [] for label, *_ in sides}
            durable: dict[str, list[float]] = {label: [] for label, *_ in sides}
            for r in range(repeats):
                for label, kind, target, args in sides if r % 2 == 0 else tuple(reversed(sides)):
                    out = work / f"out-{what}-{r}-{start}-{label.split()[0].replace('.py', '')}"
                    shutil.rmtree(out, ignore_errors=True)
                    # the output directory goes last; ds_to_universal writes into out/<tag>
                    place = str(out / tag_dir.name) if target.startswith("deepspeed.") else str(out)
                    if start == "warm":
                        suite.warm(single)  # DeepSpeed's input as right after a save; our blobs are never cached
                    else:
                        evict(single)  # the save read from disk too, as when it is converted days later
                    os.sync()  # nothing of the run before (its output, its removal) left to write back
                    before = disk_counters(work)
                    wall, peak = run_measured(kind, target, [*args, place], env)
                    after = disk_counters(work)
                    if start == "warm":  # until the output is on disk: ours is fsynced, theirs is not
                        began = time.perf_counter()
                        os.sync()
                        durable[label].append(wall + time.perf_counter() - began)
                    times[label].append(wall)
                    peaks[label].append(peak)
                    if start == "warm" and target == "tailorstore.cli.app":
                        out_bytes[what] = suite.dir_bytes(out)
                        if before is not None and after is not None:
                            disk.setdefault(what, []).append(
                                (wall, after[0] - before[0], (after[1] - before[1]) / 1000)
                            )
                    if start == "warm" and r == repeats - 1 and what == "world-size":
                        results.setdefault("kept", {})[label] = str(out)
                    else:
                        shutil.rmtree(out)
            if start == "warm":
                results[what] = {
                    "sides": [label for label, *_ in sides],
                    "seconds": {k: statistics.median(v) for k, v in times.items()},
                    "peak": {k: statistics.median(v) for k, v in peaks.items()},
                    "durable": {k: statistics.median(v) for k, v in durable.items()},
                }
            else:
                results[what]["cold_seconds"] = {k: statistics.median(v) for k, v in times.items()}
    results["floor"] = floor_inputs(work, store, step, env, out_bytes)
    results["floor"]["disk"] = {
        what: {
            "moved": statistics.median(m / w for w, m, _ in runs),  # bytes a second over the whole process
            "busy": statistics.median(b / w for w, _, b in runs),  # share of the process the disk was busy
        }
        for what, runs in disk.items()
    }
    # End to end for another world size: the conversion, then DeepSpeed loading it on 1 rank (a process
    # that loads and stops; its start-up is the same on both sides).
    size = suite.SIZES[name]
    options = dict(stage=2, dtype="bf16", dim=size.dim, layers=size.layers, hidden=size.hidden, vocab=size.vocab,
                   heads=size.heads, seq=64, micro_batch=2)  # fmt: skip
    loads: dict[str, float] = {}
    for label, universal in (("tailor checkout --world-size 1", False), ("ds_to_universal", True)):
        source = Path(results["kept"][label])
        began = time.perf_counter()
        train_tiny(work / f"load-{universal}", losses_out=work / f"load-{universal}.json", nproc=1, steps=step,
                   save_every=0, resume_from=source, load_universal=universal, **options)  # fmt: skip
        loads[label] = time.perf_counter() - began
    results["world-size"]["load"] = loads
    del results["kept"]
    return {
        "size": name,
        "params": suite.params_of(suite.SIZES[name]),
        "raw": suite.dir_bytes(single / tag_dir.name),
        "largest_tensor": 4 * suite.SIZES[name].vocab * suite.SIZES[name].dim,
        **results,
    }


def evict(path: Path) -> None:
    """Drop the files under ``path`` from the page cache (written out first), leaving the rest of the
    cache (Python, torch and our own libraries) as it was: the save is read from disk, not the code."""
    os.sync()
    for p in sorted(path.rglob("*")):
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def floor_inputs(work: Path, store: Path, step: int, env: dict[str, str], out_bytes: dict[str, int]) -> dict:
    """What any conversion must spend on this disk: the stored bytes it reads from the store (export
    reads the FP32 masters, universal and world-size every blob of the step), the bytes it writes,
    the rate this disk moves bytes when one file is read while another is written (as conversions
    do; ``suite.io_paths``), and a command's start-up (``tailor log`` on the same store)."""
    repo = Repository.open(store)
    try:
        manifest = repo.resolve(f"step={step}")
        blobs = {b.hash: b.stored_size for b in repo.view(Contents).referenced_blobs(manifest)}
        masters = {a.blob for a in repo.view(Contents).atoms(manifest, kind="master")}
    finally:
        repo.close()
    read = {"export": sum(blobs[h] for h in masters), "universal": sum(blobs.values())}
    read["world-size"] = read["universal"]
    starts = [run_measured("module", "tailorstore.cli.app", ["log"], env)[0] for _ in range(5)]
    io = suite.io_paths(work / "io", repeats=3)
    return {"read": read, "written": out_bytes, "rate": io["read_and_write"], "startup": statistics.median(starts)}


def _speedup_rows(results: list[dict], key: str) -> tuple[list[str], list[str]]:
    """Table rows (size, ours, theirs, their time, our time, speed-up) of the medians under ``key``
    for every conversion, and a verdict on the 5x target for each."""
    rows, verdicts = [], []
    for r in results:
        for what in CONVERSIONS:
            ours, theirs = r[what]["sides"]
            t, o = r[what][key][theirs], r[what][key][ours]
            rows.append(f"| {r['size']} | `{ours}` | `{theirs}` | {t:.2f} s | {o:.2f} s | {t / o:.1f}x |")
            verdicts.append(f"{r['size']} {what} {'met' if t / o >= 5 else 'not met'}")
    return rows, verdicts


def render(results: list[dict], command: str) -> str:
    lines = [
        BEGIN,
        "## Conversion: export, universal and another world size, against DeepSpeed's own tools",
        "",
        f"Command: `{command}` (measured {dt.datetime.now().isoformat(timespec='seconds')}).",
        "Whole processes, start-up included, on the same ZeRO-2 bf16 save (2 ranks); peak RSS is each",
        "process's own VmHWM, or its largest worker's (ds_to_universal's pool) when higher.",
        "tailorstore's modules are byte-compiled first, as `pip install` leaves them",
        "(this machine sets PYTHONDONTWRITEBYTECODE; DeepSpeed's are compiled in site-packages).",
        "tailorstore reads the committed step from the store; DeepSpeed's tools read the save's files (in the",
        "page cache, read once before). tests/system/test_export.py, test_universal.py and test_reshard.py check",
        "that the outputs are equal. Targets: at least 5x faster, at most 1/4 of the peak RSS.",
        "",
        "| size | params | save | ours | theirs | their time | our time | speed-up | their peak RSS |"
        " our peak RSS | RSS ratio |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    verdicts = []
    for r in results:
        for what in CONVERSIONS:
            ours, theirs = r[what]["sides"]
            t, o = r[what]["seconds"][theirs], r[what]["seconds"][ours]
            pt, po = r[what]["peak"][theirs], r[what]["peak"][ours]
            verdicts.append(
                f"{r['size']} {what}: {'met' if t / o >= 5 else 'not met'} / {'met' if po <= pt / 4 else 'not met'}"
            )
            lines.append(
                f"| {r['size']} | {r['params'] / 1e6:.0f}M | {r['raw'] / 1e6:,.1f} MB | `{ours}` | `{theirs}` | "
                f"{t:.2f} s | {o:.2f} s | {t / o:.1f}x | {pt / 1e6:,.1f} MB | {po / 1e6:,.1f} MB | {po / pt:.2f} |"
            )
    lines += ["", "Speed / RSS targets: " + "; ".join(verdicts) + ".", ""]
    lines += [
        "What the disk allows any conversion, whatever its code (arithmetic on rates measured in the same run,",
        "not a measurement of ours): the stored bytes it must read from the store plus the bytes it must write,",
        "at the rate this disk moves bytes while one file is read and another written (`suite.io_paths`), plus",
        "a command's start-up (`tailor log` on the same store). DeepSpeed's tools read their input from the",
        "page cache in the table above, so the disk's time is ours alone there.",
        "",
        "| size | ours | read from the store | written | at | + start-up | least possible | their time / 5 "
        "| our time |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    ruled_out, room = [], []
    for r in results:
        f = r["floor"]
        for what in CONVERSIONS:
            ours, theirs = r[what]["sides"]
            read, written = f["read"][what], f["written"][what]
            least = (read + written) / (f["rate"] * 1e9) + f["startup"]
            target, mine = r[what]["seconds"][theirs] / 5, r[what]["seconds"][ours]
            lines.append(
                f"| {r['size']} | `{ours}` | {read / 1e6:,.0f} MB | {written / 1e6:,.0f} MB | {f['rate']:.2f} GB/s | "
                f"{f['startup']:.2f} s | {least:.2f} s | {target:.2f} s | {mine:.2f} s |"
            )
            (ruled_out if least > target else room).append(f"{r['size']} {what} ({least / target:.2f})")
    lines += [
        "",
        "Least possible / their time / 5, where the disk alone rules 5x out: "
        + (", ".join(ruled_out) or "none")
        + "; where it leaves room: "
        + (", ".join(room) or "none")
        + ".",
    ]
    if all(r["floor"].get("disk") for r in results):
        lines += [
            "",
            "How hard our warm runs above worked the disk (/proc/diskstats of its device, whole process,",
            "start-up included): the bytes it moved a second, and the share of the time it had a request",
            "in flight (a disk that serves requests in parallel can be busy and still take more, so the",
            "rate is the figure to set against the one measured above).",
            "",
            "| size | ours | disk moved | disk busy |",
            "|---|---|---|---|",
        ]
        for r in results:
            for what in CONVERSIONS:
                d = r["floor"]["disk"][what]
                lines.append(
                    f"| {r['size']} | `{r[what]['sides'][0]}` | {d['moved'] / 1e9:.2f} GB/s | {d['busy']:.0%} |"
                )
    if all("durable" in r[w] for r in results for w in CONVERSIONS):
        lines += [
            "",
            "Until the output is on disk: each warm run above followed by `sync`. tailorstore fsyncs its output",
            "before it renames the folder into place (a crash never leaves a silently short file under the",
            "name); DeepSpeed's tools exit with theirs still in the page cache. Same runs, medians.",
            "",
            "| size | ours | theirs | their time + sync | our time + sync | speed-up |",
            "|---|---|---|---|---|---|",
        ]
        lines += _speedup_rows(results, "durable")[0]
    if all("cold_seconds" in r[w] for r in results for w in CONVERSIONS):
        lines += [
            "",
            "Both sides cold: the save's files dropped from the page cache (`posix_fadvise(DONTNEED)`, libraries",
            "left cached) before every run, so DeepSpeed's tools read the save from disk as tailorstore reads its",
            "blobs, as when a run is converted or resumed days after it was saved. Same repeats, medians.",
            "",
            "| size | ours | theirs | their time | our time | speed-up |",
            "|---|---|---|---|---|---|",
        ]
        rows, cold_verdicts = _speedup_rows(results, "cold_seconds")
        lines += [*rows, "", "Speed target, both cold: " + "; ".join(cold_verdicts) + "."]
    lines.append("")
    lines += [
        "End to end for another world size: the conversion plus a DeepSpeed process (1 rank) that loads the",
        "result and stops (`engine.load_checkpoint`, natively for ours, with `load_universal` for DeepSpeed's):",
        "",
        "| size | checkout --world-size 1 + load | ds_to_universal + load_universal | speed-up |",
        "|---|---|---|---|",
    ]
    for r in results:
        w = r["world-size"]
        ours, theirs = w["sides"]
        o = w["seconds"][ours] + w["load"][ours]
        t = w["seconds"][theirs] + w["load"][theirs]
        lines.append(f"| {r['size']} | {o:.2f} s | {t:.2f} s | {t / o:.2f}x |")
    lines += [
        "",
        "Export's peak RSS against its bound (the largest tensor + 500 MB): "
        + ", ".join(
            f"{r['size']} {r['export']['peak'][r['export']['sides'][0]] / 1e6:,.0f} MB of "
            f"{(r['largest_tensor'] + 500e6) / 1e6:,.0f} MB"
            for r in results
        )
        + ".",
        END,
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.convert", description=__doc__)
    parser.add_argument("--sizes", default="medium,large")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workdir", type=Path, default=Path(".bench"))
    args = parser.parse_args(argv)
    # A pip install writes bytecode; this machine sets PYTHONDONTWRITEBYTECODE, so an editable
    # checkout would compile every module in every process. Compile once, as an install would.
    root = Path(__file__).resolve().parent.parent
    for package in ("tailorstore", "cli"):
        compileall.compile_dir(root / package, quiet=1)
    results = [measure(name, args.workdir, args.repeats) for name in args.sizes.split(",") if name]
    command = "python -m benchmarks.convert " + shlex.join(sys.argv[1:] if argv is None else argv)
    (args.workdir / "convert.json").write_text(json.dumps(results, indent=1))
    block = render(results, command)
    write_section(DOC, block)
    print(block)


if __name__ == "__main__":
    main()
