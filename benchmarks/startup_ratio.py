"""Start-up as ratios to the bare interpreter: ``python -m benchmarks.startup_ratio [STORE]``.

Whole processes, best of 7 each, measured in the same run as ``python -c pass``; ``tailor log``
runs on an empty store (made under /tmp unless STORE is given). Compile the bytecode first, as
a wheel install does (``python -m compileall -q tailorstore cli``).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def best(cmd: list[str], env: dict[str, str], n: int = 7) -> float:
    times = []
    for _ in range(n):
        began = time.perf_counter()
        subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
        times.append(time.perf_counter() - began)
    return min(times)


def main() -> None:
    work = Path(tempfile.mkdtemp(prefix="tailor-startup-"))
    store = Path(sys.argv[1]) if len(sys.argv) > 1 else work / "store"
    tailor = shutil.which("tailor") or str(Path(sys.executable).with_name("tailor"))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"} | {"TAILOR_STORE": str(store)}
    if not store.exists():
        subprocess.run([tailor, "init", str(store)], env=env, check=True, stdout=subprocess.DEVNULL)
    base = best([sys.executable, "-c", "pass"], env)
    rows = {"python -c pass": base}
    for args in (["--help"], ["--version"], ["log"]):
        rows["tailor " + " ".join(args)] = best([tailor, *args], env)
    print(json.dumps({k: {"seconds": round(v, 4), "ratio": round(v / base, 2)} for k, v in rows.items()}, indent=1))
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
