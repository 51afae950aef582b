"""Faults on a multi-server SeaweedFS under real `tailor` commands (testbed/seaweed_faults.py).

    python -m benchmarks.seaweed_faults                 # every fault; the table of docs/benchmarks.md
    python -m benchmarks.seaweed_faults --only gateway  # the faults whose name says so

Prints one row a fault: the fault, the operation, its outcome (exit code, and its one line when it
failed), seconds to fail or finish, whether the fault landed, the retry's exit code, and what the
checks afterwards found (verify --deep and bit-for-bit checkouts from a fresh host). Exits 1 when
any check found a problem.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="run only the faults whose name or operation holds this")
    parser.add_argument("--skip", default="", help="skip the faults whose name or operation holds this")
    parser.add_argument("--keep", type=Path, default=None, help="keep the cluster's folder here")
    args = parser.parse_args(argv)
    from testbed.seaweed_faults import FAULTS, Bench, run_fault

    work = args.keep or Path(tempfile.mkdtemp(prefix="seaweed-faults-"))
    bench = Bench(work)
    bad = 0
    print("| fault | operation | outcome | seconds | landed | took writes again after | retry | checks afterwards |")
    print("|---|---|---|---|---|---|---|---|")
    try:
        for i, fault in enumerate(FAULTS):
            what = f"{fault.name} {fault.operation} {fault.strike}"
            if (args.only and args.only not in what) or (args.skip and args.skip in what):
                continue
            out = run_fault(bench, fault, 10 + i)
            outcome = "completed (0)" if out.code == 0 else f"failed ({out.code}): {out.said}"
            retry = "-" if out.retried is None else str(out.retried)
            checks = "; ".join(out.problems) or "ok"
            bad += bool(out.problems)
            back = "-" if out.recovered is None else f"{out.recovered:.0f} s"
            print(f"| {fault.name} | {fault.operation} | {outcome} | {out.seconds:.1f} | "
                  f"{'yes' if out.struck else 'no'} | {back} | {retry} | {checks} |", flush=True)  # fmt: skip
    finally:
        bench.stop()
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
