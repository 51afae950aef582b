"""The job-life simulation's soak (testbed/job_life.py).

``python -m benchmarks.job_life [--schedules 200] [--seed S] [--regressions] [--keep DIR] [--json FILE]``

Runs ``N`` schedules, seeds from ``S`` (each a tiny real DeepSpeed training killed somewhere on
its save's path, restarted, maybe killed again in its recovery), or with ``--regressions`` the
kept regression schedules, and prints one line a schedule and each seed that broke an invariant
with the command that replays it (``--seed S --schedules 1``). The exit status is 1 when any
schedule broke an invariant.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from pathlib import Path

from testbed.job_life import DRAWN, FAULTS, INTEGRATIONS, REGRESSIONS, outcome_line, run_schedule, schedule_for


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--schedules", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--regressions", action="store_true", help="the kept regression schedules instead of seeds")
    named = sorted(set(INTEGRATIONS) - set(DRAWN))
    p.add_argument("--integration", choices=named, default=None, help="an integration never drawn, for every schedule")
    p.add_argument("--faults", choices=FAULTS, default="kills", help="stalls: staging full and stalls (DeepSpeed)")
    p.add_argument("--keep", type=Path, default=None, help="copy a broken schedule's folders here")
    p.add_argument("--json", type=Path, default=None, help="every outcome, as JSON lines")
    args = p.parse_args(argv)
    schedules = (
        list(REGRESSIONS.values())
        if args.regressions
        else [schedule_for(s, args.integration, args.faults) for s in range(args.seed, args.seed + args.schedules)]
    )
    references: dict = {}
    broken = []
    kinds: Counter[str] = Counter()
    began = time.monotonic()
    sink = args.json.open("a") if args.json else None
    for schedule in schedules:
        outcome = run_schedule(schedule, keep=args.keep, references=references)
        print(outcome_line(outcome), flush=True)
        if sink is not None:
            sink.write(json.dumps({"schedule": outcome.schedule, "seed": outcome.seed, "ok": outcome.ok,
                                   "violations": outcome.violations, "seconds": outcome.seconds}) + "\n")  # fmt: skip
            sink.flush()
        if not outcome.ok:
            broken.append(outcome)
            kinds.update(v.split(":")[0] for v in outcome.violations)
    elapsed = time.monotonic() - began
    print(f"{len(schedules)} schedules in {elapsed:.0f} s: {len(schedules) - len(broken)} held, {len(broken)} broke")
    for outcome in broken:
        how = "--regressions" if outcome.seed < 0 else f"--seed {outcome.seed} --schedules 1"
        how += f" --integration {args.integration}" if args.integration and outcome.seed >= 0 else ""
        how += f" --faults {args.faults}" if args.faults != "kills" and outcome.seed >= 0 else ""
        print(f"  replay: python -m benchmarks.job_life {how}   # {outcome.schedule}")
    if kinds:
        print("  invariants broken: " + ", ".join(f"{k} x{n}" for k, n in kinds.most_common()))
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
