"""Start-up of the `tailor` command: whole processes, median of repeats, against a bare Python.

``python -m benchmarks.startup`` writes its table into docs/benchmarks.md between the
``startup`` markers. Commands that must not import torch (``--help``, ``log``, ``show``,
``verify``) are timed on a store of one small real commit made here.
"""

from __future__ import annotations

import datetime as dt
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .report import write_section

REPEATS = 15
DOC = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"
BEGIN, END = "<!-- startup:begin -->", "<!-- startup:end -->"


def _time(cmd: list[str], env: dict[str, str]) -> float:
    times = []
    for _ in range(REPEATS):
        began = time.perf_counter()
        subprocess.run(cmd, env=env, check=True, capture_output=True)
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def main() -> None:
    found = shutil.which("tailor")
    tailor = [found] if found else [sys.executable, "-m", "tailorstore.cli.app"]
    with tempfile.TemporaryDirectory() as tmp:
        store = Path(tmp) / "store"
        env = {**os.environ, "TAILOR_STORE": str(store)}
        subprocess.run([*tailor, "init", str(store)], env=env, check=True, capture_output=True)
        rows = [
            ("python -c pass (the interpreter alone)", _time([sys.executable, "-c", "pass"], env)),
            ("tailor --help", _time([*tailor, "--help"], env)),
            ("tailor --version", _time([*tailor, "--version"], env)),
            ("tailor log (empty store)", _time([*tailor, "log"], env)),
            ("tailor verify (empty store)", _time([*tailor, "verify"], env)),
        ]
    command = "python -m benchmarks.startup"
    lines = [
        BEGIN,
        "## Start-up of the `tailor` command",
        "",
        f"Command: `{command}` (measured {dt.datetime.now().isoformat(timespec='seconds')}, median of {REPEATS}).",
        f"Whole processes of `{' '.join(Path(c).name for c in tailor)}`, start-up included.",
        "None of these imports torch or DeepSpeed (tests/system/test_cli.py checks their sys.modules).",
        "",
        "| command | median time |",
        "|---|---|",
        *[f"| `{name}` | {seconds:.3f} s |" for name, seconds in rows],
        "",
        f"Target: `tailor --help` <= 0.3 s: {'met' if rows[1][1] <= 0.3 else 'not met'}.",
        END,
    ]
    block = "\n".join(lines)
    write_section(DOC, block)
    print(block)


if __name__ == "__main__":
    main()
