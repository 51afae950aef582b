"""Faults on a multi-server SeaweedFS (one master, three volume servers, a filer and the S3 gateway,
each a process of its own), under real `tailor` commands, each checked afterwards.

Each :class:`Fault` runs one operation (commit, checkout, finalize, gc) through a relay
(testbed/s3_relay.py) in front of the gateway, and strikes when the relay sees a chosen request of
it: a volume server or the gateway SIGKILLed and started again a few seconds later, a request
reset, dropped, truncated or delayed, or a volume server whose disk is full. Then:

- the operation completed (exit 0) or failed with one line and no traceback (exit 5 for the
  backend), and never said 0 with a missing or mixed step;
- a host with a fresh cache finds a store that passes ``verify --deep``, holding every step
  recorded before the fault bit for bit, and the new step whole or not at all;
- the same operation succeeds once the server is back.

``python -m benchmarks.seaweed_faults`` runs them all and prints the table of docs/benchmarks.md;
tests/system/test_seaweed_faults.py runs a few.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from testbed.compare import same_tree
from testbed.s3_relay import Relay, Rule
from testbed.seaweed_s3 import SeaweedS3

CLI = [sys.executable, "-m", "tailorstore.cli.app"]
DEEPSPEED_SAVE = Path(__file__).resolve().parent.parent / "tests" / "data" / "format1" / "checkpoint"
DOWN = 4.0  # seconds a killed server stays down before it is started again
RECOVERY = 600.0  # seconds the cluster may take to take writes again once the server is back


@dataclass
class Fault:
    name: str  # what is done: "volume server killed", ...
    operation: str  # commit, checkout, finalize, gc
    trigger: str  # a regular expression of the request ("METHOD /path?query") it strikes at
    strike: str  # kill-volume, kill-gateway, reset, drop, truncate, delay, disk-full

    def rule(self) -> Rule | None:
        """The relay's rule, for a fault the relay does: once, at the first request of ``trigger``."""
        if self.strike not in ("reset", "drop", "truncate", "delay"):
            return None
        method, _, target = self.trigger.lstrip("^").partition(" ")
        return Rule(self.strike, method=method, target=target, times=1, seconds=5.0)


@dataclass
class Outcome:
    fault: Fault
    code: int
    said: str
    seconds: float
    struck: bool
    problems: list[str]
    retried: int | None
    recovered: float | None  # seconds from the restart until the cluster took a write again


FAULTS = [
    Fault("volume server killed, started again", "commit", r"^PUT .*/blobs/", "kill-volume"),
    Fault("volume server killed, started again", "checkout", r"^GET .*/(blobs|packs)/", "kill-volume"),
    Fault("volume server killed, started again", "finalize", r"^GET .*list-type=2.*parts", "kill-volume"),
    Fault("volume server killed, started again", "gc", r"^POST .*\?delete", "kill-volume"),
    Fault("S3 gateway killed, started again", "commit", r"^PUT .*/blobs/", "kill-gateway"),
    Fault("S3 gateway killed, started again", "checkout", r"^GET .*/(blobs|packs)/", "kill-gateway"),
    Fault("relay resets a blob PUT", "commit", r"^PUT /blobs/", "reset"),
    Fault("relay drops the manifest PUT", "commit", r"^PUT /manifests/main/step-", "drop"),
    Fault("relay truncates a blob GET", "checkout", r"^GET /(blobs|packs)/", "truncate"),
    Fault("relay delays a blob GET 5 s", "checkout", r"^GET /(blobs|packs)/", "delay"),
    Fault("relay resets the DeleteObjects", "gc", r"^POST \?delete", "reset"),
    Fault("relay resets a pack GET", "checkout", r"^GET /packs/", "reset"),
    Fault("a volume server's disk full", "commit", r"^PUT .*/blobs/", "disk-full"),
]


