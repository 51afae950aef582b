"""One launch of the job-life simulation (testbed/job_life.py): a tiny DeepSpeed training through
``attach``, as the README shows it, that resumes from the store, saves every few steps, and may
be killed at a named point of its life.

Each rank writes what it decided and saw to ``--report-dir/rank{R}.json`` as soon as it knows it
(the resume's step and the digest of the weights it loaded, then each step's loss), so that a
launch killed later still tells the harness what its ranks decided. Global rank 0 writes a
*witness* for every save before it hands the save to DeepSpeed: the digest of the weights that
save holds, which the harness compares with what a later resume loads.

Kill points this script owns (``--kill-at``); the store's own points and requests are reached
through ``TAILOR_FAILPOINTS`` (``commit/put=kill@N``, ``commit/put-create=kill``, ...):

- ``before-save``: at the save of ``--kill-step``, before ``save_checkpoint``;
- ``after-save``: as soon as ``save_checkpoint`` of ``--kill-step`` returns (the background copy,
  the staging writes and the commit may all still be under way);
- ``after-save-delay``: ``--kill-delay`` seconds after it returns, training meanwhile;
- ``next-step``: once the training step after that save is done;
- ``after-load``: once the resume has loaded, before any training step.

``--kill-rank`` names the rank that kills itself (``all``: every rank); the launcher then ends
the others, as torchrun does.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import signal
import threading
import time
from pathlib import Path

import torch
import xxhash

from tailorstore.api import Store
from tailorstore.integrations.deepspeed import attach, load_checkpoint
from tailorstore.integrations.deepspeed.head import read_head
from testbed import train_tiny
from testbed.teardown import exit_without_teardown

KILL_POINTS = ("before-save", "after-save", "after-save-delay", "next-step", "after-load")


def parser() -> argparse.ArgumentParser:
    """The flags every launch script of the simulation takes (testbed/job_life_dcp.py adds its own)."""
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--save-dir", required=True)
    p.add_argument("--store", required=True)
    p.add_argument("--report-dir", required=True)
    p.add_argument("--witness-dir", required=True)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--save-every", type=int, default=2)
    p.add_argument("--stage", type=int, default=2)
    p.add_argument("--tag", default=None, help="resume from this DeepSpeed tag (a rewind), else from latest")
    p.add_argument("--on-existing", default="branch")
    p.add_argument("--kill-at", choices=KILL_POINTS, default=None)
    p.add_argument("--kill-step", type=int, default=0)
    p.add_argument("--kill-rank", default="0")
    p.add_argument("--kill-delay", type=float, default=0.0)
    p.add_argument("--launch", type=int, default=0, help="this launch's number in the schedule (witness names)")
    p.add_argument("--probe-ref", default=None, help="load this ref straight from the store, report it, train nothing")
    p.add_argument("--data-offset", type=int, default=0, help="train step N on the batch of step N + this")
    p.add_argument("--fresh", action="store_true", help="a first launch that does not call load_checkpoint")
    return p


def kill_here(args: argparse.Namespace, rank: int, point: str, step: int) -> None:
    if args.kill_at != point or (point != "after-load" and step != args.kill_step):
        return
    if args.kill_rank == "all" or int(args.kill_rank) == rank:
        say(args, rank, {"killed_at": point, "killed_step": step})
        os.kill(os.getpid(), signal.SIGKILL)


def kill_later(args: argparse.Namespace, rank: int, step: int) -> None:
    if args.kill_at != "after-save-delay" or step != args.kill_step:
        return
    if args.kill_rank == "all" or int(args.kill_rank) == rank:
        timer = threading.Timer(args.kill_delay, lambda: os.kill(os.getpid(), signal.SIGKILL))
        timer.daemon = True
        timer.start()


_reports: dict[int, dict] = {}


def report_of(rank: int) -> dict:
    return _reports.get(rank, {})


def write_witness(args: argparse.Namespace, rank: int, step: int, digest: str) -> None:
    """Rank 0, before a save: what the job holds as ``step`` (the harness compares a resume with it)."""
    if rank == 0:
        witness = Path(args.witness_dir) / f"launch{args.launch}-step{step}.json"
        witness.write_text(json.dumps({"step": step, "launch": args.launch, "digest": digest}))


def say(args: argparse.Namespace, rank: int, fields: dict) -> None:
    """Merge ``fields`` into this rank's report, written whole (a temp file renamed) each time."""
    report = _reports.setdefault(rank, {"rank": rank, "launch": args.launch})
    report.update(fields)
    path = Path(args.report_dir) / f"rank{rank}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(report))
    os.replace(tmp, path)


