"""Fuzzing every reader of outside bytes (testbed/fuzz_targets.py) with Hypothesis.

``python -m benchmarks.fuzz [--targets A,B] [--examples N] [--memory-mb 512] [--seconds 2]``

Seeds are real files and objects made by their writers (testbed/fuzz_seeds.py, in a child process:
it needs torch, which this process never imports). Each target gets ``--examples`` inputs: the
seeds mutated (bytes flipped, cut, spliced, repeated) or raw bytes. The rule for each input:

* it gives a result or one of tailorstore's errors (``TailorError``), never another exception;
* within ``--memory-mb`` of address space (``resource.setrlimit``), and ``--seconds`` of time
  (an alarm);
* and it leaves no process-wide state changed: every 25 inputs, and at the end, each seed reads
  back exactly as it did first.

A failing input is written to ``--crashes`` (default ``.bench/fuzz-crashes``) and printed with the
command that replays it. The exit status is 1 when any input broke the rule. CI runs each target
for a bounded number of inputs (tests/system/test_fuzz.py); run it longer here.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import logging
import resource
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tailorstore.core.errors import TailorError
from testbed.fuzz_targets import IMPORTS, MEMORY_MB, TARGETS


class Hang(Exception):
    """An input that ran past the time cap."""


def _alarm(signum: int, frame: Any) -> None:
    raise Hang("ran past the time cap")


@st.composite
def mutated(draw: st.DrawFn, seeds: list[bytes]) -> bytes:
    data = bytearray(draw(st.sampled_from(seeds)))
    for _ in range(draw(st.integers(0, 8))):
        kind = draw(st.sampled_from(["flip", "cut", "insert", "splice", "repeat", "int"]))
        at = draw(st.integers(0, max(0, len(data))))
        if kind == "flip" and data:
            data[min(at, len(data) - 1)] ^= 1 << draw(st.integers(0, 7))
        elif kind == "cut":
            data = data[:at]
        elif kind == "insert":
            data[at:at] = draw(st.binary(max_size=16))
        elif kind == "splice":
            other = draw(st.sampled_from(seeds))
            start = draw(st.integers(0, len(other)))
            data[at:at] = other[start : start + draw(st.integers(0, 64))]
        elif kind == "repeat" and data:
            piece = data[at : at + draw(st.integers(1, 32))]
            data[at:at] = piece * draw(st.integers(1, 64))
        elif kind == "int":  # a number where a size or an index may sit
            number = draw(st.sampled_from([0, 1, 255, 1 << 16, 1 << 28, 1 << 31, (1 << 32) - 1, 1 << 62]))
            data[at : at + 4] = (number & 0xFFFFFFFF).to_bytes(4, "little")
    return bytes(data)


def _outcome(target: Callable[[bytes, Path], Any], data: bytes, work: Path, seconds: float) -> tuple[str, str]:
    """('ok', result) or ('error', its class) for what the rule allows; raises for anything else."""
    for old in work.iterdir():
        if old.is_file():
            old.unlink()
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        return "ok", repr(target(data, work))[:4000]
    except TailorError as exc:
        return "error", type(exc).__name__
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


def fuzz_target(name: str, seeds: list[bytes], examples: int, seconds: float, crashes: Path, seed: int) -> list[str]:
    """Run one target; returns what broke the rule, one line each."""
    target = TARGETS[name]
    broken: list[str] = []
    with tempfile.TemporaryDirectory(prefix=f"tailor-fuzz-{name}-") as scratch:
        work = Path(scratch)
        pristine = [_outcome(target, s, work, seconds) for s in seeds]
        count = [0]

        def check_state() -> None:
            now = [_outcome(target, s, work, seconds) for s in seeds]
            if now != pristine:
                broken.append(f"{name}: a seed reads differently after the inputs so far: {now} != {pristine}")
                raise AssertionError(broken[-1])

        @settings(
            max_examples=examples,
            deadline=None,
            database=None,
            derandomize=False,
            suppress_health_check=list(HealthCheck),
            print_blob=False,
        )
        @given(st.one_of(mutated(seeds), st.binary(max_size=512)))
        def one(data: bytes) -> None:
            try:
                _outcome(target, data, work, seconds)
            except (Hang, MemoryError, RecursionError, Exception) as exc:
                digest = hashlib.sha1(data).hexdigest()[:12]
                crashes.mkdir(parents=True, exist_ok=True)
                (crashes / f"{name}-{digest}.bin").write_bytes(data)
                line = f"{name}: {type(exc).__name__}: {str(exc)[:200]} (input {crashes / f'{name}-{digest}.bin'})"
                if line not in broken:
                    broken.append(line)
                raise
            count[0] += 1
            if count[0] % 25 == 0:
                check_state()

        from hypothesis import seed as hypothesis_seed

        try:
            hypothesis_seed(seed)(one)()
        except Exception:
            pass  # recorded in ``broken``; Hypothesis shrank it first
        if not broken:
            check_state()
    return broken


def _capped(memory_mb: int, target: str | None = None) -> None:
    """The address-space cap for ``target``'s inputs (its own, where :data:`MEMORY_MB` names one),
    as a soft limit, so the next target's cap can differ; then what the target imports, before
    any input's time cap runs."""
    cap = max(memory_mb, MEMORY_MB.get(target or "", 0)) << 20
    resource.setrlimit(resource.RLIMIT_AS, (cap, resource.getrlimit(resource.RLIMIT_AS)[1]))
    signal.signal(signal.SIGALRM, _alarm)
    if target in IMPORTS:
        importlib.import_module(IMPORTS[target])
    logging.getLogger("tailorstore").setLevel(logging.ERROR)  # a reader's warnings are allowed output


