"""The metadata at scale: real steps at a thousand ranks and ten thousand steps, with tiny tensors.

``python -m benchmarks.scale --case fsdp2-7b-64`` (``--quick``: the smallest case, 4 ranks, a test's)
builds an FSDP2 save of a Llama layout as DCP plans it: the parameter names, the AdamW state and
the param groups of a real ``get_state_dict`` of a Llama of the case's depth (32 blocks for 7B,
80 for 70B), every parameter and both moments sharded along dim 0 over the case's ranks, so the
count of tensors, chunks, items and files is a real save's. Only the bytes are tiny (4 fp32
values a chunk, new random values every step): what is measured is the metadata, not the codec.

Ranks are simulated in one process by making DCP's own calls in DCP's order
(``state_dict_saver``): every rank's ``DefaultSavePlanner`` plans locally, the coordinator's
``create_global_plan`` dedups and builds DCP's ``Metadata``, every rank's ``write_data``, then the
coordinator's ``finish``. A sharded value is a stand-in that answers DCP's ``_Checkpointable``
calls as a DTensor sharded ``Shard(0)`` would (a DTensor needs a process group per rank).

Cases (``--case``):

* ``fsdp2-<7b|70b>-<ranks>``: ``--steps`` steps saved through ``TailorStorageWriter`` into one
  store, and ``--folder-steps`` of the same saves written by DCP's ``FileSystemWriter`` and
  committed as folders into another (``Store.commit``). Beside each, in the same run, DCP's side
  of the same save: its coordinator's ``create_global_plan`` from the same local plans and
  ``FileSystemWriter.finish`` writing ``.metadata``, and that file's bytes;
* ``history-7b-64``: ``--steps`` steps of the 64-rank 7B layout through the writer, each step's
  publish the real one, with a run's retention on the way: every 500th step pinned, ``gc
  --keep-last 5`` every ``--gc-every`` steps (so the last 5 stay whole and the pinned ones stay).

Recorded per step: the bytes the step adds to the index (SQLite pages in use) and to the
manifest objects, and the commit's time by phase. Then, on the store as the case leaves it, each
a fresh process timed to its exit, peak RSS from ``wait4``: ``tailor log``, ``show``, ``diff``,
``verify``, ``gc --dry-run``, ``index rebuild``, one rank's resume (``TailorStorageReader`` under
DCP's ``DefaultLoadPlanner``: the plan, then the load, checked against the values saved), and
``gc``. Prints one JSON document and writes it to ``--out`` (default ``.bench/scale/CASE.json``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from tailorstore import Retention, Store
from tailorstore.integrations.dcp_storage import TailorStorageReader
from tailorstore.integrations.dcp_writer import TailorStorageWriter

MODELS = {"7b": 32, "70b": 80}  # Llama 2 depths; names and state as get_state_dict gives them
ROWS, COLS = 1, 4  # one chunk of a 2-D parameter: ROWS x COLS fp32 values; a 1-D one: COLS values


# -- the layout --------------------------------------------------------------------------------------
class Shard:
    """One rank's dim-0 shard of a tensor, answering DCP's ``_Checkpointable`` calls as a DTensor
    under ``Shard(0)`` over ``world`` ranks does; its values are a view of the rank's buffer."""

    __slots__ = ("_at", "_buffer", "global_size", "local_size", "offsets")

    def __init__(self, global_size: tuple[int, ...], rank: int, world: int, buffer: np.ndarray, at: int) -> None:
        self.global_size = torch.Size(global_size)
        rows = global_size[0] // world
        self.local_size = torch.Size((rows, *global_size[1:]))
        self.offsets = torch.Size((rank * rows, *[0] * (len(global_size) - 1)))
        self._buffer, self._at = buffer, at

    def size(self) -> torch.Size:
        return self.global_size

    @property
    def local(self) -> torch.Tensor:
        numel = int(np.prod(self.local_size))
        return torch.from_numpy(self._buffer[self._at : self._at + numel]).view(self.local_size)

    def __create_write_items__(self, fqn: str, obj: object) -> list[WriteItem]:
        return [
            WriteItem(
                index=MetadataIndex(fqn, self.offsets),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=self.offsets, sizes=self.local_size),
                    properties=TensorProperties(dtype=torch.float32),
                    size=self.global_size,
                ),
            )
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=self.offsets, sizes=self.local_size)]


