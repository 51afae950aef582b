"""A seeded multi-host simulation: three hosts on one store, stalled and killed before any request.

After FoundationDB's and TigerBeetle's simulation testing, with real parts: every host operation is
a real ``tailor`` command in its own process with its own cache (testbed/sim_host.py forks them),
the store is a real directory or a real S3 server (moto), and the inputs are real DeepSpeed saves.

One **schedule** (a seed) is a list of operations by hosts ``a``, ``b`` and ``c``:

- commits of the same and of different steps (``--force``, ``--tag``, ``--metric``, a branch's run);
- tag, untag, pin, unpin and rm;
- gc with retention, keep-best, thinning and ``--drop-parts``;
- parts of step 3 from two tries of the save, and finalize;
- a branch (``run create``), which later commits go to;
- in targeted themes (``--theme``): revisions (``metric``, ``--force``) stalled at their put, gc
  stalled between its plan and its deletions, and merges and averages beside the writers of their
  sources, with saves through the DCP writer (``dcp.save``, testbed/sim_dcp.py) in a run of their own.

Any operation may carry a **fault**: the host stops (SIGSTOP) or dies (SIGKILL) at its n-th request
of some kind. A stopped host stays stopped while the next one to three operations run, sometimes
for longer than its lease (so others find its lease stale and go on), then resumes. Operations run
one at a time otherwise, so a seed replays the same interleaving (up to lease timing).

After the schedule a fresh host (a new cache) checks the invariants of docs/FORMAT.md section 8.1
against the journal of what each operation reported (testbed/sim_model.py): ``verify --deep``, a
byte comparison of every step with the inputs that could be its last, tags and pins. A failing
seed prints the command that replays it.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import select
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from testbed.sim_dcp import RUN as DCP_RUN
from testbed.sim_dcp import STATES as DCP_STATES
from testbed.sim_dcp import metadata_digest as dcp_metadata_digest
from testbed.sim_dcp import save_raw
from testbed.sim_model import Done, Key, Seen, check

HOSTS = ("a", "b", "c")
WHOLE = ("A3", "A6", "B3", "B6")  # saves committed whole: run A or its second try B, as of step 3 or 6
PARTS = ("A3p0", "A3p1", "B3p0", "B3p1")  # step 3 split by host, of both tries
STEPS = (6, 9)  # steps whole saves are committed as in run main; step 3 is only ever made from parts
DCP_STEPS = (6, 9)  # steps the DCP writer saves, in its own run (testbed/sim_dcp.py)
# The branch "br" starts at main's step 6 (or nowhere, when that is missing) and its steps come after
# it: a selector br:step=N for N at or before the base names main's step (a branch reads its base's
# history), which the checker would have to resolve as the code does.
BRANCH_BASE = 6
BRANCH_STEPS = (9, 12)
TAGS = ("t1", "t2")
TTL = 2.0  # seconds: lease time of every host on S3, so that a stall of a few seconds outlives it
LONG_HOLD = TTL + 2.5  # a stall that outlives a lease (stale after TTL + 1 s, in whole seconds)
# Every wait of a host is bounded by a stated timeout: its lock and the index behind it by
# --lock-timeout (10 s on S3, 1 s on POSIX), a new connection's first wait by 2 s, one S3 request by
# REQUEST_SECONDS and its retries by RETRY_SECONDS (instead of 30 s and 180 s: one request that
# retried as long as an S3 client may was past OP_LIMIT alone, under load). An operation or a check
# that runs past OP_LIMIT is a finding of its own ("exceeded its bound"), never an invariant broken.
REQUEST_SECONDS, RETRY_SECONDS = 10, 30
OP_LIMIT = 120.0
KILL_WAIT = 60.0  # how long a command killed at OP_LIMIT is given to end before the schedule goes on
OPTIM = "bf16_zero_pp_rank_{}_mp_rank_00_optim_states.pt"
MERGE_SPECS = {  # the merges of the "merges" theme, over main's steps 6 and 9 (STEPS)
    "composite": "base: {step: 9}\nslices:\n  - sources: [{step: 6, layer_range: [0, 1]}]\n",
    "sma": "method: sma\nsteps: [6, 9]\n",
    "ema": "method: ema\nsteps: [6, 9]\nalpha: 0.5\n",
}


@dataclass
class Inputs:
    """The saves a schedule commits, each a folder, and what each checks out as (file digests)."""

    root: Path
    folders: dict[str, Path] = field(default_factory=dict)
    digests: dict[str, dict[str, str]] = field(default_factory=dict)

    def contents(self) -> dict[str, set[str]]:
        """Input name -> the names of whole saves a step made from it may check out as."""
        out = {name: {name} for name in (*WHOLE, *DCP_STATES)}
        out["parts"] = {"A3", "B3"}  # a finalize takes one try's parts, whole
        return out


def tree_digest(folder: Path) -> dict[str, str]:
    """Each file's SHA-256; a DCP ``.metadata`` by what it says (testbed/sim_dcp.py: the save id
    and folder DCP records differ from one save to the next, and a checkout records neither)."""
    return {
        str(p.relative_to(folder)): dcp_metadata_digest(p) if p.name == ".metadata" else file_digest(p)
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def file_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _as_of_step(save: Path, step: int, dst: Path) -> Path:
    shutil.copytree(save, dst)
    for tag in dst.glob("global_step*"):
        if tag.name != f"global_step{step}":
            shutil.rmtree(tag)
    (dst / "latest").write_text(f"global_step{step}")
    for path in dst.rglob("*"):
        if path.is_file():
            path.chmod(0o444)
    return dst


def prepare_inputs(save_a: Path, save_b: Path, root: Path) -> Inputs:
    """Folders of two tries (``A`` and ``B``: the same training with another seed) of a 2-rank ZeRO-2
    save: each as of steps 3 and 6, and step 3 split as two hosts hold it (host 0: rank 0's files;
    host 1: rank 1's optimizer states and the model states, as node-local storage writes them)."""
    inputs = Inputs(root)
    if root.exists():
        shutil.rmtree(root)
    root.mkdir(parents=True)
    for name, save in (("A", save_a), ("B", save_b)):
        for step in (3, 6):
            inputs.folders[f"{name}{step}"] = _as_of_step(save, step, root / f"{name}{step}")
        whole = inputs.folders[f"{name}3"] / "global_step3"
        host0 = root / f"{name}3p0"
        shutil.copytree(inputs.folders[f"{name}3"], host0)
        (host0 / "global_step3" / OPTIM.format(1)).chmod(0o644)
        (host0 / "global_step3" / OPTIM.format(1)).unlink()
        host1 = root / f"{name}3p1" / "global_step3"
        host1.mkdir(parents=True)
        for file in (OPTIM.format(1), "mp_rank_00_model_states.pt"):
            shutil.copy2(whole / file, host1 / file)
        inputs.folders[f"{name}3p0"], inputs.folders[f"{name}3p1"] = host0, host1
    for name in DCP_STATES:  # what the DCP writer's saves check out as: DCP's own folder of each
        inputs.folders[name] = root / f"dcp-{name}"
        save_raw(name, inputs.folders[name])
    for name in (*WHOLE, *DCP_STATES):
        inputs.digests[name] = tree_digest(inputs.folders[name])
    return inputs


# ---- schedules -------------------------------------------------------------------------------------


def _fault(rng: random.Random, backend: str) -> dict[str, Any] | None:
    if rng.random() > 0.45:
        return None
    action = "stop" if rng.random() < 0.75 else "kill"
    fault: dict[str, Any] = {"action": action, "hold": LONG_HOLD if backend == "s3" and rng.random() < 0.5 else 0.0}
    fault["after"] = rng.randint(1, 3)  # operations that run while it is stopped
    if backend == "posix" and rng.random() < 0.35:  # a named point, which older trees know too
        fault.update(where="point", point=rng.choice(("before-publish", "gc-before-delete", "before-part-publish")))
        return fault
    # the requests where the protocol's moments are (a publication's put, gc's deletions) come up more often
    kind = rng.choice(
        ("*", "*", "put", "put-create", "put-create", "get", "list", "delete", "delete-many", "delete-many", "head")
    )
    fault.update(where="request", kind=kind)
    fault["nth"] = (
        rng.randint(1, 25) if kind == "*" else rng.randint(1, 8) if kind in ("put", "get") else rng.randint(1, 2)
    )
    return fault


def _key(rng: random.Random, branch: bool = True) -> list[Any]:
    run = "br" if branch and rng.random() < 0.2 else "main"
    return [run, rng.choice((3, *STEPS)) if run == "main" else rng.choice(BRANCH_STEPS)]


# Each schedule draws a theme, as FoundationDB draws workloads: weights of each operation, so that
# the interleavings that matter come up often (a replacement racing refs; refs racing a planned gc;
# parts of two tries), while "mixed" keeps everything possible.
THEMES: dict[str, dict[str, float]] = {
    "mixed": {
        "commit": 28,
        "part": 10,
        "finalize": 7,
        "tag": 7,
        "untag": 3,
        "pin": 8,
        "unpin": 3,
        "rm": 5,
        "gc": 25,
        "branch": 4,
    },
    "replace": {"commit": 45, "tag": 10, "untag": 2, "pin": 15, "unpin": 2, "rm": 4, "gc": 20, "branch": 2},
    "refs-vs-gc": {"commit": 25, "tag": 14, "untag": 4, "pin": 20, "unpin": 5, "rm": 2, "gc": 30},
    "parts": {"commit": 15, "part": 35, "finalize": 20, "tag": 4, "pin": 6, "rm": 2, "gc": 18},
}
GC_RULES = (
    [],
    [],
    ["--keep-last", "1"],
    ["--keep-last", "2"],
    ["--keep-every", "6"],
    ["--keep-best", "loss:min:1"],
    ["--keep-last", "1", "--thin", "weights"],
    ["--drop-parts"],
)


def _operation(rng: random.Random, kind: str, theme: str) -> dict[str, Any]:
    if kind == "commit":
        run, step = _key(rng)
        replacing = 0.6 if theme == "replace" else 0.3
        return {
            "op": "commit",
            "save": rng.choice(WHOLE),
            "key": [run, step if step != 3 else 9],
            "force": rng.random() < replacing,
            "tag": rng.choice(TAGS) if rng.random() < (0.4 if theme == "replace" else 0.2) else None,
            "metric": round(rng.uniform(1, 3), 3) if rng.random() < 0.5 else None,
        }
    if kind == "part":
        return {"op": "part", "part": rng.choice(PARTS)}
    if kind == "finalize":
        return {"op": "finalize", "key": ["main", 3], "save": "parts"}
    if kind == "tag":
        return {"op": "tag", "tag": rng.choice(TAGS), "key": _key(rng), "force": rng.random() < 0.5}
    if kind == "untag":
        return {"op": "untag", "tag": rng.choice(TAGS)}
    if kind in ("pin", "unpin"):
        return {"op": kind, "key": _key(rng)}
    if kind == "rm":
        return {"op": "rm", "key": _key(rng), "force": rng.random() < 0.3}
    if kind == "gc":
        rules = rng.choice(GC_RULES[2:6] if theme == "refs-vs-gc" else GC_RULES)
        drops = any(r.startswith("--keep") for r in rules) and "--thin" not in rules
        return {"op": "gc", "args": rules, "drops": drops, "thins": "--thin" in rules}
    return {"op": "branch", "from": BRANCH_BASE}


# Themes a run names (``--theme``), never drawn: each aims at one interleaving, so adding one leaves
# the drawn seeds' schedules (and the regression seeds) as they were.
TARGETED = ("pins-vs-gc", "revisions", "merges", "tag-drops")
MERGE_TAGS = ("m1", "m2")  # names only merges take, so the step tags' rules need not know them


def _pins_vs_gc(rng: random.Random, backend: str) -> list[dict[str, Any]]:
    """The interleaving I2 is kept against (refs against gc's drops): a gc that drops steps is
    stopped between its plan and its deletions, and meanwhile other hosts pin or tag the steps it
    drops; then anything."""
    ops: list[dict[str, Any]] = []
    for step in (6, 9):
        save = rng.choice(WHOLE)
        ops.append({"op": "commit", "save": save, "key": ["main", step], "force": False, "tag": None, "metric": None})
    fault: dict[str, Any] = {"action": "stop", "after": rng.randint(1, 3)}
    fault["hold"] = LONG_HOLD if backend == "s3" and rng.random() < 0.7 else 0.0
    if backend == "posix" and rng.random() < 0.5:
        fault.update(where="point", point="gc-before-delete")
    else:
        fault.update(where="request", kind=rng.choice(("delete-many", "delete-many", "delete", "put-create", "get")))
        fault["nth"] = rng.randint(1, 2)
    rules = rng.choice((["--keep-last", "1"], ["--keep-last", "1"], ["--keep-every", "9"]))
    ops.append({"op": "gc", "args": rules, "drops": True, "thins": False, "fault": fault, "host": "a"})
    for _ in range(fault["after"]):
        if rng.random() < 0.7:
            ops.append({"op": "pin", "key": ["main", 6], "host": rng.choice(("b", "c"))})
        else:
            tag = rng.choice(TAGS)
            ops.append({"op": "tag", "tag": tag, "key": ["main", 6], "force": True, "host": rng.choice(("b", "c"))})
    return _then_anything(rng, backend, ops, "refs-vs-gc", rng.randint(1, 3), "pins-vs-gc")


def _revisions(rng: random.Random, backend: str) -> list[dict[str, Any]]:
    """The interleaving I7 is kept against: a revision (``metric``, ``commit --force``) of a tagged,
    pinned step is stopped before (or at) its put, and meanwhile other hosts move its tag away,
    unpin it, remove it or revise it too; then anything."""
    ops: list[dict[str, Any]] = []
    for step in (6, 9):
        save = rng.choice(WHOLE)
        ops.append({"op": "commit", "save": save, "key": ["main", step], "force": False, "tag": None, "metric": None})
    target = ["main", rng.choice(STEPS)]
    ops.append({"op": "tag", "tag": "t1", "key": target, "force": False})
    ops.append({"op": "pin", "key": target})
    fault: dict[str, Any] = {"action": "stop" if rng.random() < 0.85 else "kill", "after": rng.randint(1, 3)}
    fault["hold"] = LONG_HOLD if backend == "s3" and rng.random() < 0.3 else 0.0
    if backend == "posix" or rng.random() < 0.5:
        fault.update(where="point", point=rng.choice(("before-publish", "after-publish")))
    else:
        fault.update(where="request", kind=rng.choice(("put-create", "list", "get", "delete-many", "put")))
        fault["nth"] = rng.randint(1, 3)
    if rng.random() < 0.5:
        ops.append({"op": "metric", "key": target, "value": round(rng.uniform(1, 3), 3), "fault": fault, "host": "a"})
    else:
        ops.append(
            {"op": "commit", "save": rng.choice(WHOLE), "key": target, "force": True, "tag": None, "metric": None,
             "fault": fault, "host": "a"}
        )  # fmt: skip
    others = ("b", "c")
    for _ in range(fault["after"]):
        kind = rng.choice(("tag", "unpin", "rm", "rm", "metric", "untag", "pin"))
        if kind == "tag":
            other = ["main", 6 if target[1] == 9 else 9]
            ops.append({"op": "tag", "tag": "t1", "key": other, "force": True, "host": rng.choice(others)})
        elif kind == "untag":
            ops.append({"op": "untag", "tag": "t1", "host": rng.choice(others)})
        elif kind == "rm":
            ops.append({"op": "rm", "key": target, "force": True, "host": rng.choice(others)})
        elif kind == "metric":
            ops.append({"op": "metric", "key": target, "value": 0.5, "host": rng.choice(others)})
        else:
            ops.append({"op": kind, "key": target, "host": rng.choice(others)})
    return _then_anything(rng, backend, ops, "replace", rng.randint(0, 2), "revisions")


def _tag_drops(rng: random.Random, backend: str) -> list[dict[str, Any]]:
    """The interleaving I2 across hosts is kept against: host a drops step 6's tag t1 (an untag, a
    forced rm; or sets a second tag t2 on the step, which dropped t1 while a step held one tag and
    touches no other tag now) and is stopped at a request after it read where t1 was, while other
    hosts move t1 to step 9 (``tag --force``, reported done), untag it, or set it on step 6 again;
    then a gc that drops every step nothing protects, then anything. A drop that deleted t1 by name
    undid the move, and the gc dropped step 9 (FORMAT.md 3.3: a tag is dropped only while it still
    names the step)."""
    ops: list[dict[str, Any]] = []
    for step in (6, 9):
        save = rng.choice(WHOLE)
        ops.append({"op": "commit", "save": save, "key": ["main", step], "force": False, "tag": None, "metric": None})
    ops.append({"op": "tag", "tag": "t1", "key": ["main", 6], "force": False})
    fault: dict[str, Any] = {"action": "stop" if rng.random() < 0.85 else "kill", "after": rng.randint(1, 2)}
    fault["hold"] = LONG_HOLD if backend == "s3" and rng.random() < 0.3 else 0.0
    # the drop's own requests: put-if, its conditional replace, after the get that read where the tag
    # was (an older tree never sends one: its drop is a delete-many, after the retag's put)
    kind = rng.choice(("put", "put-if", "put-if", "get", "delete-many", "delete-many", "put-create", "*"))
    nth = rng.randint(1, 8) if kind == "*" else 1 if rng.random() < 0.75 else 2
    fault.update(where="request", kind=kind, nth=nth)
    drop = rng.choice(("retag", "untag", "rm"))
    if drop == "retag":
        ops.append({"op": "tag", "tag": "t2", "key": ["main", 6], "force": False, "fault": fault, "host": "a"})
    elif drop == "untag":
        ops.append({"op": "untag", "tag": "t1", "fault": fault, "host": "a"})
    else:
        ops.append({"op": "rm", "key": ["main", 6], "force": True, "fault": fault, "host": "a"})
    for _ in range(fault["after"]):
        other = rng.choice(("move", "move", "move", "untag", "back"))
        host = rng.choice(("b", "c"))
        if other == "untag":
            ops.append({"op": "untag", "tag": "t1", "host": host})
        else:
            ops.append({"op": "tag", "tag": "t1", "key": ["main", 9 if other == "move" else 6], "force": True,
                        "host": host})  # fmt: skip
    ops.append({"op": "gc", "args": ["--keep-last", "1"], "drops": True, "thins": False, "host": rng.choice(HOSTS)})
    return _then_anything(rng, backend, ops, "refs-vs-gc", rng.randint(0, 1), "tag-drops")


def _merges(rng: random.Random, backend: str) -> list[dict[str, Any]]:
    """Merges and averages beside the writers of their sources: a composite (step 9's layers, its
    first block from step 6) or an average of steps 6 and 9, sometimes stopped or killed at a
    request, while other hosts (each maybe faulted too) replace a source (``--force``), remove it,
    run a gc that drops or thins it, or save through the DCP writer (run ``dcp``); then anything.
    A merge reported done must check out, hash-checked, as the manifest it reported, whatever
    became of its sources (FORMAT 8.1, I6: gc keeps what a kept manifest names)."""
    ops: list[dict[str, Any]] = []
    for step in STEPS:
        save = rng.choice(WHOLE)
        ops.append({"op": "commit", "save": save, "key": ["main", step], "force": False, "tag": None, "metric": None})
    for tag in MERGE_TAGS[: rng.randint(1, 2)]:
        merge: dict[str, Any] = {"op": "merge", "tag": tag, "method": rng.choice(("composite", "sma", "ema"))}
        if rng.random() < 0.6:
            fault: dict[str, Any] = {"action": "stop" if rng.random() < 0.8 else "kill", "after": rng.randint(1, 3)}
            fault["hold"] = LONG_HOLD if backend == "s3" and rng.random() < 0.3 else 0.0
            fault.update(where="request", kind=rng.choice(("put-create", "put", "get", "list", "*")))
            fault["nth"] = rng.randint(1, 4)
            merge.update(fault=fault, host="a")
        ops.append(merge)
        for _ in range(merge.get("fault", {}).get("after", 1)):
            kind = rng.choice(("replace", "rm", "gc-drop", "gc-thin", "gc", "dcp-save"))
            step = rng.choice(STEPS)
            host = rng.choice(("b", "c"))
            if kind == "replace":
                op = {"op": "commit", "save": rng.choice(WHOLE), "key": ["main", step], "force": True,
                      "tag": None, "metric": None}  # fmt: skip
            elif kind == "dcp-save":
                op = {"op": "dcp-save", "save": rng.choice(DCP_STATES), "key": [DCP_RUN, rng.choice(DCP_STEPS)]}
            elif kind == "rm":
                op = {"op": "rm", "key": ["main", step], "force": True}
            elif kind == "gc-drop":
                op = {"op": "gc", "args": ["--keep-last", "1"], "drops": True, "thins": False}
            elif kind == "gc-thin":
                op = {"op": "gc", "args": ["--keep-last", "1", "--thin", "weights"], "drops": False, "thins": True}
            else:
                op = {"op": "gc", "args": [], "drops": False, "thins": False}
            ops.append(dict(op, host=host, fault=_fault(rng, backend)))
    return _then_anything(rng, backend, ops, "replace", rng.randint(0, 2), "merges")


def _then_anything(
    rng: random.Random, backend: str, ops: list[dict[str, Any]], drawn_from: str, count: int, theme: str
) -> list[dict[str, Any]]:
    """A targeted theme's end: ``count`` operations drawn as theme ``drawn_from`` draws them, each
    maybe faulted, then every operation numbered and given a host."""
    kinds, weights = zip(*THEMES[drawn_from].items(), strict=True)
    for _ in range(count):
        op = _operation(rng, rng.choices(kinds, weights)[0], drawn_from)
        op.update(host=rng.choice(HOSTS), fault=_fault(rng, backend))
        ops.append(op)
    for n, op in enumerate(ops):
        op.setdefault("host", rng.choice(HOSTS))
        op.setdefault("fault", None)
        op.update(n=n, theme=theme)
    return ops


def make_schedule(seed: int, backend: str, theme: str | None = None) -> list[dict[str, Any]]:
    """The operations of one seed (of a drawn theme, or of the targeted ``theme``): the same list
    on every run of it."""
    rng = random.Random(f"{backend}:{seed}")
    if theme == "pins-vs-gc":
        return _pins_vs_gc(rng, backend)
    if theme == "revisions":
        return _revisions(rng, backend)
    if theme == "merges":
        return _merges(rng, backend)
    if theme == "tag-drops":
        return _tag_drops(rng, backend)
    if theme is not None:
        raise ValueError(f"unknown targeted theme {theme!r}: {TARGETED}")
    theme = rng.choice(sorted(THEMES))
    kinds, weights = zip(*THEMES[theme].items(), strict=True)
    ops: list[dict[str, Any]] = []
    for n in range(rng.randint(6, 10)):
        host = rng.choice(HOSTS)
        op = _operation(rng, rng.choices(kinds, weights)[0], theme)
        op.update(n=n, host=host, theme=theme, fault=_fault(rng, backend))
        ops.append(op)
    return ops


# ---- running ---------------------------------------------------------------------------------------


class HostServer:
    """One fork server (testbed/sim_host.py) and the commands it runs."""

    def __init__(self, env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).with_name("sim_host.py"))],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            text=True,
            bufsize=1,
        )
        self.events: dict[int, list[dict[str, Any]]] = {}
        self.pids: dict[int, int] = {}  # command id -> its process
        self.next_id = 0
        assert json.loads(self._line()).get("ready")

    def _line(self) -> str:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("the simulation's host server died")
        return line

    def _send(self, order: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(order) + "\n")
        self.proc.stdin.flush()

    def spawn(self, args: list[str], env: dict[str, str], out: Path, fault: dict[str, Any] | None) -> int:
        self.next_id += 1
        self._send({"spawn": self.next_id, "args": args, "env": env, "out": str(out), "fault": fault})
        return self.next_id

    def wait(self, ident: int, limit: float = OP_LIMIT) -> dict[str, Any]:
        """The next event of command ``ident`` (stopped, or ended with its rc), skipping its pid."""
        deadline = time.monotonic() + limit
        while True:
            queue = self.events.setdefault(ident, [])
            while queue:
                event = queue.pop(0)
                if "pid" not in event:
                    return event
                self.pids[ident] = event["pid"]
            if time.monotonic() > deadline:
                self._send({"kill": ident})
                self._until_ended(ident)  # its effects end here, not once the schedule has gone on
                return {"id": ident, "rc": None, "hang": True}
            assert self.proc.stdout is not None
            ready, _, _ = select.select([self.proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
            if ready:
                event = json.loads(self._line())
                self.events.setdefault(event["id"], []).append(event)

    def _until_ended(self, ident: int) -> None:
        """After a kill: the command's end (its rc), for at most :data:`KILL_WAIT` seconds."""
        deadline = time.monotonic() + KILL_WAIT
        assert self.proc.stdout is not None
        resend = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            queue = self.events.setdefault(ident, [])
            if any("rc" in e for e in queue):
                self.events[ident] = [e for e in queue if "rc" not in e]
                return
            if time.monotonic() > resend:  # a loaded host server may not have started it when the kill came
                self._send({"kill": ident})
                resend = time.monotonic() + 1.0
            ready, _, _ = select.select([self.proc.stdout], [], [], max(0.0, min(resend, deadline) - time.monotonic()))
            if ready:
                event = json.loads(self._line())
                self.events.setdefault(event["id"], []).append(event)
        raise RuntimeError(f"command {ident} did not end within {KILL_WAIT:.0f} s of its kill")

    def cont(self, ident: int) -> None:
        self._send({"cont": ident})

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            self.proc.wait(timeout=30)


@dataclass
class Outcome:
    seed: int
    backend: str
    problems: list[str]  # invariants broken, tracebacks
    journal: list[Done]
    seconds: float
    checking: float = 0.0  # of which the fresh host's checks
    overran: list[str] = field(default_factory=list)  # operations and checks that exceeded OP_LIMIT

    @property
    def findings(self) -> list[str]:
        """Everything wrong with the schedule: invariants broken, then bounds exceeded."""
        return [*self.problems, *(f"exceeded its bound: {o}" for o in self.overran)]

    def replay(self, code: str | None = None, slip: bool = False) -> str:
        theme = self.journal[0].op.get("theme") if self.journal else None
        where = (f" --code {code}" if code else "") + (" --slip" if slip else "")
        where += f" --theme {theme}" if theme in TARGETED else ""
        return f"python -m benchmarks.sim --backend {self.backend} --seed {self.seed} --schedules 1{where} --verbose"


class Schedule:
    """Runs one seed's operations on a fresh store and checks what a fresh host sees."""

    def __init__(
        self,
        seed: int,
        backend: str,
        inputs: Inputs,
        server: HostServer,
        base_env: dict[str, str],
        location: str,
        work: Path,
        ref_lock_timeout: bool,
        slip: bool = False,
    ) -> None:
        self.slip = slip
        self.seed, self.backend, self.inputs, self.server = seed, backend, inputs, server
        self.location, self.work = location, work
        self.base_env = base_env
        self.ref_lock_timeout = ref_lock_timeout
        self.clock = 0
        self.journal: list[Done] = []
        self.overran: list[str] = []
        self.stalled: dict[
            str, tuple[int, dict[str, Any], int, float, int]
        ] = {}  # host -> (id, op, start, since, left)

    def _tick(self) -> int:
        self.clock += 1
        return self.clock

    def _fault(self, fault: dict[str, Any] | None) -> dict[str, Any] | None:
        """Where a request fault acts: at the library's failpoint (before its own checks of that
        request, such as a fence), or, with ``slip``, at the S3 client's call after them."""
        if fault and fault["where"] == "request":
            return dict(fault, where="client" if self.slip and self.backend == "s3" else "library")
        return fault

    def _env(self, host: str, fault: dict[str, Any] | None) -> dict[str, str]:
        env = dict(self.base_env, TAILOR_CACHE=str(self.work / f"cache-{host}"), TAILOR_STORE=self.location)
        env["TAILOR_FAILPOINTS"] = ""
        if fault and fault["where"] == "library":
            env["TAILOR_FAILPOINTS"] = f"*/{fault['kind']}={fault['action']}@{fault['nth']}"
        elif fault and fault["where"] == "point":
            env["TAILOR_FAILPOINTS"] = f"{fault['point']}={fault['action']}@1"
        return env

    def _lock(self) -> list[str]:
        return ["--lock-timeout", "10" if self.backend == "s3" else "1"]

    def args(self, op: dict[str, Any]) -> list[str]:
        kind = op["op"]
        key = op.get("key")
        at = f"{key[0]}:step={key[1]}" if key else ""
        ref_lock = self._lock() if self.ref_lock_timeout else []
        if kind == "commit":
            args = ["commit", str(self.inputs.folders[op["save"]]), "--step", str(key[1]), "--run", key[0]]
            args += ["--force"] * op["force"] + (["--tag", op["tag"]] if op["tag"] else [])
            args += ["--metric", f"loss={op['metric']}"] if op["metric"] is not None else []
            return args + self._lock()
        if kind == "part":
            return ["commit", str(self.inputs.folders[op["part"]]), "--part", *self._lock()]
        if kind == "finalize":
            return ["finalize", "step=3", *self._lock()]
        if kind == "tag":
            return ["tag", at, op["tag"], *(["--force"] * op["force"]), *ref_lock]
        if kind == "untag":
            return ["untag", op["tag"], *ref_lock]
        if kind in ("pin", "unpin"):
            return [kind, at, *ref_lock]
        if kind == "rm":
            return ["remove", at, *(["--force"] * op["force"]), *ref_lock]
        if kind == "metric":
            return ["metric", at, f"loss={op['value']}", *ref_lock]
        if kind == "gc":
            return ["gc", *op["args"], *self._lock()]
        if kind == "branch":
            return ["run", "create", "br", "--from", f"main:step={op['from']}", *self._lock()]
        if kind == "dcp-save":
            return ["@dcp-save", op["save"], str(key[1]), self._lock()[1]]  # waits as the commands do
        if kind == "merge":
            spec = self.work / f"spec-{op['n']}.yaml"
            spec.write_text(MERGE_SPECS[op["method"]])
            return ["merge", str(spec), "--tag", op["tag"], "--run", "main", "--json", *self._lock()]
        raise ValueError(kind)

    def _finish(self, ident: int, op: dict[str, Any], start: int) -> None:
        event = self.server.wait(ident)
        if event.get("stopped"):  # stopped a second time (a renewal thread met the fault too): go on
            self.server.cont(ident)
            event = self.server.wait(ident)
        rc = event.get("rc")
        out = self.work / f"op-{op['n']}"
        said = ""
        for path in (out, out.with_name(out.name + ".err")):
            if path.exists():
                said += path.read_text(errors="replace")[-2000:]
        if event.get("hang"):
            outcome = "hang"
        elif rc is not None and rc < 0:
            outcome = "unknown"
        else:
            outcome = "ok" if rc == 0 else "failed"
        self.journal.append(Done(op, start, self._tick(), outcome, rc, said.strip()))

    def _resume(self, host: str) -> None:
        ident, op, start, since, _ = self.stalled.pop(host)
        wait = op["fault"]["hold"] - (time.monotonic() - since)
        if wait > 0:
            time.sleep(wait)
        self.server.cont(ident)
        self._finish(ident, op, start)

    def _age_stalls(self) -> None:
        for host in list(self.stalled):
            ident, op, start, since, left = self.stalled[host]
            if left <= 1:
                self._resume(host)
            else:
                self.stalled[host] = (ident, op, start, since, left - 1)

    def run(self, ops: list[dict[str, Any]]) -> None:
        for op in ops:
            host = op["host"]
            if host in self.stalled:
                self._resume(host)
            start = self._tick()
            fault = self._fault(op["fault"])
            ident = self.server.spawn(self.args(op), self._env(host, fault), self.work / f"op-{op['n']}", fault)
            event = self.server.wait(ident)
            if event.get("stopped"):
                self.stalled[host] = (ident, op, start, time.monotonic(), op["fault"]["after"])
                continue
            self.server.events.setdefault(ident, []).insert(0, event)
            self._finish(ident, op, start)
            self._age_stalls()
        for host in list(self.stalled):
            self._resume(host)

    def command(self, args: list[str], name: str, cache: str = "fresh") -> tuple[int, str, str]:
        """A check's command on a fresh host; one past OP_LIMIT is noted in ``overran`` (rc -1)."""
        env = dict(self.base_env, TAILOR_CACHE=str(self.work / f"cache-{cache}"), TAILOR_STORE=self.location)
        env["TAILOR_FAILPOINTS"] = ""
        out = self.work / name
        ident = self.server.spawn(args, env, out, None)
        event = self.server.wait(ident)
        if event.get("hang"):
            self.overran.append(f"check {name} ({' '.join(args[:2])}) ran past {OP_LIMIT:.0f} s")
        err = out.with_name(out.name + ".err")
        return (
            -1 if event.get("hang") else int(event["rc"]),
            out.read_text(errors="replace") if out.exists() else "",
            err.read_text(errors="replace") if err.exists() else "",
        )

    def look(self) -> Seen:
        """What a fresh host sees: every step, each checked out and compared with the inputs."""
        seen = Seen()
        rc, out, err = self.command(["log", "--json"], "check-log")
        if rc == -1:
            return seen  # nothing to check: noted as a bound exceeded, not a store found broken
        if rc != 0:
            seen.verify_rc, seen.verify_said = rc, f"log failed: {err.strip()[-500:]}"
            return seen
        for entry in json.loads(out):
            if entry.get("origin") == "merge":
                seen.merges[str(entry.get("tag"))] = entry
            else:
                seen.steps[(entry["run"], int(entry["step"]))] = entry
        rc, out, err = self.command(["verify", "--deep"], "check-verify")
        seen.verify_rc, seen.verify_said = (0, "") if rc == -1 else (rc, (out + err).strip()[-800:])
        by_digest = {json.dumps(d, sort_keys=True): name for name, d in self.inputs.digests.items()}
        for (run, step), entry in seen.steps.items():
            if entry.get("tier") is not None:
                continue
            target = self.work / f"checkout-{run}-{step}"
            rc, out, err = self.command(["checkout", f"{run}:step={step}", "--out", str(target)], f"check-{run}-{step}")
            if rc == -1:
                entry["content"] = "unchecked"
                continue
            if rc != 0:
                entry["checkout_said"] = err.strip()[-500:]
                continue
            entry["content"] = by_digest.get(json.dumps(tree_digest(target), sort_keys=True), "something else")
            shutil.rmtree(target)
        for tag, entry in seen.merges.items():  # a merge checks out, every blob hash-checked
            target = self.work / f"checkout-merge-{tag}"
            rc, out, err = self.command(["checkout", f"tag={tag}", "--out", str(target)], f"check-merge-{tag}")
            entry["checks_out"] = None if rc == -1 else rc == 0
            entry["checkout_said"] = err.strip()[-500:]
            shutil.rmtree(target, ignore_errors=True)
        return seen


def run_schedule(
    seed: int,
    backend: str,
    inputs: Inputs,
    server: HostServer,
    base_env: dict[str, str],
    new_location: Callable[[Path], str],
    ref_lock_timeout: bool,
    keep: Path | None = None,
    slip: bool = False,
    theme: str | None = None,
) -> Outcome:
    began = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix=f"sim-{backend}-{seed}-", dir=keep))
    try:
        location = new_location(work)
        schedule = Schedule(seed, backend, inputs, server, base_env, location, work, ref_lock_timeout, slip)
        rc, _, err = schedule.command(["init", location], "init", cache="a")
        if rc != 0:
            raise RuntimeError(f"init failed: {err}")
        ops = make_schedule(seed, backend, theme)
        schedule.run(ops)
        checking = time.monotonic()
        overran = [
            f"operation {d.op['n']} ({d.kind}) ran past {OP_LIMIT:.0f} s and was killed"
            for d in schedule.journal
            if d.outcome == "hang"
        ]
        problems = [
            f"operation {d.op['n']} ({d.kind}) ended with a traceback: {d.said[-300:]}"
            for d in schedule.journal
            if "Traceback" in d.said
        ]
        keys: set[Key] = {
            (str(d.op["key"][0]), int(d.op["key"][1]))
            for d in schedule.journal
            if d.kind in ("commit", "finalize", "dcp-save")
        }
        seen = schedule.look()
        if not schedule.overran:  # a check that did not finish says nothing of the store
            problems += check(schedule.journal, seen, keys, inputs.contents())
        return Outcome(
            seed,
            backend,
            problems,
            schedule.journal,
            time.monotonic() - began,
            time.monotonic() - checking,
            overran + schedule.overran,
        )
    finally:
        if keep is None:
            shutil.rmtree(work, ignore_errors=True)


