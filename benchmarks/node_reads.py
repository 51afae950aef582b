"""What a node fetches from an S3 store on a resume, against the stored bytes it needs.

``python -m benchmarks.node_reads [--ranks 2 4] [--old TREE]`` starts a local S3 server (moto,
127.0.0.1) behind a relay that counts the bytes of every answer, and for each rank count:

* **dcp**: a DCP save of ``--mb`` MB of fp32 tensors committed as a folder; then that many rank
  processes at once, as ``torchrun`` starts them on one node (``LOCAL_WORLD_SIZE``, one
  ``TAILOR_CACHE``), each ``dcp.load`` of the whole state through ``TailorStorageReader`` (every
  rank needs every blob, as replicated state is);
* **deepspeed**: the tiny Llama trained 3 steps with ZeRO-2 under ``torchrun --nproc_per_node N``
  through ``attach`` into the store (one save), then a second ``torchrun`` resuming from it
  through ``attach``, on one node.

Reported per case: the blob and pack bytes the server sent during the loads, over the bytes of
every blob and pack object the store holds (the node needs all of them: one node, one step).
With ``--old TREE`` (a worktree of an earlier commit) each case also runs with that tree's
library on ``PYTHONPATH``, in the same run: both sides of the ratio from one run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import boto3
import torch

from testbed.local_s3 import LocalS3
from testbed.s3_relay import Relay

ROOT = Path(__file__).resolve().parent.parent
CLI = [sys.executable, "-m", "tailorstore.cli.app"]
LOAD = """
import sys, torch, torch.distributed.checkpoint as dcp
from tailorstore.integrations.dcp.reader import TailorStorageReader
saved = torch.load(sys.argv[2])
state = {name: torch.empty_like(t) for name, t in saved.items()}
dcp.load(state, storage_reader=TailorStorageReader(sys.argv[1]))
assert all(torch.equal(state[n], saved[n]) for n in saved), "loaded != saved"
"""


def _fetched(relay: Relay, since: int) -> tuple[int, int]:
    """(bytes, GETs) of blob and pack objects the server sent after answer ``since``."""
    got = [n for m, t, n in relay.answered[since:] if m == "GET" and ("/packs/" in t or "/blobs/" in t)]
    return sum(got), len(got)


def _stored(server: LocalS3, location: str) -> int:
    bucket, prefix = location.removeprefix("s3://").split("/", 1)
    client = boto3.client("s3", **server._client_args())
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/")
    objects = [o for p in pages for o in p.get("Contents", [])]
    return sum(o["Size"] for o in objects if "/packs/" in o["Key"] or "/blobs/" in o["Key"])


def _run(args: list[str], env: dict[str, str]) -> None:
    done = subprocess.run(args, env=env, cwd=env["TAILOR_BENCH_TREE"], capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(args[:6])}... failed: {done.stderr[-3000:]}")


def _env(server: LocalS3, relay: Relay, cache: Path, tree: Path | None) -> dict[str, str]:
    env = {**os.environ, **server.environ(), "AWS_ENDPOINT_URL": relay.endpoint, "TAILOR_CACHE": str(cache)}
    env.pop("TAILOR_STORE", None)
    env["TAILOR_BENCH_TREE"] = str(tree or ROOT)  # the library a process imports is its folder's (cwd first)
    env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    return env


def dcp_case(server: LocalS3, relay: Relay, work: Path, ranks: int, mb: int, tree: Path | None) -> dict:
    import torch.distributed.checkpoint as dcp

    env = _env(server, relay, work / "node", tree)
    count = max(1, mb // 4)
    state = {f"layer{i}.weight": torch.randn(1024, 1024) for i in range(count)}  # 4 MiB each
    dcp.save(state, checkpoint_id=str(work / "save"))
    torch.save(state, work / "saved.pt")
    location = server.new_location()
    _run([*CLI, "init", location], env)
    _run([*CLI, "commit", str(work / "save"), "--step", "1", "--store", location, "--quiet"], env)
    before, began = len(relay.answered), time.perf_counter()
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", LOAD, location, str(work / "saved.pt")],
            env={**env, "LOCAL_RANK": str(r), "LOCAL_WORLD_SIZE": str(ranks)},
            cwd=env["TAILOR_BENCH_TREE"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for r in range(ranks)
    ]
    for p in procs:
        _, err = p.communicate(timeout=1800)
        if p.returncode != 0:
            raise SystemExit(f"a rank's load failed: {err[-3000:]}")
    seconds = time.perf_counter() - began
    fetched, gets = _fetched(relay, before)
    stored = _stored(server, location)
    return {"stored": stored, "fetched": fetched, "gets": gets, "ratio": fetched / stored, "seconds": seconds}


def deepspeed_case(server: LocalS3, relay: Relay, work: Path, ranks: int, tree: Path | None) -> dict:
    env = _env(server, relay, work / "node", tree)
    location = server.new_location()
    _run([*CLI, "init", location], env)
    train = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks),
        "--master_port", str(29600 + ranks),
        "-m", "testbed.train_tiny", "--tailor-engine", "--commit-to", location, "--stage", "2",
        "--dim", "128", "--layers", "4", "--hidden", "344",
    ]  # fmt: skip
    _run([*train, "--save-dir", str(work / "first"), "--steps", "3", "--save-every", "3"], env)
    before, began = len(relay.answered), time.perf_counter()
    _run([*train, "--save-dir", str(work / "again"), "--resume-from", str(work / "again"), "--steps", "4",
          "--save-every", "100"], env)  # fmt: skip
    seconds = time.perf_counter() - began
    fetched, gets = _fetched(relay, before)
    stored = _stored(server, location)
    return {"stored": stored, "fetched": fetched, "gets": gets, "ratio": fetched / stored, "seconds": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--integrations", nargs="+", default=["dcp", "deepspeed"])
    parser.add_argument("--mb", type=int, default=32, help="the DCP case's tensor megabytes")
    parser.add_argument("--old", type=Path, default=None, help="a worktree of an earlier commit, measured beside")
    args = parser.parse_args()
    server = LocalS3().start()
    results = []
    try:
        with Relay(server.port) as relay:
            for integration in args.integrations:
                for ranks in args.ranks:
                    for tree in ([args.old] if args.old else []) + [None]:
                        with tempfile.TemporaryDirectory(prefix="node-reads-") as tmp:
                            work = Path(tmp)
                            if integration == "dcp":
                                got = dcp_case(server, relay, work, ranks, args.mb, tree)
                            else:
                                got = deepspeed_case(server, relay, work, ranks, tree)
                        got.update(integration=integration, ranks=ranks, tree=str(tree) if tree else "this")
                        print(json.dumps(got), flush=True)
                        results.append(got)
    finally:
        server.stop()
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