class Bench:
    """A cluster, a store on it with one step, and fresh saves to commit."""

    def __init__(self, work: Path) -> None:
        self.work = work
        self.cluster = SeaweedS3(work / "cluster", cluster=True).start()
        self.location = self.cluster.new_location()
        self.saves: dict[int, Path] = {}  # step -> the folder committed as it
        self.dropped: set[int] = set()  # steps removed (rm), whose data a gc may take
        self.recovered: float | None = None  # the last fault's recovery (seconds), when it had one
        # one relay for every fault (its rules change): one endpoint, so its conditional-write probe
        # (store/backends/conditional.py) is made once, here, not struck by a fault meant for an operation
        self._n = 0
        assert self.tailor("init", self.location).returncode == 0
        self.commit_new(1, check=True)
        self.relay = Relay(self.cluster.port)
        probed = self.tailor("gc", "--dry-run", "--store", self.location, env=self.env(self.relay.endpoint))
        assert probed.returncode == 0, probed.stderr

    def env(self, endpoint: str | None = None, cache: Path | None = None) -> dict[str, str]:
        env = {**os.environ, **self.cluster.environ()}
        if endpoint:
            env["AWS_ENDPOINT_URL"] = endpoint
        env["TAILOR_CACHE"] = str(cache or self.work / "cache-main")
        env.pop("TAILOR_STORE", None)
        return env

    def tailor(
        self, *args: str, env: dict[str, str] | None = None, timeout: float = 900
    ) -> subprocess.CompletedProcess[str]:
        """`tailor ARGS` as a host (the relay's endpoint in ``env``, or the gateway's)."""
        return subprocess.run([*CLI, *args], env=env or self.env(), capture_output=True, text=True, timeout=timeout)

    def new_save(self, step: int) -> Path:
        """A folder of three 12 MiB tensors of fresh random values: new blobs for every commit."""
        import torch

        self._n += 1
        folder = self.work / f"save-{self._n}"
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        g = torch.Generator().manual_seed(1000 + self._n)
        torch.save({f"w{i}": torch.randn(3 << 20, generator=g) for i in range(3)}, folder / "model.pt")
        return folder

    def commit_new(self, step: int, check: bool = False) -> subprocess.CompletedProcess:
        save = self.new_save(step)
        done = self.tailor("commit", str(save), "--step", str(step), "--store", self.location, "--quiet")
        if done.returncode == 0:
            self.saves[step] = save
        if check:
            assert done.returncode == 0, done.stderr
        return done

    def steps(self, env: dict[str, str]) -> list[int]:
        import json

        done = self.tailor("log", "--json", "--store", self.location, env=env)
        assert done.returncode == 0, done.stderr
        return sorted(s["step"] for s in json.loads(done.stdout))

    def check(self, tag: str) -> list[str]:
        """What a fresh host finds wrong with the store: verify --deep, and every recorded step
        (each must be one this bench committed) checked out bit for bit."""
        env = self.env(cache=self.work / f"fresh-{tag}-{time.monotonic_ns()}")
        problems = []
        verified = self.tailor("verify", "--deep", "--store", self.location, env=env)
        if verified.returncode != 0:
            problems.append(f"verify --deep: {verified.returncode} {verified.stdout[-300:]} {verified.stderr[-300:]}")
        for step in self.steps(env):
            if step not in self.saves:
                problems.append(f"step {step} is recorded, but its commit failed")
                continue
            out = self.work / f"check-{tag}-{step}"
            shutil.rmtree(out, ignore_errors=True)
            done = self.tailor("checkout", f"step={step}", "--out", str(out), "--store", self.location, env=env)
            save = self.saves[step]
            mine = save / "global_step3" if save == DEEPSPEED_SAVE else save
            if done.returncode != 0 or not same_tree(out / mine.name, mine):
                problems.append(f"step {step} does not check out bit for bit: {done.stderr[-200:]}")
            shutil.rmtree(out, ignore_errors=True)
        missing = set(self.saves) - set(self.steps(env))
        problems += [f"step {s} was recorded before and is gone" for s in sorted(missing - self.dropped)]
        return problems

    def stop(self) -> None:
        self.relay.close()
        self.cluster.stop()


def _strike(bench: Bench, relay: Relay, fault: Fault, struck: threading.Event, stop: threading.Event) -> None:
    """Wait for the fault's request, then strike (a relay fault is a rule installed beforehand)."""
    seen = 0
    while not stop.is_set():
        requests = relay.requests[seen:]
        seen += len(requests)
        if any(re.search(fault.trigger, f"{m} {t}") for m, t in requests):
            break
        time.sleep(0.01)
    else:
        return
    if fault.strike == "kill-volume":
        victim = _busiest_volume(bench)
        bench.cluster.kill(victim)
        struck.set()
        time.sleep(DOWN)
        began = time.monotonic()
        bench.cluster.revive(victim, limit=RECOVERY)
        bench.recovered = time.monotonic() - began
    elif fault.strike == "kill-gateway":  # behind the relay, as behind a load balancer
        bench.cluster.kill("s3")
        struck.set()
        time.sleep(DOWN)
        began = time.monotonic()
        bench.cluster.revive("s3", new_port=True, limit=RECOVERY)
        bench.recovered = time.monotonic() - began
        relay.retarget(bench.cluster.port)


