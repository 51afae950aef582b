"""DCP's own save on a GPU, the baseline a snapshot stall is measured against.

``torchrun --standalone --nproc_per_node 1 -m benchmarks.dcp_stall --out DIR [model flags]``
trains one step of the same model as ``testbed.train_tiny`` (bf16 weights, AdamW), then times
``dcp.save`` of ``get_state_dict(model, optimizer)`` (blocking, the whole save) and
``dcp.async_save`` (the time it blocks the caller, then the time until its future is done),
and prints one JSON line: DCP alone, without tailorstore, so that what DCP's users get on the
same card can be set beside the store's own DCP writer.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict

from testbed.train_tiny import TinyLlama


def folder_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", required=True)
    for name, default in (("vocab", 32000), ("dim", 1024), ("layers", 24), ("heads", 16), ("hidden", 2816)):
        p.add_argument(f"--{name}", type=int, default=default)
    args = p.parse_args()
    dist.init_process_group("cpu:gloo,cuda:nccl")
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    model = TinyLlama(args.vocab, args.dim, args.layers, args.heads, args.hidden).cuda().to(torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(0, args.vocab, (4, 256), device="cuda")
    model(tokens).backward()
    optimizer.step()
    torch.cuda.synchronize()
    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    began = time.perf_counter()
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(out / "sync"))
    sync = time.perf_counter() - began
    began = time.perf_counter()
    future = dcp.async_save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(out / "async"))
    blocked = time.perf_counter() - began
    future.result()
    done = time.perf_counter() - began
    report = {
        "bytes": folder_bytes(out / "sync"),
        "dcp_save_seconds": sync,
        "dcp_async_save_blocked_seconds": blocked,
        "dcp_async_save_done_seconds": done,
    }
    print(json.dumps(report), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