def _find(state: dict[str, Any], fqn: str, mappings: dict[str, Any]) -> Any:
    value: Any = state
    for key in mappings[fqn]:
        value = value[key]
    return value


class ShardedSavePlanner(DefaultSavePlanner):
    """DCP's own planner; only the lookup of a stand-in shard hands DCP its local tensor, as
    ``DTensor.__get_tensor_shard__`` does."""

    def lookup_object(self, index: MetadataIndex) -> Any:
        found = self.state_dict[index.fqn]
        return found.local if isinstance(found, Shard) else super().lookup_object(index)


class ShardedLoadPlanner(DefaultLoadPlanner):
    """DCP's own load planner; a stand-in shard is loaded into its own local tensor. Its set-up
    skips ``_init_state_dict``, which materialises meta tensors (there are none) and would drop
    the stand-ins."""

    def set_up_planner(self, state_dict: dict[str, Any], metadata: Any = None, is_coordinator: bool = False) -> None:
        from torch.distributed.checkpoint._nested_dict import flatten_state_dict

        self.original_state_dict = state_dict
        self.state_dict, self.mappings = flatten_state_dict(state_dict)
        self.metadata, self.is_coordinator = metadata, is_coordinator

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        found = self.state_dict[index.fqn]
        if isinstance(found, Shard):
            if not hasattr(self, "_locals"):
                self._locals: dict[str, torch.Tensor] = {}
            return self._locals.setdefault(index.fqn, found.local)
        return super().lookup_tensor(index)


@dataclass
class Layout:
    """A model's state dict as ``get_state_dict`` names it, and its sharded shapes at ``world`` ranks."""

    model: str
    world: int
    names: list[tuple[str, tuple[str, ...], int]]  # (flat name, path in the nested dict, ndim); ndim 0: AdamW's step
    param_groups: list[dict[str, Any]]

    @classmethod
    def of(cls, model: str, world: int) -> Layout:
        from torch.distributed.checkpoint._nested_dict import flatten_state_dict
        from torch.distributed.checkpoint.state_dict import get_state_dict

        from testbed.train_fsdp import build_model

        torch.manual_seed(0)
        net = build_model(MODELS[model], hidden=8, vocab=16)
        optim = torch.optim.AdamW(net.parameters(), lr=1e-4)
        ids = torch.tensor([[1, 2, 3]])
        net(ids, labels=ids).loss.backward()
        optim.step()
        msd, osd = get_state_dict(net, optim)
        flat, mappings = flatten_state_dict({"model": msd, "optim": osd})
        names = [(k, tuple(mappings[k]), v.dim()) for k, v in flat.items() if isinstance(v, torch.Tensor)]
        return cls(model, world, names, osd["param_groups"])

    @property
    def shards_a_rank(self) -> int:
        return sum(1 for _, _, ndim in self.names if ndim)

    @property
    def chunks(self) -> int:
        return self.shards_a_rank * self.world

    def shape(self, ndim: int) -> tuple[int, ...]:
        return (self.world * ROWS, COLS) if ndim == 2 else (self.world * COLS,)

    def state(self, rank: int, step: int) -> dict[str, Any]:
        """Rank ``rank``'s nested state dict at ``step``: new values at every step."""
        buffer = np.random.default_rng([step, rank]).standard_normal(self.shards_a_rank * ROWS * COLS, np.float32)
        state: dict[str, Any] = {"model": {}, "optim": {"state": {}, "param_groups": self.param_groups}}
        at = 0
        for _, path, ndim in self.names:
            if ndim:
                value: Any = Shard(self.shape(ndim), rank, self.world, buffer, at)
                at += ROWS * COLS if ndim == 2 else COLS
            else:
                value = torch.tensor(float(step))
            node = state
            for key in path[:-1]:
                node = node.setdefault(key, {})
            node[path[-1]] = value
        return state


# -- one save, DCP's calls in DCP's order -------------------------------------------------------------
def plan_locally(layout: Layout, step: int) -> tuple[list[ShardedSavePlanner], list[Any], float]:
    planners, plans = [], []
    began = time.perf_counter()
    for rank in range(layout.world):
        planner = ShardedSavePlanner()
        planner.set_up_planner(layout.state(rank, step), None, rank == 0)
        planners.append(planner)
        plans.append(planner.create_local_plan())
    return planners, plans, time.perf_counter() - began


