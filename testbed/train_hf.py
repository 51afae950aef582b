"""A tiny Llama trained by the Hugging Face Trainer with DeepSpeed on the CPU.

It writes real ``checkpoint-N/`` folders (``global_stepN/``, ``model.safetensors``,
``trainer_state.json``, ``rng_state_{r}.pth``, ...) for the HF round-trip test, and can
resume with ``resume_from_checkpoint``. At the end rank 0 saves the final weights with
safetensors, so a resumed run can be compared bit for bit with an uninterrupted one.
Launch with ``torchrun --nproc_per_node 2 -m testbed.train_hf ...``.
"""

from __future__ import annotations

import argparse
import importlib
import os

import torch

from testbed.teardown import exit_without_teardown


class RampTokens(torch.utils.data.Dataset):
    """Deterministic token rows with a learnable pattern; the i-th row never changes."""

    def __init__(self, rows: int, seq: int, vocab: int) -> None:
        self.rows, self.seq, self.vocab = rows, seq, vocab

    def __len__(self) -> int:
        return self.rows

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(7919 * i + 1)
        start = int(torch.randint(0, self.vocab, (1,), generator=gen))
        ids = (start + torch.arange(self.seq)) % self.vocab
        noise = torch.randint(0, self.vocab, (self.seq,), generator=gen)
        ids = torch.where(torch.rand(self.seq, generator=gen) < 0.8, ids, noise)
        return {"input_ids": ids, "labels": ids.clone()}


def tiny_llama(layers: int) -> torch.nn.Module:
    """The tiny Llama every HF run of the tests trains, seeded, so each start builds the same one."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config)


def deepspeed_config(stage: int) -> dict:
    """The Trainer's DeepSpeed config at ZeRO ``stage``, the rest left to the Trainer ("auto")."""
    return {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "zero_optimization": {"stage": stage},
        "bf16": {"enabled": "auto"},
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--output-dir", required=True)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--save-steps", type=int, default=3)
    p.add_argument("--resume-from", default=None)
    p.add_argument("--final-weights", default=None)
    p.add_argument("--stage", type=int, default=2)
    p.add_argument("--tailor-store", default=None, help="commit every save with TailorCallback")
    p.add_argument("--delete-after-commit", action="store_true")
    p.add_argument("--tailor-policy", default="full", help="the callback's policy: NAME or NAME:KEY=VALUE,...")
    p.add_argument("--save-total-limit", type=int, default=None)
    p.add_argument("--load-universal", action="store_true", help="--resume-from holds a universal checkpoint")
    args = p.parse_args(argv)

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    torch.set_num_threads(1)
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    from transformers import Trainer, TrainingArguments

    model = tiny_llama(layers=3)
    ds_config = deepspeed_config(args.stage)
    if args.load_universal:  # DeepSpeed's own way to another world size
        ds_config["checkpoint"] = {"load_universal": True}
    training_args = TrainingArguments(
        output_dir=args.output_dir,
        max_steps=args.steps,
        save_steps=args.save_steps,
        per_device_train_batch_size=2,
        learning_rate=3e-3,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        bf16=True,
        deepspeed=ds_config,
        seed=0,
        data_seed=0,
        dataloader_num_workers=0,
        save_only_model=False,
        disable_tqdm=True,
        save_total_limit=args.save_total_limit,
    )
    callbacks = []
    if args.tailor_store:
        from tailorstore.integrations.hf import TailorCallback

        name, _, given = args.tailor_policy.partition(":")
        params = {k: float(v) for k, v in (item.split("=", 1) for item in given.split(",") if item)}
        callbacks.append(
            TailorCallback(args.tailor_store, policy=name, delete_after_commit=args.delete_after_commit, **params)
        )
    trainer = Trainer(model=model, args=training_args, train_dataset=RampTokens(64, 32, 128), callbacks=callbacks)
    trainer.train(resume_from_checkpoint=args.resume_from)
    for callback in callbacks:
        callback.close()
    if args.final_weights and trainer.is_world_process_zero():
        from safetensors.torch import save_file

        state = {k: v.detach().to("cpu").contiguous() for k, v in trainer.model.state_dict().items()}
        save_file(state, args.final_weights)


if __name__ == "__main__":
    main()
    exit_without_teardown()
