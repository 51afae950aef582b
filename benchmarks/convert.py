"""Converting a stored step, against DeepSpeed's own tools on the same save: whole processes.

    python -m benchmarks.convert [--sizes medium,large] [--repeats 3]

* ``tailor export STEP --dtype fp32`` against ``python zero_to_fp32.py SAVE OUT
  --safe_serialization`` (the copy DeepSpeed writes next to every save, as users run it), both
  writing one consolidated fp32 model.safetensors.

Each time is a whole process, start-up included; each peak RSS is that process's own VmHWM
(read by a wrapper at exit: Linux carries ru_maxrss across fork and exec, so a child's
ru_maxrss can report its parent's peak). Medians of ``--repeats``, alternating which side goes
first. Saves are the suite's (benchmarks/suite.py SIZES: medium 58M, large 100M parameters,
ZeRO-2 bf16, 2 ranks), trained once under --workdir. The table goes into docs/benchmarks.md
between the ``convert`` markers.
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

from . import suite
from .report import write_section

DOC = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"
BEGIN, END = "<!-- convert:begin -->", "<!-- convert:end -->"

# Runs a command in this process, then reports its own peak resident set (kB) on stderr's last line.
_PEAK = (
    "import runpy, sys\n"
    "def peak():\n"
    "    print('VmHWM', [x.split()[1] for x in open('/proc/self/status') if x.startswith('VmHWM')][0],"
    " file=sys.stderr)\n"
    "kind, target, *rest = sys.argv[1:]\n"
    "sys.argv = [target, *rest]\n"
    "try:\n"
    "    runpy.run_module(target, run_name='__main__') if kind == 'module' else runpy.run_path(target,"
    " run_name='__main__')\n"
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
    sides = {
        "tailor export --dtype fp32": ("module", "tailorstore.cli.app", ["export", f"step={step}", "--dtype", "fp32"]),
        "zero_to_fp32.py --safe_serialization": ("path", str(single / "zero_to_fp32.py"), [str(single)]),
    }
    times: dict[str, list[float]] = {k: [] for k in sides}
    peaks: dict[str, list[int]] = {k: [] for k in sides}
    outputs: dict[str, int] = {}
    for r in range(repeats):
        order = list(sides) if r % 2 == 0 else list(reversed(sides))
        for label in order:
            kind, target, args = sides[label]
            out = work / f"out-{r}-{label.split()[0].replace('.py', '')}"
            shutil.rmtree(out, ignore_errors=True)
            extra = ["--out", str(out), "-q"] if kind == "module" else [str(out), "--safe_serialization"]
            suite.warm(single)
            wall, peak = run_measured(kind, target, [*args, *extra], env)
            times[label].append(wall)
            peaks[label].append(peak)
            outputs[label] = suite.dir_bytes(out)
            shutil.rmtree(out)
    return {
        "size": name,
        "params": suite.params_of(suite.SIZES[name]),
        "raw": suite.dir_bytes(single / tag_dir.name),
        "largest_tensor": 4 * suite.SIZES[name].vocab * suite.SIZES[name].dim,
        "seconds": {k: statistics.median(v) for k, v in times.items()},
        "peak": {k: statistics.median(v) for k, v in peaks.items()},
        "output": outputs,
    }


def render(results: list[dict], command: str) -> str:
    ours, theirs = "tailor export --dtype fp32", "zero_to_fp32.py --safe_serialization"
    lines = [
        BEGIN,
        "## Conversion: export against DeepSpeed's zero_to_fp32",
        "",
        f"Command: `{command}` (measured {dt.datetime.now().isoformat(timespec='seconds')}).",
        "Whole processes, start-up included, on the same ZeRO-2 bf16 save (2 ranks); peak RSS is each",
        "process's own VmHWM. tailorstore's modules are byte-compiled first, as `pip install` leaves them",
        "(this machine sets PYTHONDONTWRITEBYTECODE; DeepSpeed's are compiled in site-packages).",
        "Both write one fp32 `model.safetensors`; `tailor export` reads the",
        "committed step from the store, zero_to_fp32 the save's files (in the page cache, read once before).",
        "tests/test_export.py checks that the tensors are equal.",
        "",
        "| size | params | save | zero_to_fp32 | tailor export | speed-up | zero_to_fp32 peak RSS | export peak RSS |"
        " RSS ratio | largest tensor + 500 MB |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    met = []
    for r in results:
        t, o = r["seconds"][theirs], r["seconds"][ours]
        pt, po = r["peak"][theirs], r["peak"][ours]
        bound = r["largest_tensor"] + 500e6
        met.append((t / o >= 5, po <= pt / 4, po <= bound))
        lines.append(
            f"| {r['size']} | {r['params'] / 1e6:.0f}M | {r['raw'] / 1e6:,.1f} MB | {t:.2f} s | {o:.2f} s | "
            f"{t / o:.1f}x | {pt / 1e6:,.1f} MB | {po / 1e6:,.1f} MB | {po / pt:.2f} | {bound / 1e6:,.0f} MB |"
        )
    lines += [
        "",
        "Targets: at least 5x faster: " + ", ".join("met" if m[0] else "not met" for m in met)
        + "; at most 1/4 of zero_to_fp32's peak RSS: " + ", ".join("met" if m[1] else "not met" for m in met)
        + "; peak RSS within the largest tensor + 500 MB: " + ", ".join("met" if m[2] else "not met" for m in met)
        + " (in the order of the rows).",
        END,
    ]  # fmt: skip
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