def save_into_store(store: Store, layout: Layout, step: int, dcp_side: Path) -> dict[str, float]:
    """One step through ``TailorStorageWriter``, and beside it DCP's coordinator on the same plans."""
    planners, plans, local_s = plan_locally(layout, step)
    writer = TailorStorageWriter(store, step=step)
    writer.reset(step)
    writer.set_up_storage_writer(True)
    plans = [writer.prepare_local_plan(p) for p in plans]
    began = time.perf_counter()
    global_plans, metadata = planners[0].create_global_plan(plans)
    dcp_global_s = time.perf_counter() - began
    began = time.perf_counter()
    global_plans = writer.prepare_global_plan(global_plans)
    store_plan_s = time.perf_counter() - began
    results = []
    began = time.perf_counter()
    for planner, plan in zip(planners, global_plans, strict=True):
        results.append(writer.write_data(planner.finish_plan(plan), planner).wait())
    parts_s = time.perf_counter() - began
    began = time.perf_counter()
    writer.finish(metadata, results)
    finish_s = time.perf_counter() - began
    # DCP's side of the same save: its coordinator's global plan and .metadata, from the same plans
    began = time.perf_counter()
    _, own_metadata = ShardedSavePlanner().create_global_plan(plans)
    own_plan_s = time.perf_counter() - began
    shutil.rmtree(dcp_side, ignore_errors=True)
    dcp_side.mkdir(parents=True)
    own = FileSystemWriter(dcp_side, single_file_per_rank=True, sync_files=True)
    own.reset()
    own.set_up_storage_writer(True)
    began = time.perf_counter()
    own.finish(own_metadata, results)
    own_finish_s = time.perf_counter() - began
    return {
        "local_plans_s": local_s, "dcp_global_plan_s": dcp_global_s, "store_plan_s": store_plan_s,
        "parts_s": parts_s, "finish_s": finish_s, "commit_s": store_plan_s + parts_s + finish_s,
        "dcp_own_global_plan_s": own_plan_s, "dcp_own_finish_s": own_finish_s,
        "dcp_own_s": own_plan_s + own_finish_s, "dcp_metadata_bytes": (dcp_side / ".metadata").stat().st_size,
    }  # fmt: skip


def save_folder(layout: Layout, step: int, folder: Path) -> float:
    """The same save written by DCP's ``FileSystemWriter``, as FSDP2 writes it to disk."""
    planners, plans, _ = plan_locally(layout, step)
    shutil.rmtree(folder, ignore_errors=True)
    writer = FileSystemWriter(folder, single_file_per_rank=True, sync_files=False, thread_count=1)
    writer.reset()
    writer.set_up_storage_writer(True)
    plans = [writer.prepare_local_plan(p) for p in plans]
    global_plans, metadata = planners[0].create_global_plan(plans)
    global_plans = writer.prepare_global_plan(global_plans)
    results = [writer.write_data(p.finish_plan(g), p).wait() for p, g in zip(planners, global_plans, strict=True)]
    began = time.perf_counter()
    writer.finish(metadata, results)
    return time.perf_counter() - began


# -- what a step adds ---------------------------------------------------------------------------------
def index_bytes(store: Path) -> int:
    """Bytes of the index's pages in use (the WAL's included: a read sees them)."""
    with sqlite3.connect(f"file:{store / 'index.sqlite'}?mode=ro", uri=True) as db:
        pragmas = ("page_count", "freelist_count", "page_size")
        pages, free, size = (db.execute(f"PRAGMA {p}").fetchone()[0] for p in pragmas)
    return (pages - free) * size


def index_tables(store: Path) -> dict[str, int]:
    """Bytes of each table and index of the index (SQLite's ``dbstat``), where this SQLite has it."""
    with sqlite3.connect(f"file:{store / 'index.sqlite'}?mode=ro", uri=True) as db:
        try:
            return dict(db.execute("SELECT name, SUM(pgsize) FROM dbstat GROUP BY name ORDER BY 2 DESC"))
        except sqlite3.OperationalError:
            return {}


def tree_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) if folder.exists() else 0


def sizes(store: Path) -> dict[str, int]:
    return {"index": index_bytes(store), "manifests": tree_bytes(store / "manifests"),
            "blobs": tree_bytes(store / "blobs") + tree_bytes(store / "packs")}  # fmt: skip