def describe(outcome: Outcome) -> str:
    theme = outcome.journal[0].op.get("theme") if outcome.journal else None
    lines = [f"seed {outcome.seed} ({outcome.backend}, {theme}):"]
    for d in outcome.journal:
        fault = d.op.get("fault")
        what = {k: v for k, v in d.op.items() if k not in ("n", "host", "fault", "theme")}
        lines.append(
            f"  [{d.start:>2}-{d.end:>2}] #{d.op['n']} host {d.op['host']}: {json.dumps(what)}"
            + (f" fault {json.dumps(fault)}" if fault else "")
            + f" -> {d.outcome} ({d.rc}) {d.said.splitlines()[-1][:160] if d.said else ''}"
        )
    lines += [f"  PROBLEM {p}" for p in outcome.problems]
    lines += [f"  OVERRAN {p}" for p in outcome.overran]
    return "\n".join(lines)


def host_environment(extra: dict[str, str] | None = None, code: str | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.update(extra or {})
    env.update(TAILOR_LOCK_TTL=str(TTL), DS_ACCELERATOR="cpu", TAILOR_THREADS="1", OPENBLAS_NUM_THREADS="1")
    env["TAILOR_DROP_PARTS_AFTER"] = "0"  # --drop-parts takes parts of any age, racing the finalizes
    env.update(TAILOR_S3_TIMEOUT_SECONDS=str(REQUEST_SECONDS), TAILOR_S3_RETRY_SECONDS=str(RETRY_SECONDS))
    env.pop("TAILOR_STORE", None)
    if code:
        env["PYTHONPATH"] = code + os.pathsep + env.get("PYTHONPATH", "")
        env["TAILOR_SIM_CLI"] = str(Path(code) / "cli")
    return env
