"""One launch of the job-life simulation's torchtitan schedules (testbed/job_life.py): the tiny
FSDP2 training of testbed/train_titan.py, checkpointed by torchtitan's own ``CheckpointManager``
machinery through :class:`TailorCheckpointManager`, as torchtitan's trainer drives it: ``load()``
before the first step (a resume when the store holds a step of the job's run), ``save(step)``
after each step, ``maybe_wait_for_staging`` after it, and ``keep_latest_k`` as the store's own
retention, run by the manager's gc thread beside the saves.

Reports, witnesses and kill points are those of testbed/job_life_train.py (the same flags), so the
harness checks one set of invariants over every integration. ``--async-save`` is torchtitan's
``async_mode="async"``: a save's commit runs while training goes on.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from testbed import job_life_train as common
from testbed.job_life_dcp import weights_digest
from testbed.teardown import exit_without_teardown
from testbed.train_titan import VOCAB, managed_training

KEEP_LATEST_K = 2  # the manager's gc keeps two steps, so every schedule's later saves race a gc


def main(argv: list[str] | None = None) -> None:
    p = common.parser()
    p.add_argument("--async-save", action="store_true", help="torchtitan's async_mode='async'")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    common.say(args, rank, {"world_size": dist.get_world_size()})

    from testbed.train_fsdp import train_step

    training = managed_training(
        args.store, args.save_dir, interval=args.save_every, keep_latest_k=KEEP_LATEST_K,
        async_mode="async" if args.async_save else "disabled",
    )  # fmt: skip
    model, optim, schedule = training.model, training.optim, training.schedule
    train_state, manager = training.train_state, training.manager
    if not args.fresh:
        manager.load()
    start = train_state.step
    common.say(args, rank, {"resumed": start > 0, "resumed_step": start, "loaded_digest": weights_digest(model)})
    common.kill_here(args, rank, "after-load", start)

    losses: dict[str, str] = {}
    for step in range(start + 1, args.steps + 1):
        loss = train_step(model, optim, step + args.data_offset, VOCAB)
        schedule.step()
        train_state.step = step
        losses[str(step)] = loss.hex()
        common.say(args, rank, {"losses": losses})
        common.kill_here(args, rank, "next-step", step - 1)
        if step % args.save_every == 0:
            common.write_witness(args, rank, step, weights_digest(model))
            common.kill_here(args, rank, "before-save", step)
        manager.save(step, last_step=step == args.steps)
        manager.maybe_wait_for_staging()
        if step % args.save_every == 0:
            common.kill_here(args, rank, "after-save", step)
            common.kill_later(args, rank, step)
            common.say(args, rank, {"saved": [*common.report_of(rank).get("saved", []), step]})
    manager.maybe_wait_for_saving()
    manager.close()
    dist.barrier()
    common.say(args, rank, {"finished": True})
    exit_without_teardown()


if __name__ == "__main__":
    main()