def weights_digest(engine: object) -> str:
    """The digest of a DeepSpeed engine's model (:func:`module_digest`)."""
    return module_digest(engine.module)  # type: ignore[attr-defined]


def module_digest(module: torch.nn.Module) -> str:
    """xxh3-128 of every parameter's full value, in name order (ZeRO-3 gathers its partitions)."""
    import deepspeed

    params = list(module.named_parameters())
    digest = xxhash.xxh3_128()
    with deepspeed.zero.GatheredParameters([p for _, p in params], modifier_rank=None):
        for name, param in sorted(params, key=lambda x: x[0]):
            digest.update(name.encode())
            digest.update(param.detach().float().contiguous().cpu().numpy().tobytes())
    return digest.hexdigest()


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    torch.set_num_threads(1)
    import deepspeed

    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None  # as train_tiny: no JIT build
    deepspeed.init_distributed(dist_backend="gloo")
    rank = torch.distributed.get_rank()
    say(args, rank, {"world_size": torch.distributed.get_world_size(), "pid": os.getpid()})

    base = train_tiny.parse_args(["--save-dir", args.save_dir, "--stage", str(args.stage), "--layers", "2"])
    torch.manual_seed(base.seed)
    model = train_tiny.TinyLlama(base.vocab, base.dim, base.layers, base.heads, base.hidden)
    optimizer = torch.optim.AdamW(model.parameters(), lr=base.lr)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=train_tiny.ds_config(base))

    leader = rank == 0 or os.environ.get("LOCAL_RANK", "0") == "0"
    store = Store.open(args.store) if leader else None
    if args.probe_ref:  # what the store holds under a ref, read from the store alone (no folder on disk)
        _, client_state = load_checkpoint(engine, store, args.probe_ref)
        step = int(client_state["my_step"])
        say(args, rank, {"resumed": True, "resumed_step": step, "loaded_digest": weights_digest(engine)})
        exit_without_teardown()
        return
    tailor = attach(engine, store, on_existing=args.on_existing)
    say(args, rank, {"attached": True})

    load_path, client_state = (None, None) if args.fresh else engine.load_checkpoint(args.save_dir, tag=args.tag)
    start = int(client_state["my_step"]) if load_path is not None and client_state else 0
    say(args, rank, {"resumed": load_path is not None, "resumed_step": start, "loaded_digest": weights_digest(engine)})
    if rank == 0 and store is not None:  # what was durable when the job decided (after its recovery)
        head = read_head(Path(args.save_dir))
        run = head.run if head is not None else store.run
        say(args, rank, {"head_run_at_resume": run, "store_steps_at_resume": [s.step for s in store.log(run=run)]})
    kill_here(args, rank, "after-load", start)

    losses: dict[str, str] = {}
    for step in range(start + 1, args.steps + 1):
        tokens = train_tiny.DATA[base.data](step + args.data_offset, rank, base.micro_batch, base.seq, base.vocab)
        loss = engine(tokens)
        engine.backward(loss)
        engine.step()
        losses[str(step)] = loss.item().hex()
        say(args, rank, {"losses": losses})
        kill_here(args, rank, "next-step", step - 1)
        if step % args.save_every == 0:
            digest = weights_digest(engine)  # collective under ZeRO-3: every rank takes part
            write_witness(args, rank, step, digest)
            kill_here(args, rank, "before-save", step)
            engine.save_checkpoint(args.save_dir, client_state={"my_step": step})
            kill_here(args, rank, "after-save", step)
            kill_later(args, rank, step)
            say(args, rank, {"saved": [*report_of(rank).get("saved", []), step]})
    tailor.flush()
    say(args, rank, {"finished": True, "finished_at": time.time()})
    exit_without_teardown()


if __name__ == "__main__":
    main()
