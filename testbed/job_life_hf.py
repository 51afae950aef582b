"""One launch of the job-life simulation's HF Trainer schedules (testbed/job_life.py): the tiny Llama
of testbed/train_hf.py trained by the Hugging Face Trainer with DeepSpeed (ZeRO-2 or ZeRO-3),
``checkpoint-N`` saved every few steps and committed by :class:`TailorCallback` in the background,
resumed the way the integration's docs show: :func:`checkout_for_resume` (the store's newest step,
chosen once for every rank, checked out for this world size) handed to
``trainer.train(resume_from_checkpoint=...)``.

Reports, witnesses and kill points are those of testbed/job_life_train.py (the same flags), so the
harness checks one set of invariants over every integration: ``before-save`` in ``on_step_end`` of
a save's step (the weights are final there and the Trainer saves next), ``after-save`` in
``on_save`` (after the callback has handed the folder to its background commit), ``next-step`` a
step later, ``after-load`` in ``on_train_begin`` (the Trainer has loaded the checkpoint by then).
``--delete-after-commit`` is the callback's own flag: each folder is deleted once its step is durable.
The learning rate is constant, so that a launch's losses do not depend on its ``max_steps``.
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from testbed import job_life_train as common
from testbed.teardown import exit_without_teardown
from testbed.train_hf import RampTokens, deepspeed_config, tiny_llama


def main(argv: list[str] | None = None) -> None:
    p = common.parser()
    p.add_argument("--delete-after-commit", action="store_true", help="the callback deletes each committed folder")
    args = p.parse_args(argv)
    if args.probe_ref or args.tag:
        raise SystemExit("the HF schedules have no rewinds: --probe-ref and --tag are the DeepSpeed script's")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    torch.set_num_threads(1)
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None  # as train_hf: no JIT build
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from tailorstore.api import Store
    from tailorstore.integrations.hf import TailorCallback, checkout_for_resume

    model = tiny_llama(layers=2)
    ds_config = deepspeed_config(args.stage)
    training_args = TrainingArguments(
        output_dir=args.save_dir, max_steps=args.steps, save_steps=args.save_every, per_device_train_batch_size=2,
        learning_rate=3e-3, lr_scheduler_type="constant", logging_steps=1, report_to=[], use_cpu=True, bf16=True,
        deepspeed=ds_config, seed=0, data_seed=0, dataloader_num_workers=0, disable_tqdm=True,
    )  # fmt: skip
    losses: dict[str, str] = {}
    rank_of = [0]

    class RecordingTrainer(Trainer):
        def training_step(self, *a: Any, **kw: Any) -> torch.Tensor:
            loss = super().training_step(*a, **kw)
            losses[str(self.state.global_step + 1)] = float(loss.detach().float()).hex()
            return loss

    class LifeEvents(TrainerCallback):
        """The job's report, witnesses and kill points, at the Trainer's own events."""

        def on_train_begin(self, targs: Any, state: Any, control: Any, **kw: Any) -> None:
            rank = rank_of[0]
            start = state.global_step
            digest = common.module_digest(model)  # collective under ZeRO-3
            common.say(args, rank, {"resumed": start > 0, "resumed_step": start, "loaded_digest": digest})
            common.kill_here(args, rank, "after-load", start)

        def on_step_end(self, targs: Any, state: Any, control: Any, **kw: Any) -> None:
            rank, step = rank_of[0], state.global_step
            common.say(args, rank, {"losses": dict(losses)})
            common.kill_here(args, rank, "next-step", step - 1)
            if control.should_save:  # a save's step, or the last (the Trainer saves at its end too)
                common.write_witness(args, rank, step, common.module_digest(model))  # collective under ZeRO-3
                common.kill_here(args, rank, "before-save", step)

        def on_save(self, targs: Any, state: Any, control: Any, **kw: Any) -> None:
            rank, step = rank_of[0], state.global_step
            common.kill_here(args, rank, "after-save", step)
            common.kill_later(args, rank, step)
            common.say(args, rank, {"saved": [*common.report_of(rank).get("saved", []), step]})

    tailor = TailorCallback(args.store, delete_after_commit=args.delete_after_commit, on_existing=args.on_existing)
    trainer = RecordingTrainer(
        model=model, args=training_args, train_dataset=RampTokens(64, 32, 128), callbacks=[tailor, LifeEvents()]
    )
    rank = rank_of[0] = dist.get_rank() if dist.is_initialized() else 0
    common.say(args, rank, {"world_size": dist.get_world_size() if dist.is_initialized() else 1, "pid": os.getpid()})
    folder = None if args.fresh else checkout_for_resume(args.store, Path(args.save_dir) / "resume")
    if rank == 0:  # what was durable when the job decided
        with Store.open(args.store) as store:
            common.say(args, rank, {"store_steps_at_resume": [s.step for s in store.log()]})
    trainer.train(resume_from_checkpoint=folder)
    tailor.close()
    if dist.is_initialized():
        dist.barrier()
    common.say(args, rank, {"finished": True})
    exit_without_teardown()


if __name__ == "__main__":
    main()
