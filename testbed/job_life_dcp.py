"""One launch of the job-life simulation's DCP schedules (testbed/job_life.py): a tiny FSDP2
training that saves through ``TailorStorageWriter`` (``dcp.save``, or ``dcp.async_save`` with
DCP's thread stager) and resumes through ``TailorStorageReader(store, "latest")``.

Reports, witnesses and kill points are those of testbed/job_life_train.py (the same flags), so the
harness checks one set of invariants over both. Whether there is anything to resume is decided
once, on rank 0, and broadcast: a user's script that asked the store on every rank would race a
commit of another host between its ranks' questions.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import xxhash

from testbed import job_life_train as common
from testbed.teardown import exit_without_teardown
from testbed.train_fsdp import build_model, sharded, train_step


def weights_digest(model: torch.nn.Module) -> str:
    """xxh3-128 of every parameter's full value, in name order (the FSDP2 shards gathered)."""
    digest = xxhash.xxh3_128()
    for name, param in sorted(model.named_parameters(), key=lambda x: x[0]):
        full = param.full_tensor() if hasattr(param, "full_tensor") else param
        digest.update(name.encode())
        digest.update(full.detach().float().contiguous().cpu().numpy().tobytes())
    return digest.hexdigest()


def main(argv: list[str] | None = None) -> None:
    p = common.parser()
    p.add_argument("--async-save", action="store_true", help="dcp.async_save with DCP's thread stager")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    common.say(args, rank, {"world_size": dist.get_world_size(), "pid": os.getpid()})

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from tailorstore.api import Store
    from tailorstore.integrations.dcp.reader import TailorStorageReader
    from tailorstore.integrations.dcp.writer import TailorStorageWriter

    model = sharded(build_model(2))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    store = Store.open(args.store)
    train_step(model, optim, 0, 128)  # AdamW's state exists before a load fills it (step 0: never saved)

    def state() -> dict:
        model_state, optim_state = get_state_dict(model, optim)
        return {"model": model_state, "optim": optim_state}

    start = 0
    if not args.fresh:
        held = [bool(store.log()) if rank == 0 else None]
        dist.broadcast_object_list(held, src=0)
        if held[0]:
            loaded = state()
            ref = args.probe_ref or args.tag or "latest"
            dcp.load(loaded, storage_reader=TailorStorageReader(store, ref))
            set_state_dict(model, optim, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"])
            start = int(store.step(ref).step) if rank == 0 else 0
            shared = [start]
            dist.broadcast_object_list(shared, src=0)
            start = int(shared[0])
        resumed = bool(held[0])
    else:
        resumed = False
    common.say(args, rank, {"resumed": resumed, "resumed_step": start, "loaded_digest": weights_digest(model)})
    if args.probe_ref:
        exit_without_teardown()
        return
    common.kill_here(args, rank, "after-load", start)

    # as torchtitan does: an async save's collectives on a group of their own, or they interleave with training's
    save_group = dist.new_group(backend="gloo") if args.async_save else None
    pending = None
    losses: dict[str, str] = {}
    for step in range(start + 1, args.steps + 1):
        loss = train_step(model, optim, step + args.data_offset, 128)
        losses[str(step)] = loss.hex()
        common.say(args, rank, {"losses": losses})
        common.kill_here(args, rank, "next-step", step - 1)
        if step % args.save_every == 0:
            common.write_witness(args, rank, step, weights_digest(model))
            common.kill_here(args, rank, "before-save", step)
            writer = TailorStorageWriter(store, step=step)
            if args.async_save:
                if pending is not None:
                    pending.result()  # one save in flight at a time, as torchtitan does
                pending = dcp.async_save(state(), storage_writer=writer, process_group=save_group)
            else:
                dcp.save(state(), storage_writer=writer)
            common.kill_here(args, rank, "after-save", step)
            common.kill_later(args, rank, step)
            common.say(args, rank, {"saved": [*common.report_of(rank).get("saved", []), step]})
    if pending is not None:
        pending.result()
    dist.barrier()
    common.say(args, rank, {"finished": True})
    store.close()
    exit_without_teardown()


if __name__ == "__main__":
    main()