def added(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {f"{k}_added": after[k] - before[k] for k in before} | {
        "metadata_added": after["index"] - before["index"] + after["manifests"] - before["manifests"]
    }


# -- whole processes ----------------------------------------------------------------------------------
PEAK = """
import atexit, os, runpy, sys
def peak():
    with open("/proc/self/status") as status:
        kb = next(line.split()[1] for line in status if line.startswith("VmHWM:"))
    sys.stderr.write(f"\\nVMHWM {kb}\\n")
    sys.stderr.flush()
def leave(code, _exit=os._exit):  # the CLI leaves through os._exit, past atexit
    peak()
    _exit(code)
atexit.register(peak)
os._exit = leave
how, what, sys.argv = sys.argv[1], sys.argv[2], sys.argv[2:]
if how == "-m":
    runpy.run_module(what, run_name="__main__", alter_sys=True)
else:
    exec(compile(what, "<benchmark>", "exec"), {"__name__": "__main__"})
"""


def run_child(cmd: list[str], env: dict[str, str]) -> dict[str, Any]:
    """Wall seconds of one process (``python -m MODULE ...`` or ``python -c CODE ...``) to its exit,
    and its own peak RSS: its VmHWM as it exits. (Not ``wait4``'s ``ru_maxrss``: exec carries the
    forking process's high-water mark over, and this one holds a whole layout.)"""
    began = time.perf_counter()
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = subprocess.Popen([cmd[0], "-c", PEAK, *cmd[1:]], env=env, stdout=out, stderr=err)
        code = proc.wait()
        wall = time.perf_counter() - began
        out.seek(0), err.seek(0)
        text, error = out.read().decode(), err.read().decode()
    if code != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {code}: {error[-2000:]}")
    peaks = [line.split()[1] for line in error.splitlines() if line.startswith("VMHWM ")]
    return {"s": round(wall, 3), "peak_rss": int(peaks[-1]) * 1024, "stdout": text[-4000:]}


def own_memory() -> dict[str, int]:
    """This process's resident bytes now and at its peak, from ``/proc/self/status``."""
    with open("/proc/self/status") as status:
        found = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in status if line.startswith("Vm")}
    return {"rss": found["VmRSS"], "peak": found["VmHWM"]}


def tailor(store: Path, *args: str) -> dict[str, Any]:
    env = dict(os.environ, TAILOR_STORE=str(store))
    return run_child([sys.executable, "-m", "tailorstore.cli.app", *args], env)


def operations(store: Path, layout: Layout, last: int, previous: int, gc_keep: int) -> dict[str, Any]:
    """The commands a run's operator and its resume pay on the store as the case leaves it."""
    ops: dict[str, Any] = {}
    ops["log"] = tailor(store, "log")
    ops["show"] = tailor(store, "show", f"step={last}")
    ops["diff"] = tailor(store, "diff", f"step={previous}", f"step={last}")
    ops["verify"] = tailor(store, "verify")
    ops["gc_dry_run"] = tailor(store, "gc", "--keep-last", str(gc_keep), "--dry-run")
    ops["index_rebuild"] = tailor(store, "index", "rebuild")
    rank = layout.world - 1
    resume = run_child(
        [sys.executable, "-m", "benchmarks.metadata_scale", "--resume", str(store), "--model", layout.model,
         "--ranks", str(layout.world), "--rank", str(rank), "--step", str(last)],
        dict(os.environ),
    )  # fmt: skip
    ops["resume_one_rank"] = resume | json.loads(resume.pop("stdout").strip().splitlines()[-1])
    ops["gc"] = tailor(store, "gc", "--keep-last", str(gc_keep))
    for value in ops.values():
        value.pop("stdout", None)
    return ops


