"""``dcp.load`` through TailorStorageReader against ``dcp.load`` of the raw folder from local disk,
at the save's world size and at another, the state compared bit for bit.

``python -m benchmarks.dcp_load [--hidden 512 --layers 8 --vocab 32000 --repeats 3]`` trains the tiny
Llama of ``testbed.train_fsdp`` on 2 CPU ranks (FSDP2, AdamW, FP32 parameters) for two steps and
saves step 2 with ``dcp.save``, commits it into a fresh local store, then runs a load job at 2
ranks and at 1 (DCP reshards the two ranks' chunks). Each job builds the sharded model and
optimizer, then times, ``--repeats`` times and alternating which goes first, ``dcp.load`` of the
folder (page cache warm: each is read once before timing) and ``dcp.load`` with the reader, each
into a fresh state dict; every rank checks that the two loads gave the same tensors and objects.
The slowest rank's time counts. Prints one JSON line.

With ``--cold`` the page cache is dropped before each timed load (root), as when a job restarts
later or on a node that did not write the save: the raw folder is then read from the disk, as the
store's blobs always are (they are written and read around the page cache).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from testbed.runs import torchrun


def rank_job(argv: list[str]) -> None:
    """One load job (run under torchrun): time both loads, check they agree, write rank 0's JSON."""
    p = argparse.ArgumentParser()
    p.add_argument("folder")
    p.add_argument("store")
    p.add_argument("out")
    p.add_argument("--hidden", type=int)
    p.add_argument("--layers", type=int)
    p.add_argument("--vocab", type=int)
    p.add_argument("--repeats", type=int)
    p.add_argument("--cold", action="store_true")
    args = p.parse_args(argv)

    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.fsdp import fully_shard

    from benchmarks.suite import drop_caches
    from tailorstore import Store
    from tailorstore.integrations.dcp.reader import TailorStorageReader
    from testbed.train_fsdp import build_model

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    model = build_model(args.layers, args.hidden, args.vocab)
    for block in model.model.layers:
        fully_shard(block)
    fully_shard(model)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    store = Store.open(args.store)

    def fresh() -> dict:
        msd, osd = get_state_dict(model, optim)
        state = {"model": msd, "optim": osd, "train": {"step": 0}}
        return torch.utils._pytree.tree_map(  # separate memory for each load, so both can be compared
            lambda t: t.clone() if isinstance(t, torch.Tensor) else t, state
        )

    def load(way: str) -> tuple[float, dict]:
        state = fresh()
        if args.cold:
            dist.barrier()
            if dist.get_rank() == 0 and not drop_caches():
                raise SystemExit("--cold needs to write /proc/sys/vm/drop_caches (root)")
        dist.barrier()
        began = time.perf_counter()
        if way == "raw":
            dcp.load(state, checkpoint_id=args.folder)
        else:
            dcp.load(state, storage_reader=TailorStorageReader(store, "latest"))
        seconds = torch.tensor([time.perf_counter() - began], dtype=torch.float64)
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX)  # the slowest rank's
        return float(seconds), state

    load("raw"), load("store")  # page cache and first-use costs, for both
    times: dict[str, list[float]] = {"raw": [], "store": []}
    same = True
    for repeat in range(args.repeats):
        order = ("raw", "store") if repeat % 2 == 0 else ("store", "raw")
        states = {}
        for way in order:
            seconds, states[way] = load(way)
            times[way].append(seconds)
        flat_raw, _ = torch.utils._pytree.tree_flatten(states["raw"])
        flat_store, _ = torch.utils._pytree.tree_flatten(states["store"])
        for a, b in zip(flat_raw, flat_store, strict=True):
            if isinstance(a, torch.Tensor):
                a, b = getattr(a, "_local_tensor", a), getattr(b, "_local_tensor", b)
                same &= a.dtype == b.dtype and bool(torch.equal(a, b))
            else:
                same &= a == b
    agreed = torch.tensor([int(same)])
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps({"times": times, "identical": bool(agreed.item())}))
    store.close()
    dist.barrier()
    dist.destroy_process_group()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--cold", action="store_true", help="drop the page cache before each timed load (root)")
    args = p.parse_args()
    size = ["--hidden", str(args.hidden), "--layers", str(args.layers), "--vocab", str(args.vocab)]
    from tailorstore import Store

    with tempfile.TemporaryDirectory(prefix="dcp-load-") as work_dir:
        work = Path(work_dir)
        torchrun(
            "testbed.train_fsdp",
            ["--output-dir", str(work / "run"), "--steps", "2", "--save-every", "2", *size],
            log=work / "train.log",
        )
        folder = work / "run" / "step-2"
        with Store.init(work / "store") as store:
            store.commit(folder)
        raw_bytes = sum(f.stat().st_size for f in folder.iterdir())
        stored = sum(f.stat().st_size for f in (work / "store").rglob("*") if f.is_file())
        results = {"raw_bytes": raw_bytes, "store_bytes": stored, "cold": args.cold, "size": size}
        for nproc in (2, 1):
            out = work / f"load-{nproc}.json"
            job = [str(folder), str(work / "store"), str(out), *size, "--repeats", str(args.repeats)]
            job += ["--cold"] if args.cold else []
            torchrun("benchmarks.dcp_load", ["--rank-job", *job], nproc=nproc, log=work / f"load-{nproc}.log")
            found = json.loads(out.read_text())
            raw, ours = statistics.median(found["times"]["raw"]), statistics.median(found["times"]["store"])
            results[f"ranks_{nproc}"] = {
                "raw_s": round(raw, 3),
                "store_s": round(ours, 3),
                "ratio": round(ours / raw, 3),
                "identical": found["identical"],
                "times": found["times"],
            }
        print(json.dumps(results))
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--rank-job":
        rank_job(sys.argv[2:])
    else:
        sys.exit(main())