def _busiest_volume(bench: Bench) -> str:
    """The volume server holding the most data: the one a kill hurts."""
    sizes = {
        name: sum(f.stat().st_size for f in (bench.cluster.root / name).rglob("*.dat"))
        for name in bench.cluster.procs
        if name.startswith("volume")
    }
    return max(sizes, key=lambda n: sizes[n])


def run_fault(bench: Bench, fault: Fault, step: int) -> Outcome:
    """Set the operation up, run it through a relay with the fault, check the store, retry."""
    args, save = _operation(bench, fault.operation, step)
    bench.recovered = None
    relay = bench.relay
    relay.rules.clear()
    del relay.requests[:]
    rule = fault.rule()
    if rule is not None:
        relay.add(rule)
    if fault.strike == "disk-full":
        _fill_disks(bench)
    struck, stop = threading.Event(), threading.Event()
    striker = threading.Thread(target=_strike, args=(bench, relay, fault, struck, stop), daemon=True)
    striker.start()
    began = time.monotonic()
    done = bench.tailor(*args, env=bench.env(relay.endpoint))
    seconds = time.monotonic() - began
    stop.set()
    striker.join(timeout=RECOVERY + 60)
    relay.rules.clear()
    if fault.strike == "disk-full":
        _free_disks(bench)
    hit = struck.is_set() or bool(rule and rule.hits) or fault.strike == "disk-full"
    problems = []
    lines = done.stderr.strip().splitlines()
    if done.returncode != 0 and ("Traceback" in done.stderr or len(lines) != 1):
        problems.append(f"not one line: {done.stderr[-400:]}")
    if done.returncode == 0 and save is not None:
        bench.saves[step] = save
    problems += bench.check(f"{fault.operation}-{step}")
    retried = None
    if done.returncode != 0:
        again = bench.tailor(*args)
        retried = again.returncode
        if again.returncode != 0 and not (fault.operation == "commit" and "already" in again.stderr):
            problems.append(f"the retry failed too: {again.stderr[-300:]}")
        elif save is not None:
            bench.saves[step] = save
        problems += bench.check(f"{fault.operation}-{step}-retry")
    said = lines[-1][:150] if done.returncode != 0 and lines else ""
    return Outcome(fault, done.returncode, said, seconds, hit, problems, retried, bench.recovered)


def _operation(bench: Bench, operation: str, step: int) -> tuple[list[str], Path | None]:
    """The command line of the operation, and the save it records as ``step`` (None: no new step)."""
    loc = ["--store", bench.location]
    if operation == "commit":
        save = bench.new_save(step)
        return ["commit", str(save), "--step", str(step), *loc, "--quiet"], save
    if operation == "checkout":
        out = bench.work / f"out-{step}"
        shutil.rmtree(out, ignore_errors=True)
        return ["checkout", f"step={max(set(bench.saves) - bench.dropped)}", "--out", str(out), *loc], None
    if operation == "finalize":  # a DeepSpeed save's one part (a part is of a DeepSpeed or DCP layout)
        save = DEEPSPEED_SAVE
        done = bench.tailor("commit", str(save), "--part", "--step", str(step), *loc, "--quiet")
        assert done.returncode == 0, done.stderr
        return ["finalize", f"step={step}", "--force", *loc], save  # --force: another model than the others
    if operation == "gc":
        bench.commit_new(step, check=True)
        assert bench.tailor("rm", f"step={step}", *loc).returncode == 0
        bench.dropped.add(step)
        return ["gc", *loc], None
    raise ValueError(operation)


def _fill_disks(bench: Bench) -> None:
    """Every volume server restarted with a free-space floor above what its disk holds: SeaweedFS
    then takes no write there, as on a full disk."""
    for name in [n for n in bench.cluster.procs if n.startswith("volume")]:
        bench.cluster.kill(name, signal.SIGTERM)
        bench.cluster._argv[name] = [*bench.cluster._argv[name], "-minFreeSpace=1000TiB"]
        bench.cluster._spawn(name)
    time.sleep(8)  # the master hears of them (heartbeats)


def _free_disks(bench: Bench) -> None:
    for name in [n for n in bench.cluster.procs if n.startswith("volume")]:
        bench.cluster.kill(name, signal.SIGTERM)
        bench.cluster._argv[name] = [a for a in bench.cluster._argv[name] if not a.startswith("-minFreeSpace")]
        bench.cluster._spawn(name)
    bench.cluster._wait_ready()
