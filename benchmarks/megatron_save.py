"""Megatron-Core through the store against today's path: ``dist_checkpointing.save`` to local disk
then ``tailor commit`` of the folder, against ``TailorSaveShardedStrategy`` (the tensors straight
into the store); and Megatron's own ``load`` of the raw folder at another tensor-parallel size,
against ``TailorLoadShardedStrategy`` (the tensors straight from the store).

``python -m benchmarks.megatron_save [--hidden 256 --layers 4 --vocab 32000 --saves 3]`` runs one job
of 2 CPU ranks (the ``GPTModel`` of ``testbed.train_megatron``, tensor parallel 2, bf16 with FP32
main parameters and Adam's moments). Before each save it trains one step, then saves that state
both ways, alternating which goes first: ``raw`` (Megatron's save to a folder, then rank 0 commits
it into store A while the other rank waits) and ``strategy`` (into store B). Then one job of 1 rank
loads the last step at TP 1 both ways, alternating, ``--repeats`` times after an untimed load of
each. Each time is the slowest rank's. The page cache is not dropped (other work shares this
machine): the raw folder is read from memory, the store's blobs as they lie. Prints one JSON line.
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


def _size(args: argparse.Namespace) -> dict[str, int]:
    return {"hidden": args.hidden, "layers": args.layers, "vocab": args.vocab}


def save_job(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    from tailorstore import Store
    from tailorstore.integrations.megatron import TailorSaveShardedStrategy
    from testbed.megatron_cpu import cpu_shims, init_parallel
    from testbed.train_megatron import Trainer

    cpu_shims()
    init_parallel(2)
    rank = dist.get_rank()
    work = Path(args.work)
    trainer = Trainer(2, torch.bfloat16, **_size(args))
    strategy = TailorSaveShardedStrategy(work / "store-b")
    times: dict[str, list[float]] = {"raw_save": [], "raw_commit": [], "raw": [], "strategy": []}

    def timed(fn) -> float:
        dist.barrier()
        began = time.perf_counter()
        fn()
        dist.barrier()
        return time.perf_counter() - began

    for i in range(args.saves):
        trainer.train_step()
        folder = work / "raw" / f"iter_{trainer.step:07d}"
        stub = work / "stub" / f"iter_{trainer.step:07d}"
        if rank == 0:
            folder.mkdir(parents=True)
            stub.mkdir(parents=True)

        def raw(folder: Path = folder) -> None:
            save = timed(lambda: dist_checkpointing.save(trainer.sharded_state_dict(), str(folder)))

            def commit() -> None:
                if rank == 0:
                    with Store.open(work / "store-a") as store:
                        store.commit(folder)

            times["raw_save"].append(save)
            times["raw_commit"].append(timed(commit))
            times["raw"].append(save + times["raw_commit"][-1])

        def through(stub: Path = stub) -> None:
            state = trainer.sharded_state_dict()
            times["strategy"].append(
                timed(lambda: dist_checkpointing.save(state, str(stub), sharded_strategy=strategy))
            )

        for way in (raw, through) if i % 2 == 0 else (through, raw):
            way()
    if rank == 0:
        (work / "save-times.json").write_text(json.dumps(times))
    dist.destroy_process_group()


def load_job(args: argparse.Namespace) -> None:
    import torch
    from megatron.core import dist_checkpointing

    from tailorstore.integrations.megatron import TailorLoadShardedStrategy
    from testbed.megatron_cpu import cpu_shims, init_parallel
    from testbed.train_megatron import Trainer

    cpu_shims()
    init_parallel(1)
    work = Path(args.work)
    last = sorted((work / "raw").iterdir())[-1]
    trainer = Trainer(1, torch.bfloat16, **_size(args))
    strategy = TailorLoadShardedStrategy(work / "store-b", "latest")
    times: dict[str, list[float]] = {"raw": [], "strategy": []}
    ways = {
        "raw": lambda: dist_checkpointing.load(trainer.sharded_state_dict(), str(last)),
        "strategy": lambda: dist_checkpointing.load(
            trainer.sharded_state_dict(), str(work / "stub" / last.name), sharded_strategy=strategy
        ),
    }
    loaded = {name: way() for name, way in ways.items()}  # untimed, and compared
    same = all(torch.equal(a, b) for a, b in zip(_tensors(loaded["raw"]), _tensors(loaded["strategy"]), strict=True))
    for i in range(args.repeats):
        for name in ("raw", "strategy") if i % 2 == 0 else ("strategy", "raw"):
            began = time.perf_counter()
            ways[name]()
            times[name].append(time.perf_counter() - began)
    (work / "load-times.json").write_text(json.dumps({"times": times, "identical": same}))


def _tensors(tree: object) -> list:
    import torch

    if isinstance(tree, dict):
        return [t for k in sorted(tree, key=str) for t in _tensors(tree[k])]
    if isinstance(tree, list | tuple):
        return [t for v in tree for t in _tensors(v)]
    return [tree] if isinstance(tree, torch.Tensor) else []


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--saves", type=int, default=3)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    from tailorstore import Store

    with tempfile.TemporaryDirectory(prefix="tailor-megatron-") as tmp:
        work = Path(tmp)
        for name in ("store-a", "store-b"):
            Store.init(work / name).close()
        flags = ["--hidden", str(args.hidden), "--layers", str(args.layers), "--vocab", str(args.vocab)]
        flags += ["--saves", str(args.saves), "--repeats", str(args.repeats)]
        torchrun("benchmarks.megatron_save", ["--save-job", str(work), *flags], nproc=2, log=work / "save.log")
        torchrun("benchmarks.megatron_save", ["--load-job", str(work), *flags], nproc=1, log=work / "load.log")
        saves = json.loads((work / "save-times.json").read_text())
        loads = json.loads((work / "load-times.json").read_text())
        raw_bytes = sum(p.stat().st_size for p in (work / "raw").rglob("*") if p.is_file())
        with Store.open(work / "store-b") as store:
            stored = store.usage().stored_bytes
        med = {k: round(statistics.median(v), 3) for k, v in saves.items()}
        load = {k: round(statistics.median(v), 3) for k, v in loads["times"].items()}
        series = {"raw_folders_bytes": raw_bytes, "store_bytes": stored, "smaller_by": round(raw_bytes / stored, 3)}
        print(json.dumps({
            "save": {**med, "ratio_to_today": round(med["strategy"] / med["raw"], 3)},
            "load_tp1": {**load, "ratio": round(load["strategy"] / load["raw"], 3), "identical": loads["identical"]},
            "series": series,
            "times": {"save": saves, "load": loads["times"]},
        }))  # fmt: skip
    return 0


def _job(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("work")
    for flag in ("--hidden", "--layers", "--vocab", "--saves", "--repeats"):
        p.add_argument(flag, type=int)
    return p.parse_args(argv)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--save-job":
        save_job(_job(sys.argv[2:]))
    elif len(sys.argv) > 1 and sys.argv[1] == "--load-job":
        load_job(_job(sys.argv[2:]))
    else:
        sys.exit(main())
