"""The multi-host simulation's long run (testbed/simulation.py).

``python -m benchmarks.sim [--schedules 5000] [--backend posix|s3|both] [--seed S] [--jobs J]
[--code TREE] [--verbose] [--keep DIR]``

Runs ``N`` schedules, seeds from ``S``: with ``--backend both`` four fifths of them on POSIX and one
fifth on S3 (as CI's 200 and 50), ``--jobs`` schedules at a time (each on its own store with
its own three hosts), and prints every seed that broke an invariant with the command that replays it.
``--code`` runs the hosts on another tree of tailorstore (a worktree of an older commit), the
simulation and its checks staying this tree's. The inputs are two real 2-rank ZeRO-2 DeepSpeed
trainings (another seed for the second try), made once under ``.bench/sim/runs``.
The exit status is 1 when any seed broke an invariant.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from testbed.simulation import (
    TARGETED,
    HostServer,
    Inputs,
    Outcome,
    describe,
    host_environment,
    prepare_inputs,
    run_schedule,
)

ROOT = Path(".bench/sim")
SHARE = {"posix": 4, "s3": 1}  # fifths of --schedules each backend runs with --backend both, as CI splits them


def training_inputs(root: Path = ROOT) -> Inputs:
    from testbed.runs import train_tiny

    saves = {}
    for name, seed in (("a", 1234), ("b", 4321)):
        save = root / "runs" / name / "save"
        if not (save / "global_step6").is_dir():
            train_tiny(
                save,
                losses_out=save.parent / "losses.json",
                nproc=2,
                steps=6,
                save_every=3,
                stage=2,
                dtype="bf16",
                seed=seed,
            )
        saves[name] = save
    return prepare_inputs(saves["a"], saves["b"], root / "inputs")


def probe_ref_lock_timeout(server: HostServer, env: dict[str, str]) -> bool:
    """Whether this tree's ``tailor pin`` takes ``--lock-timeout`` (older trees' ref verbs took no lock)."""
    with tempfile.TemporaryDirectory(prefix="sim-probe-") as scratch:  # one each: workers probe at once
        out = Path(scratch) / "pin-help"
        ident = server.spawn(["pin", "--help"], dict(env, TAILOR_FAILPOINTS=""), out, None)
        server.wait(ident)
        return "--lock-timeout" in out.read_text()


def simulate(
    seeds: list[int],
    backend: str,
    inputs: Inputs,
    *,
    jobs: int = 3,
    code: str | None = None,
    keep: Path | None = None,
    report: Callable[[Outcome], None] | None = None,
    slip: bool = False,
    theme: str | None = None,
    server: str = "moto",
) -> list[Outcome]:
    """Run each seed on ``backend`` with ``jobs`` schedules at a time; every outcome, in seed order.
    On S3 the ``server`` is moto or SeaweedFS (testbed/seaweed_s3.py), started for these schedules."""
    s3 = None
    extra: dict[str, str] = {}
    scratch = None
    if backend == "s3" and server == "seaweedfs":
        import tempfile

        from testbed.seaweed_s3 import SeaweedS3

        scratch = tempfile.TemporaryDirectory(prefix="sim-seaweedfs-")
        s3 = SeaweedS3(Path(scratch.name)).start()
        extra = s3.environ()
    elif backend == "s3":
        import logging

        from testbed.local_s3 import LocalS3

        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto's server logs every request

        s3 = LocalS3().start()
        extra = s3.environ()
    env = host_environment(extra, code)
    outcomes: dict[int, Outcome] = {}
    todo = list(seeds)
    lock = threading.Lock()
    failures: list[BaseException] = []

    def location(work: Path) -> str:
        return s3.new_location() if s3 is not None else str(work / "store")

    def worker() -> None:
        server = HostServer(env)
        try:
            ref_lock = probe_ref_lock_timeout(server, env)
            while True:
                with lock:
                    if not todo or failures:
                        return
                    seed = todo.pop(0)
                outcome = run_schedule(seed, backend, inputs, server, env, location, ref_lock, keep, slip, theme)
                with lock:
                    outcomes[seed] = outcome
                    if report is not None:
                        report(outcome)
        except BaseException as exc:
            with lock:
                failures.append(exc)
        finally:
            server.close()

    threads = [threading.Thread(target=worker, name=f"sim-{i}") for i in range(max(1, jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if s3 is not None:
        s3.stop()
    if scratch is not None:
        scratch.cleanup()
    if failures:
        raise failures[0]
    return [outcomes[s] for s in seeds]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.sim", description=__doc__.split("\n\n")[0])
    parser.add_argument("--schedules", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0, help="the first seed")
    parser.add_argument("--backend", choices=("posix", "s3", "both"), default="both")
    parser.add_argument("--jobs", type=int, default=3)
    parser.add_argument("--server", choices=("moto", "seaweedfs"), default="moto", help="the S3 server, on S3")
    parser.add_argument("--code", help="run the hosts on this tree of tailorstore (an older commit's worktree)")
    parser.add_argument("--verbose", action="store_true", help="print every schedule's journal")
    parser.add_argument(
        "--slip",
        action="store_true",
        help="on S3, stop hosts at the client's request, after the library's own checks of it (fences): "
        "the timing gap docs/FORMAT.md section 8.1 names",
    )
    parser.add_argument("--keep", type=Path, help="keep each schedule's stores and outputs under this folder")
    parser.add_argument(
        "--theme", choices=TARGETED, help="a targeted theme for every schedule (never drawn): " + ", ".join(TARGETED)
    )
    args = parser.parse_args(argv)
    inputs = training_inputs()
    if args.keep:
        args.keep.mkdir(parents=True, exist_ok=True)
    backends = ("posix", "s3") if args.backend == "both" else (args.backend,)
    code = str(Path(args.code).resolve()) if args.code else None
    broken = 0
    for backend in backends:
        began, cpu = time.monotonic(), time.process_time()
        done = [0]

        def report(outcome: Outcome, done: list[int] = done, backend: str = backend, began: float = began) -> None:
            done[0] += 1
            if outcome.findings or args.verbose:
                print(describe(outcome), flush=True)
            if outcome.findings:
                print(f"  replay: {outcome.replay(args.code, args.slip)}", flush=True)
            elif done[0] % 100 == 0:
                print(f"{backend}: {done[0]} schedules, {time.monotonic() - began:.0f} s", flush=True)

        count = args.schedules if args.backend != "both" else SHARE[backend] * args.schedules // 5
        seeds = list(range(args.seed, args.seed + count))
        outcomes = simulate(
            seeds,
            backend,
            inputs,
            jobs=args.jobs,
            code=code,
            keep=args.keep,
            report=report,
            slip=args.slip,
            theme=args.theme,
            server=args.server,
        )
        bad = [o for o in outcomes if o.problems]
        late = [o for o in outcomes if o.overran and not o.problems]
        broken += len(bad) + len(late)
        ops = sum(len(o.journal) for o in outcomes)
        faults = sum(1 for o in outcomes for d in o.journal if d.op.get("fault"))
        outcomes_by = {
            k: sum(1 for o in outcomes for d in o.journal if d.outcome == k) for k in ("ok", "failed", "unknown")
        }
        print(
            f"{backend}: {len(outcomes)} schedules, {ops} operations ({faults} with a fault; {outcomes_by}), "
            f"{len(bad)} broke an invariant{': seeds ' + ' '.join(str(o.seed) for o in bad) if bad else ''}, "
            f"{len(late)} exceeded a bound{': seeds ' + ' '.join(str(o.seed) for o in late) if late else ''}; "
            f"{time.monotonic() - began:.0f} s wall, {time.process_time() - cpu:.1f} CPU-s in this process"
        )
        checking = sum(o.checking for o in outcomes)
        print(f"{backend}: {sum(o.seconds for o in outcomes):.0f} s in schedules, {checking:.0f} s of them checking")
        slowest = sorted(outcomes, key=lambda o: -o.seconds)[:3]
        print(f"{backend}: slowest seeds " + ", ".join(f"{o.seed} ({o.seconds:.1f} s)" for o in slowest))
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