def resume_one_rank(store_path: str, model: str, world: int, rank: int, step: int) -> dict[str, Any]:
    """One rank's resume as ``dcp.load`` makes it: the reader's metadata, DCP's load plan, the load;
    every shard then compared with the values saved."""
    baseline = own_memory()["rss"]
    layout = Layout.of(model, world)
    state = layout.state(rank, step)
    expected = {fqn: s.local.clone() for fqn, s in _shards(state)}
    for _, shard in _shards(state):  # the destination: zeros, so a load that skips one is caught
        shard._buffer = np.zeros_like(shard._buffer)
    with Store.open(store_path) as store:
        began = time.perf_counter()
        reader = TailorStorageReader(store, f"step={step}")
        reader.reset()
        metadata = reader.read_metadata()
        reader.set_up_storage_reader(metadata, rank == 0)
        planner = ShardedLoadPlanner()
        planner.set_up_planner(state, metadata, rank == 0)
        plan = reader.prepare_global_plan([reader.prepare_local_plan(planner.create_local_plan())])[0]
        plan = planner.finish_plan(plan)
        plan_s = time.perf_counter() - began
        plan_rss = own_memory()["peak"]
        began = time.perf_counter()
        reader.read_data(plan, planner).wait()
        load_s = time.perf_counter() - began
    loaded = getattr(planner, "_locals", {})
    same = len(loaded) == len(expected) and all(torch.equal(loaded[k], v) for k, v in expected.items())
    return {"plan_s": plan_s, "load_s": load_s, "items": len(plan.items), "rss_before": baseline,
            "peak_rss_after_plan": plan_rss, "loaded_equal_saved": same}  # fmt: skip


def _shards(state: Any, prefix: str = "") -> list[tuple[str, Shard]]:
    """The stand-in shards of a nested state dict, under DCP's flattened names."""
    found = []
    for key, value in state.items() if isinstance(state, dict) else enumerate(state):
        name = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, Shard):
            found.append((name, value))
        elif isinstance(value, dict | list):
            found.extend(_shards(value, name))
    return found


# -- the cases ----------------------------------------------------------------------------------------
def rss() -> int:
    return own_memory()["peak"]


def ranks_case(model: str, world: int, steps: int, folder_steps: int, work: Path) -> dict[str, Any]:
    layout = Layout.of(model, world)
    result: dict[str, Any] = {"layout": {"model": model, "ranks": world, "tensors": len(layout.names),
                              "shards_a_rank": layout.shards_a_rank, "chunks": layout.chunks,
                              "files": world + 1}}  # fmt: skip
    store_path = work / "store-writer"
    shutil.rmtree(store_path, ignore_errors=True)
    rss_before = own_memory()["rss"]
    rows = []
    with Store.init(store_path) as store:
        for step in range(1, steps + 1):
            before = sizes(store_path)
            row = save_into_store(store, layout, step, work / "dcp-own")
            rows.append({"step": step, **row, **added(before, sizes(store_path))})
            print(json.dumps({"case": f"{model}-{world}", "writer": rows[-1]}), file=sys.stderr, flush=True)
    result["writer"] = {"steps": rows, "rss_before": rss_before, "peak_rss": rss()}  # the case's process, all ranks
    result["index_tables"] = index_tables(store_path)
    folder_rows = []
    if folder_steps:
        folder_store = work / "store-folder"
        shutil.rmtree(folder_store, ignore_errors=True)
        Store.init(folder_store).close()
        for step in range(1, folder_steps + 1):
            folder = work / "saves" / f"step-{step}"
            own_finish_s = save_folder(layout, step, folder)
            before = sizes(folder_store)
            commit = run_child(
                [sys.executable, "-c", COMMIT, str(folder_store), str(folder)], dict(os.environ)
            )  # fmt: skip
            inside = json.loads(commit.pop("stdout").strip().splitlines()[-1])
            folder_rows.append({"step": step, "process_s": commit["s"], "peak_rss": commit["peak_rss"], **inside,
                                "dcp_finish_s": own_finish_s,
                                "dcp_metadata_bytes": (folder / ".metadata").stat().st_size,
                                "distcp_bytes": tree_bytes(folder), **added(before, sizes(folder_store))})  # fmt: skip
            print(json.dumps({"case": f"{model}-{world}", "folder": folder_rows[-1]}), file=sys.stderr, flush=True)
            shutil.rmtree(folder)
    result["folder"] = {"steps": folder_rows}
    result["operations"] = operations(store_path, layout, steps, max(1, steps - 1), gc_keep=1)
    return result


COMMIT = """
import json, resource, sys, time
from tailorstore import Store
with Store.open(sys.argv[1]) as store:
    began = time.perf_counter()
    store.commit(sys.argv[2])
    print(json.dumps({"commit_s": time.perf_counter() - began}))
"""


