"""Many hosts, one step: N processes each commit one part to one S3 bucket, then one finalize.

``python -m benchmarks.many_hosts [--hosts 1 2 4 8 16]`` makes a DeepSpeed step of N ranks
(tests/data/format1's save, resharded to N ranks by the store itself), starts a local S3 server
(moto, 127.0.0.1), and for each N: N ``tailor commit --part`` processes at once, each with its
own index cache, holding the model states and its own rank's optimizer file, then one
``Store.finalize`` in this process. Reported: the parts' wall time, the finalize's wall time and
its S3 requests (counted by a relay in front of the server while it runs), median of --repeats.
With ``--latency-ms 20`` the relay holds every request back that long, as a real endpoint's
first-byte latency does (a local server has none), so that what the finalize does in parallel
shows as it would against S3.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tailorstore import Store
from tailorstore.integrations.common import StoreSession
from testbed.local_s3 import CuttableLink, local_s3

SAVE = Path(__file__).resolve().parent.parent / "tests" / "data" / "format1" / "checkpoint"


def shares(work: Path, hosts: int) -> list[Path]:
    """The step at ``hosts`` ranks, cut into one folder per host: model states and its rank's file."""
    with Store.init(work / "source") as store:
        store.commit(SAVE)
        tag = store.checkout("latest", work / "whole", world_size=hosts).tag
    out = []
    for rank in range(hosts):
        folder = work / f"host{rank}" / tag
        folder.mkdir(parents=True)
        for path in (work / "whole" / tag).iterdir():
            if path.name.startswith("mp_rank_") or f"_rank_{rank}_" in path.name:
                shutil.copy(path, folder / path.name)
        out.append(folder)
    return out


def one(server_location: str, folders: list[Path], work: Path, link: CuttableLink) -> dict:
    Store.init(server_location).close()
    env = dict(os.environ, TAILOR_STORE=server_location, AWS_ENDPOINT_URL=link.endpoint)
    began = time.perf_counter()
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "tailorstore.cli.app", "commit", str(folder), "--part", "--quiet"],
            env=env | {"TAILOR_CACHE": str(work / f"cache{i}")},
        )
        for i, folder in enumerate(folders)
    ]
    codes = [p.wait() for p in procs]
    parts_wall = time.perf_counter() - began
    if any(codes):
        raise SystemExit(f"a part's commit failed: {codes}")
    direct = os.environ["AWS_ENDPOINT_URL"]
    os.environ["AWS_ENDPOINT_URL"] = link.endpoint  # this process's finalize goes through the relay too
    try:
        with Store.open(server_location) as store:
            link.reset_counts()
            began = time.perf_counter()
            store.finalize(3)
            finalize_wall = time.perf_counter() - began
            requests = sum(link.requests.values())
            assert [s.step for s in store.log()] == [3] and StoreSession(store).parts(3) == []
    finally:
        os.environ["AWS_ENDPOINT_URL"] = direct
    return {"parts_wall": parts_wall, "finalize_wall": finalize_wall, "finalize_requests": requests}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--hosts", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--latency-ms", type=float, default=0.0, help="hold each S3 request back this long")
    args = parser.parse_args()
    rows = []
    with local_s3() as server:
        link = CuttableLink(server.port, delay=args.latency_ms / 1000)
        for hosts in args.hosts:
            work = Path(tempfile.mkdtemp(prefix="tailor-hosts-"))
            try:
                folders = shares(work, hosts)
                found = [one(server.new_location(), folders, work / f"r{i}", link) for i in range(args.repeats)]
            finally:
                shutil.rmtree(work, ignore_errors=True)
            medians = {k: statistics.median(r[k] for r in found) for k in found[0]}
            rows.append({"hosts": hosts, "latency_ms": args.latency_ms} | medians)
            print(json.dumps(rows[-1]), flush=True)
    print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
