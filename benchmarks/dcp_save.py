"""``dcp.save`` through TailorStorageWriter against today's path (``dcp.save`` to local disk, then
``tailor commit`` of the folder), sync and async, over a series of saves.

``python -m benchmarks.dcp_save [--hidden 512 --layers 8 --vocab 32000 --saves 3]`` runs one job of
2 CPU ranks (FSDP2, AdamW, FP32 parameters; the tiny Llama of ``testbed.train_fsdp``). Before each
save it trains one step, then saves that one state every way, alternating which goes first:

- ``raw``: ``dcp.save`` to a folder (``FileSystemWriter``), then ``commit``: rank 0 commits the
  folder into store A while the other rank waits (today's path is ``raw`` plus ``commit``);
- ``writer``: ``dcp.save(storage_writer=TailorStorageWriter(...))`` into store B;
- ``raw-async`` and ``writer-async``: ``dcp.async_save`` (thread checkpointer, its own gloo group),
  timed to its return (the stall) and to its future's end (the step on disk, or durable in store B's
  twin C).

Each time is the slowest rank's. At the end every step of store B is checked out and compared byte
for byte with its raw folder's ``.distcp`` files, and the sizes of the raw folders and of store B
are compared. Prints one JSON line. The CPUs here are shared by both ranks and every commit thread.
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

WAYS = ("raw", "writer", "raw-async", "writer-async")


def rank_job(argv: list[str]) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("work")
    p.add_argument("--hidden", type=int)
    p.add_argument("--layers", type=int)
    p.add_argument("--vocab", type=int)
    p.add_argument("--saves", type=int)
    args = p.parse_args(argv)

    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
    from torch.distributed.fsdp import fully_shard

    from tailorstore import Store
    from tailorstore.integrations.dcp.writer import TailorStorageWriter
    from testbed.train_fsdp import batch, build_model

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(backend="gloo")  # the async saves' collectives, as torchtitan does
    work = Path(args.work)
    model = build_model(args.layers, args.hidden, args.vocab)
    for block in model.model.layers:
        fully_shard(block)
    fully_shard(model)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    stores = {name: Store.open(work / name) for name in ("A", "B", "C")}

    def slowest(seconds: float) -> float:
        value = torch.tensor([seconds], dtype=torch.float64)
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return float(value)

    def save(way: str, state: dict, step: int) -> dict[str, float]:
        folder = work / way / f"step-{step}"
        dist.barrier()
        began = time.perf_counter()
        if way == "raw":
            dcp.save(state, checkpoint_id=str(folder))
            saved = slowest(time.perf_counter() - began)
            began = time.perf_counter()
            if rank == 0:
                stores["A"].commit(folder)
            dist.barrier()
            return {"save": saved, "commit": slowest(time.perf_counter() - began)}
        if way == "writer":
            dcp.save(state, storage_writer=TailorStorageWriter(stores["B"], step=step))
            return {"save": slowest(time.perf_counter() - began)}
        where = (
            {"checkpoint_id": str(folder)}
            if way == "raw-async"
            else {"storage_writer": TailorStorageWriter(stores["C"], step=step)}
        )
        future = dcp.async_save(
            state, async_checkpointer_type=AsyncCheckpointerType.THREAD, process_group=group, **where
        )
        stall = time.perf_counter() - began
        future.result()
        done = time.perf_counter() - began
        return {"stall": slowest(stall), "done": slowest(done)}

    times: dict[str, list[dict[str, float]]] = {way: [] for way in WAYS}
    for n in range(args.saves):
        step = n + 1
        ids = batch(step, rank, world, args.vocab)
        model(input_ids=ids, labels=ids).loss.backward()
        optim.step()
        optim.zero_grad()
        msd, osd = get_state_dict(model, optim)
        state = {"model": msd, "optim": osd, "train": {"step": step}}
        order = WAYS if n % 2 == 0 else tuple(reversed(WAYS))
        for way in order:
            times[way].append(save(way, state, step))
    if rank == 0:
        (work / "times.json").write_text(json.dumps(times))
    for store in stores.values():
        store.close()
    dist.barrier()
    dist.destroy_process_group()


def _median(rows: list[dict[str, float]], key: str) -> float:
    return round(statistics.median(r[key] for r in rows), 3)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--saves", type=int, default=3)
    args = p.parse_args()
    size = ["--hidden", str(args.hidden), "--layers", str(args.layers), "--vocab", str(args.vocab)]
    from tailorstore import Store

    with tempfile.TemporaryDirectory(prefix="dcp-save-") as work_dir:
        work = Path(work_dir)
        for name in ("A", "B", "C"):
            Store.init(work / name).close()
        torchrun("benchmarks.dcp_save", ["--rank-job", str(work), *size, "--saves", str(args.saves)], log=work / "log")
        times = json.loads((work / "times.json").read_text())
        raw_folders = [work / "raw" / f"step-{n + 1}" for n in range(args.saves)]
        raw_bytes = sum(f.stat().st_size for d in raw_folders for f in d.iterdir())
        identical = True
        with Store.open(work / "B") as store:
            stored = store.usage().stored_bytes
            for n, folder in enumerate(raw_folders):
                out = work / f"out-{n + 1}"
                store.checkout(f"step={n + 1}", out)
                identical &= all(
                    (out / f.name).read_bytes() == f.read_bytes() for f in folder.iterdir() if f.suffix == ".distcp"
                )
            verified = store.verify(deep=True).ok
        today = [r["save"] + r["commit"] for r in times["raw"]]
        writer = [r["save"] for r in times["writer"]]
        results = {
            "size": size,
            "saves": args.saves,
            "raw_bytes_per_save": raw_bytes // args.saves,
            "sync": {
                "dcp_save_s": _median(times["raw"], "save"),
                "commit_s": _median(times["raw"], "commit"),
                "today_s": round(statistics.median(today), 3),
                "writer_s": round(statistics.median(writer), 3),
                "ratio_to_today": round(statistics.median(writer) / statistics.median(today), 3),
                "ratio_to_dcp_save": round(statistics.median(writer) / _median(times["raw"], "save"), 3),
            },
            "async": {
                "raw_stall_s": _median(times["raw-async"], "stall"),
                "writer_stall_s": _median(times["writer-async"], "stall"),
                "raw_done_s": _median(times["raw-async"], "done"),
                "writer_durable_s": _median(times["writer-async"], "done"),
                "durable_ratio": round(_median(times["writer-async"], "done") / _median(times["raw-async"], "done"), 3),
            },
            "series": {
                "raw_folders_bytes": raw_bytes,
                "store_bytes": stored,
                "smaller_by": round(raw_bytes / stored, 3),
            },
            "checked_out_identical": identical,
            "verified": verified,
            "times": times,
        }
        print(json.dumps(results))
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--rank-job":
        rank_job(sys.argv[2:])
    else:
        sys.exit(main())