def history_case(steps: int, gc_every: int, pin_every: int, keep_last: int, work: Path) -> dict[str, Any]:
    layout = Layout.of("7b", 64)
    store_path = work / "store-history"
    shutil.rmtree(store_path, ignore_errors=True)
    rows, gcs = [], []
    began_all = time.perf_counter()
    with Store.init(store_path) as store:
        for step in range(1, steps + 1):
            before = sizes(store_path)
            row = save_into_store(store, layout, step, work / "dcp-own")
            if step % pin_every == 0:
                store.pin(f"step={step}")
            row = {"step": step, **row, **added(before, sizes(store_path))}
            if step % gc_every == 0 or step == steps:
                began = time.perf_counter()
                store.gc(Retention(keep_last=keep_last))
                gcs.append({"step": step, "gc_s": time.perf_counter() - began})
            rows.append(row)
            if step % 10 == 0 or step == 1:
                print(json.dumps({"history": row | {"elapsed_s": time.perf_counter() - began_all}}), file=sys.stderr,
                      flush=True)  # fmt: skip
        kept = store.log()
    tables = index_tables(store_path)
    manifests = tree_bytes(store_path / "manifests")
    result: dict[str, Any] = {
        "layout": {"model": "7b", "ranks": 64, "chunks": layout.chunks}, "steps": steps, "gc_every": gc_every,
        "pin_every": pin_every, "keep_last": keep_last, "kept_steps": [s.step for s in kept],
        "index_bytes": index_bytes(store_path), "manifest_bytes_kept": manifests,
        "dcp_metadata_bytes_kept": sum(r["dcp_metadata_bytes"] for r in rows if r["step"] in {s.step for s in kept}),
        "every_step": rows if steps <= 100 else [r for r in rows if r["step"] <= 10 or r["step"] % 50 == 0],
        "commit_s": [r["commit_s"] for r in rows], "gc_runs": gcs, "index_tables": tables,
        "wall_s": time.perf_counter() - began_all,
    }  # fmt: skip
    result["operations"] = operations(store_path, layout, steps, steps - 1, gc_keep=keep_last)
    return result


# -- the tables of docs/benchmarks.md -------------------------------------------------------------------
def _mb(n: float) -> str:
    return f"{n / 1e6:,.2f} MB"


def _median(values: list[float]) -> float:
    return statistics.median(values)


