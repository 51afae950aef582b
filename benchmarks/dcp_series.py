"""A DCP series as FSDP2 writes it: the store's ratio, whole-process commit and checkout against
``cp -r`` + ``sync``, and export against DCP's own consolidation plus a safetensors save.

``python -m benchmarks.dcp_series [--hidden 512 --layers 8 --vocab 8192 --steps 12 --every 3 --repeats 3]``
trains the tiny Llama of ``testbed.train_fsdp`` at the given size on 2 CPU ranks (FSDP2, AdamW,
FP32 parameters), saving ``step-N/`` with ``dcp.save`` every ``--every`` steps; then, with every
save in the page cache first:

- commits the series into a fresh store (``tailor commit``, one process a save, start-up included),
  ``--repeats`` times; ratio: the raw bytes of the series over the store's bytes;
- checks out the last step (``tailor checkout``) against ``cp -r`` + ``sync`` of the same folder;
- exports the last step to a Hugging Face folder in bf16 (``tailor export``) against
  ``dcp_to_torch_save`` then ``safetensors.torch.save_file`` of its model tensors in bf16, each a
  fresh process.

Medians of the repeats; CPU seconds are the children's user + system time. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.suite import copy_and_sync, dir_bytes, warm
from testbed.runs import torchrun

CONSOLIDATE = """
import sys, torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from safetensors.torch import save_file
dcp_to_torch_save(sys.argv[1], sys.argv[2] + "/full.pt")
state = torch.load(sys.argv[2] + "/full.pt", weights_only=True)
model = {k[len("model."):]: v.to(torch.bfloat16).contiguous() for k, v in state.items() if k.startswith("model.")}
save_file(model, sys.argv[2] + "/model.safetensors")
"""


def run(cmd: list[str], env: dict[str, str] | None = None) -> tuple[float, float]:
    """(wall seconds, CPU seconds of the child) of one process."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    began = time.perf_counter()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - began
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {done.stderr[-2000:]}")
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def tailor(*args: str, store: Path) -> tuple[float, float]:
    env = dict(os.environ, TAILOR_STORE=str(store))
    return run([sys.executable, "-m", "tailorstore.cli.app", *args], env)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--every", type=int, default=3)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--work", default=None)
    args = p.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="tailor-dcp-bench-"))
    saves = work / "saves"
    if not (saves / f"step-{args.steps}").is_dir():
        shutil.rmtree(saves, ignore_errors=True)
        size = ["--hidden", str(args.hidden), "--layers", str(args.layers), "--vocab", str(args.vocab)]
        every = ["--steps", str(args.steps), "--save-every", str(args.every)]
        torchrun("testbed.train_fsdp", ["--output-dir", str(saves), *size, *every], log=work / "train.log")
    steps = sorted(int(d.name.split("-")[1]) for d in saves.iterdir() if d.name.startswith("step-"))
    last = saves / f"step-{steps[-1]}"
    raw = sum(dir_bytes(saves / f"step-{s}") for s in steps)
    config = work / "config"
    if not (config / "config.json").is_file():
        from testbed.train_fsdp import build_model

        build_model(args.layers, args.hidden, args.vocab).config.save_pretrained(config)
    names = ("commit", "commit_cpu", "copy", "checkout", "checkout_cpu", "checkout_copy")
    rows: dict[str, list[float]] = {k: [] for k in (*names, "export", "export_cpu", "own", "own_cpu")}
    stored = 0
    for r in range(args.repeats):
        store = work / f"store{r}"
        shutil.rmtree(store, ignore_errors=True)
        tailor("init", str(store), store=store)
        for s in steps:
            folder = saves / f"step-{s}"
            warm(folder)
            wall, cpu = tailor("commit", str(folder), "--quiet", store=store)
            rows["commit"].append(wall)
            rows["commit_cpu"].append(cpu)
            warm(folder)
            rows["copy"].append(copy_and_sync(folder, work / f"copy-{r}-{s}"))
            shutil.rmtree(work / f"copy-{r}-{s}")
        stored = dir_bytes(store)
        out = work / f"out{r}"
        shutil.rmtree(out, ignore_errors=True)
        wall, cpu = tailor("checkout", "latest", "--out", str(out), store=store)
        rows["checkout"].append(wall)
        rows["checkout_cpu"].append(cpu)
        shutil.rmtree(out)
        warm(last)
        rows["checkout_copy"].append(copy_and_sync(last, work / f"copy-{r}"))
        shutil.rmtree(work / f"copy-{r}")
        hf = work / f"hf{r}"
        shutil.rmtree(hf, ignore_errors=True)
        wall, cpu = tailor("export", "latest", "--out", str(hf), "--dtype", "bf16", "--config",
                           str(config / "config.json"), store=store)  # fmt: skip
        rows["export"].append(wall)
        rows["export_cpu"].append(cpu)
        own = work / f"own{r}"
        shutil.rmtree(own, ignore_errors=True)
        own.mkdir()
        warm(last)
        wall, cpu = run([sys.executable, "-c", CONSOLIDATE, str(last), str(own)])
        rows["own"].append(wall)
        rows["own_cpu"].append(cpu)
        shutil.rmtree(hf)
        shutil.rmtree(own)
        if r < args.repeats - 1:
            shutil.rmtree(store)
    med = {k: statistics.median(v) for k, v in rows.items()}
    result = {
        "saves": len(steps), "raw_bytes": raw, "stored_bytes": stored, "ratio": raw / stored,
        "save_bytes": dir_bytes(last), **{k: round(v, 3) for k, v in med.items()},
        "commit_over_copy": med["commit"] / med["copy"], "checkout_over_copy": med["checkout"] / med["checkout_copy"],
        "export_over_own": med["export"] / med["own"],
    }  # fmt: skip
    print(json.dumps(result))


if __name__ == "__main__":
    main()