def replay(inputs: list[Path], memory_mb: int, seconds: float) -> int:
    """Each saved input once, under the same caps (a crash found is a test: tests/system/test_fuzz.py)."""
    datas = [(p.name.rsplit("-", 1)[0], p.read_bytes(), p) for p in inputs]
    failed = 0
    with tempfile.TemporaryDirectory(prefix="tailor-fuzz-replay-") as scratch:
        for name, data, path in datas:
            _capped(memory_mb, name)
            try:
                kind, what = _outcome(TARGETS[name], data, Path(scratch), seconds)
            except BaseException as exc:  # any other exception breaks the rule
                failed += 1
                print(f"{path}: {type(exc).__name__}: {str(exc)[:200]}")
                continue
            print(f"{path}: {kind} {what[:80]}")
    return 1 if failed else 0


def make_seeds(folder: Path) -> None:
    subprocess.run([sys.executable, "-m", "testbed.fuzz_seeds", str(folder)], check=True, timeout=600)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--targets", default=",".join(TARGETS), help="comma-separated, of: " + ", ".join(TARGETS))
    parser.add_argument("--examples", type=int, default=2000, help="inputs per target")
    parser.add_argument("--memory-mb", type=int, default=512, help="address-space cap of this process")
    parser.add_argument("--seconds", type=float, default=2.0, help="time cap of one input")
    parser.add_argument("--seed", type=int, default=20261127, help="Hypothesis's seed: the same inputs again")
    parser.add_argument("--seeds", type=Path, default=None, help="a folder testbed.fuzz_seeds made (default: made now)")
    parser.add_argument("--crashes", type=Path, default=Path(".bench/fuzz-crashes"))
    parser.add_argument("--replay", type=Path, nargs="*", default=[], help="inputs named TARGET-*.bin: each once")
    args = parser.parse_args(argv)
    if args.replay:
        return replay(args.replay, args.memory_mb, args.seconds)
    # the targets that import torch last: once imported, its mappings count against every later cap
    names = sorted((n for n in args.targets.split(",") if n), key=lambda n: n in MEMORY_MB)
    unknown = [n for n in names if n not in TARGETS]
    if unknown:
        parser.error(f"unknown targets {unknown}")
    with tempfile.TemporaryDirectory(prefix="tailor-fuzz-seeds-") as made:
        folder = args.seeds or Path(made)
        if args.seeds is None:
            make_seeds(folder)
        seeds = {n: [p.read_bytes() for p in sorted((folder / n).glob("*.bin"))] for n in names}
        broken: list[str] = []
        for name in names:
            _capped(args.memory_mb, name)
            began = time.perf_counter()
            found = fuzz_target(name, seeds[name], args.examples, args.seconds, args.crashes, args.seed)
            print(f"{name}: {args.examples} inputs, {time.perf_counter() - began:.1f} s, {len(found)} broke the rule")
            broken += found
    for line in broken:
        print(line)
    if broken:
        print(f"replay: python -m benchmarks.fuzz --targets {','.join(sorted({b.split(':')[0] for b in broken}))} "
              f"--examples {args.examples} --seed {args.seed}")  # fmt: skip
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