def render(results: list[dict[str, Any]]) -> str:
    """Markdown tables of the measured cases, and the extrapolation to the cases not run, each
    figure from the JSON the cases wrote (``--render FILE...``)."""
    lines = []
    ranks = [r for r in results if r["case"].startswith("fsdp2")]
    history = [r for r in results if r["case"].startswith("history")]
    if ranks:
        lines += ["| case | chunks | files | store metadata a step (index + manifests) | DCP `.metadata` | ratio | "
                  "of it, index / manifest objects | writer commit a step | a chunk | DCP coordinator (plan + "
                  "`.metadata`) | ratio | the `.metadata` part + finalize alone | ratio | "
                  "folder commit (`Store.commit`) | a chunk | case peak RSS over its start |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for r in ranks:
            steps, lay = r["writer"]["steps"], r["layout"]
            meta = _median([s["metadata_added"] for s in steps])
            dcp = steps[-1]["dcp_metadata_bytes"]
            commit = _median([s["commit_s"] for s in steps])
            own = _median([s["dcp_own_s"] for s in steps])
            finish = _median([s["finish_s"] for s in steps])
            folder = _median([s["commit_s"] for s in r["folder"]["steps"]]) if r["folder"]["steps"] else float("nan")
            lines.append(
                f"| {r['case']} ({len(steps)} steps) | {lay['chunks']:,} | {lay['files']:,} | {_mb(meta)} | "
                f"{_mb(dcp)} | {meta / dcp:.2f}x | {_mb(_median([s['index_added'] for s in steps]))} / "
                f"{_mb(_median([s['manifests_added'] for s in steps]))} | {commit:.1f} s | "
                f"{commit / lay['chunks'] * 1e3:.2f} ms | {own:.2f} s | {commit / own:.1f}x | {finish:.1f} s | "
                f"{finish / own:.1f}x | {folder:.1f} s | {folder / lay['chunks'] * 1e3:.2f} ms | "
                f"{_mb(r['writer']['peak_rss'] - r['writer']['rss_before'])} |"
            )  # fmt: skip
        lines += ["", "Every step's own figures (writer): " + "; ".join(
            f"{r['case']} step {s['step']}: {_mb(s['metadata_added'])} ({_mb(s['index_added'])} index), "
            f"{s['commit_s']:.1f} s (parts {s['parts_s']:.1f} s, finish {s['finish_s']:.1f} s), DCP "
            f"{s['dcp_own_s']:.2f} s" for r in ranks for s in r["writer"]["steps"]) + "."]  # fmt: skip
        for r in ranks:
            tables, n = r.get("index_tables") or {}, r["layout"]["chunks"] * len(r["writer"]["steps"])
            if tables:
                lines += ["", f"{r['case']}'s index by table, bytes a chunk of a step ({n:,} chunks in the store): "
                          + ", ".join(f"{k} {v / n:,.0f}" for k, v in tables.items() if v / n >= 1) + "."]  # fmt: skip
    if history:
        lines += ["", "| case | steps | kept | commit a step, first / last | index | manifest objects kept | "
                  "DCP `.metadata` of the kept steps | index / that | index / manifest objects | "
                  "gc on the way, median |",
                  "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for r in history:
            c = r["commit_s"]
            lines.append(
                f"| {r['case']} | {r['steps']:,} | {len(r['kept_steps'])} | {c[0]:.1f} / {c[-1]:.1f} s | "
                f"{_mb(r['index_bytes'])} | {_mb(r['manifest_bytes_kept'])} | {_mb(r['dcp_metadata_bytes_kept'])} | "
                f"{r['index_bytes'] / r['dcp_metadata_bytes_kept']:.2f}x | "
                f"{r['index_bytes'] / r['manifest_bytes_kept']:.2f}x | "
                f"{_median([g['gc_s'] for g in r['gc_runs']]):.1f} s |"
            )  # fmt: skip
    names = ("log", "show", "diff", "verify", "gc_dry_run", "index_rebuild", "resume_one_rank", "gc")
    lines += ["", "| case | " + " | ".join(n.replace("_", " ") for n in names) + " |",
              "|---|" + "---|" * len(names)]  # fmt: skip
    for r in results:
        ops = r["operations"]
        cells = [f"{ops[n]['s']:.2f} s, {_mb(ops[n]['peak_rss'])}" for n in names]
        lines.append(f"| {r['case']} | " + " | ".join(cells) + " |")
    sevens = sorted((r for r in ranks if r["layout"]["model"] == "7b"), key=lambda r: r["layout"]["ranks"])
    if len(sevens) > 1:  # growth exponents: log(b / a) / log(ranks_b / ranks_a), 7B from fewest to most ranks
        a, b = sevens[0], sevens[-1]
        k = math.log(b["layout"]["ranks"] / a["layout"]["ranks"])

        def grows(get: Any) -> str:
            return f"{math.log(get(b) / get(a)) / k:.2f}"

        figures = {
            "store metadata a step": lambda r: _median([s["metadata_added"] for s in r["writer"]["steps"]]),
            "writer commit": lambda r: _median([s["commit_s"] for s in r["writer"]["steps"]]),
            "DCP coordinator": lambda r: _median([s["dcp_own_s"] for s in r["writer"]["steps"]]),
            **{f"`{n.replace('_', ' ')}`": (lambda r, n=n: r["operations"][n]["s"]) for n in names},
            "resume plan, in its process": lambda r: r["operations"]["resume_one_rank"]["plan_s"],
        }
        lines += ["", f"Growth exponents from {a['case']} to {b['case']} (measured both): " + ", ".join(
            f"{name} {grows(get)}" for name, get in figures.items()) + "."]  # fmt: skip
    resumes = [(r["case"], r["operations"]["resume_one_rank"]) for r in results]
    lines += ["", "One rank's resume, inside its process: " + "; ".join(
        f"{c}: plan {x['plan_s']:.2f} s ({x['items']:,} read items, peak RSS "
        f"{_mb(x['peak_rss_after_plan'] - x['rss_before'])} over its RSS before the plan), load {x['load_s']:.2f} s, "
        f"loaded = saved: {x['loaded_equal_saved']}" for c, x in resumes)
        + "."]  # fmt: skip
    return "\n".join(lines) + "\n"


def extrapolate(results: list[dict[str, Any]]) -> str:
    """The cases not run, from the per-chunk rates of the largest ranks case measured: an
    extrapolation, linear in chunks, and said to be one."""
    ranks = [r for r in results if r["case"].startswith("fsdp2")]
    if not ranks:
        return ""
    r = max(ranks, key=lambda x: x["layout"]["chunks"])
    steps, chunks = r["writer"]["steps"], r["layout"]["chunks"]
    commit = _median([s["commit_s"] for s in steps]) / chunks
    meta = _median([s["metadata_added"] for s in steps]) / chunks
    dcp = steps[-1]["dcp_metadata_bytes"] / chunks
    own = _median([s["dcp_own_s"] for s in steps]) / chunks
    folder = _median([s["commit_s"] for s in r["folder"]["steps"]]) / chunks if r["folder"]["steps"] else 0.0
    lines = [f"EXTRAPOLATED, not measured: linear in chunks from {r['case']}'s rates ({commit * 1e3:.2f} ms and "
             f"{meta:,.0f} bytes of store metadata a chunk; DCP {dcp:,.0f} bytes and {own * 1e6:.0f} us a chunk).", "",
             "| case | chunks (exact) | writer commit a step | folder commit a step | store metadata a step | "
             "DCP `.metadata` | DCP coordinator |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    measured = {x["case"] for x in ranks}
    for model, world in (("7b", 256), ("7b", 1024), ("70b", 64), ("70b", 256), ("70b", 1024)):
        if f"fsdp2-{model}-{world}" in measured:
            continue
        n = Layout.of(model, world).chunks
        lines.append(f"| fsdp2-{model}-{world} | {n:,} | {n * commit / 60:.0f} min | {n * folder / 60:.0f} min | "
                     f"{_mb(n * meta)} | {_mb(n * dcp)} | {n * own:.0f} s |")  # fmt: skip
    return "\n".join(lines) + "\n"


# The slow tier's case: a 7B layout at 4 ranks, every count a 64-rank step has but sixteen times fewer
# chunks (the 64-rank case costs the tier minutes; the figures come from the command line's cases).
QUICK_CASE = "fsdp2-7b-4"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.scale", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--case", default="fsdp2-7b-64", help="fsdp2-<7b|70b>-<ranks>, or history-7b-64")
    p.add_argument("--quick", action="store_true", help=f"the smallest case: {QUICK_CASE}, 2 steps, 1 folder step")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--folder-steps", type=int, default=2)
    p.add_argument("--gc-every", type=int, default=10)
    p.add_argument("--pin-every", type=int, default=500)
    p.add_argument("--keep-last", type=int, default=5)
    p.add_argument("--work", type=Path, default=None)
    p.add_argument("--out", type=Path, default=None)
    # one rank's resume, in a process of its own (operations)
    p.add_argument("--resume", default=None, help=argparse.SUPPRESS)
    p.add_argument("--model", default="7b", help=argparse.SUPPRESS)
    p.add_argument("--ranks", type=int, default=64, help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--step", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--render", nargs="+", type=Path, default=None, help="print the tables of these results")
    args = p.parse_args(argv)
    if args.render:
        found = [json.loads(f.read_text()) for f in args.render]
        print(render(found) + "\n" + extrapolate(found))
        return 0
    if args.resume:
        print(json.dumps(resume_one_rank(args.resume, args.model, args.ranks, args.rank, args.step)))
        return 0
    if args.quick:
        args.case, args.steps, args.folder_steps = QUICK_CASE, 2, 1
    work = args.work or Path(tempfile.mkdtemp(prefix="tailor-scale-"))
    work.mkdir(parents=True, exist_ok=True)
    kind, model, ranks = [*args.case.split("-"), "", ""][:3]
    began = time.perf_counter()
    if kind == "fsdp2" and model in MODELS and ranks.isdigit():
        result = ranks_case(model, int(ranks), args.steps, args.folder_steps, work)
    elif args.case == "history-7b-64":
        result = history_case(args.steps, args.gc_every, args.pin_every, args.keep_last, work)
    else:
        p.error(f"unknown case {args.case!r}: fsdp2-<7b|70b>-<ranks>, or history-7b-64")
    command = "python -m benchmarks.scale " + " ".join(sys.argv[1:] if argv is None else argv)
    result = {"case": args.case, "command": command,
              "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S"), "cores": os.cpu_count(),
              "wall_s": time.perf_counter() - began, **result}  # fmt: skip
    out = args.out or Path(".bench/scale") / f"{args.case}{'-quick' if args.quick else ''}-{args.steps}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result))
    if args.work is None:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
