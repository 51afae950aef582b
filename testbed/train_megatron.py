"""A tiny Megatron-Core ``GPTModel`` trained on gloo CPU ranks and saved with ``dist_checkpointing``.

The model is Megatron's own (local layer spec, tensor parallel ``--tp``, ``use_cpu_initialization``),
its forward, loss (vocab-parallel cross entropy) and backward run as on a GPU, and its
checkpoints are Megatron's: ``dist_checkpointing.save(sharded_state_dict, RUN/iter_NNNNNNN)``
(``torch_dist``: ``common.pt``, DCP's files, ``metadata.json`` last), then rank 0 writes
``RUN/latest_checkpointed_iteration.txt``, as Megatron-LM does.

The optimizer is built as Megatron names and shards it, since Megatron's own optimizers need CUDA
(``DistributedOptimizer`` and ``Float16OptimizerWithFloat16Params`` accept only
``torch.cuda.*Tensor`` parameters, and allocate their buffers with ``device="cuda"``): with
``--dtype bf16`` the model's parameters are bf16, each has an FP32 main parameter that AdamW
updates and that is cast back into the bf16 parameter after every step (what Megatron's mixed
precision optimizers do), and the state is saved through Megatron's own
``make_sharded_optimizer_tensor`` under the keys its optimizers use:
``optimizer.state.fp32_param.<key>``, ``optimizer.state.exp_avg.<key>``,
``optimizer.state.exp_avg_sq.<key>``, sharded exactly as the parameter is.

``--load DIR --dump F`` builds the sharded state dict at this run's ``--tp``, loads DIR with
``dist_checkpointing.load`` (which reshards) and writes this rank's model and optimizer tensors to
``F.rank<R>``; ``--resume-from DIR`` loads and trains on to ``--steps``. ``--store S`` saves
through ``TailorSaveShardedStrategy(S)`` (the tensors into the store) and loads through
``TailorLoadShardedStrategy(S, --ref)`` (the tensors from the store). Rank 0 writes every step's
loss to ``--losses-out``. Launch with ``testbed.runs.torchrun("testbed.train_megatron", ...)``.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import torch

from testbed.megatron_cpu import cpu_shims, init_parallel

VOCAB, SEQ, HIDDEN, LAYERS = 128, 16, 64, 2
STATES = ("exp_avg", "exp_avg_sq")


def build_model(tp: int, dtype: torch.dtype, hidden: int = HIDDEN, layers: int = LAYERS, vocab: int = VOCAB) -> Any:
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.manual_seed(0)
    config = TransformerConfig(
        num_layers=layers, hidden_size=hidden, num_attention_heads=4, use_cpu_initialization=True,
        tensor_model_parallel_size=tp, params_dtype=dtype, bf16=dtype == torch.bfloat16,
        gated_linear_unit=True, hidden_dropout=0.0, attention_dropout=0.0,
    )  # fmt: skip
    return GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=vocab,
                    max_sequence_length=SEQ)  # fmt: skip


class Trainer:
    """The model, its FP32 main parameters and AdamW over them (Megatron's mixed-precision scheme)."""

    def __init__(self, tp: int, dtype: torch.dtype, **size: int) -> None:
        from megatron.core.transformer.module import Float16Module

        self.model = build_model(tp, dtype, **size)
        self.vocab = size.get("vocab", VOCAB)
        # Megatron-LM's wrapper of a bf16 model: casts what goes in to bf16 and the loss out to fp32
        self.forward = Float16Module(self.model.config, self.model) if dtype == torch.bfloat16 else self.model
        trained = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        self.names, self.params = [n for n, _ in trained], [p for _, p in trained]
        self.main = [p.detach().clone().float().requires_grad_(True) for p in self.params]
        self.optim = torch.optim.AdamW(self.main, lr=1e-2, weight_decay=0.01)
        for m in self.main:  # allocated now, so that a load has tensors to load into
            self.optim.state[m] = {"step": torch.tensor(0.0), **{k: torch.zeros_like(m) for k in STATES}}
        self.step = 0

    def train_step(self) -> float:
        ids = batch(self.step, vocab=self.vocab)
        causal = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), diagonal=1)[None, None]  # True: masked
        positions = torch.arange(SEQ)[None].expand(ids.shape[0], SEQ).contiguous()
        loss = self.forward(ids[:, :-1].contiguous(), positions, causal, labels=ids[:, 1:].contiguous()).float().mean()
        loss.backward()
        for p, m in zip(self.params, self.main, strict=True):
            m.grad = p.grad.float()
            p.grad = None
        self.optim.step()
        self.optim.zero_grad()
        with torch.no_grad():
            for p, m in zip(self.params, self.main, strict=True):
                p.copy_(m)  # the cast of the main parameter, as Megatron's optimizers write it back
        self.step += 1
        return float(loss.detach())

    def sharded_state_dict(self) -> dict[str, Any]:
        from megatron.core.dist_checkpointing.optimizer import make_sharded_optimizer_tensor

        model = self.model.sharded_state_dict()
        state: dict[str, Any] = {}
        for name, m in zip(self.names, self.main, strict=True):
            sh = model[name]  # the parameter's ShardedTensor (or factory), keyed by its state-dict name
            tensors = {"fp32_param": m, **{k: self.optim.state[m][k] for k in STATES}}
            for kind, tensor in tensors.items():
                state[f"{kind}.{name}"] = make_sharded_optimizer_tensor(sh, tensor, f"optimizer.state.{kind}")
        return {"model": model, "optimizer": state, "iteration": self.step,
                "optimizer_common": {"lr": 1e-2, "step": self.step}}  # fmt: skip

    def load(self, folder: Path, strategy: Any = None) -> None:
        from megatron.core import dist_checkpointing

        wanted = self.sharded_state_dict()
        keys = list(wanted["optimizer"])  # in the order of the parameters: fp32_param, exp_avg, exp_avg_sq each
        loaded = dist_checkpointing.load(wanted, str(folder), sharded_strategy=strategy)
        self.model.load_state_dict(loaded["model"])
        with torch.no_grad():
            for i, m in enumerate(self.main):
                fp32, *states = (loaded["optimizer"][k] for k in keys[3 * i : 3 * i + 3])
                m.copy_(fp32)
                for name, value in zip(STATES, states, strict=True):
                    self.optim.state[m][name].copy_(value)
        self.step = int(loaded["iteration"])
        for m in self.main:
            self.optim.state[m]["step"] = torch.tensor(float(self.step))

    def tensors(self) -> dict[str, torch.Tensor]:
        """This rank's model and optimizer tensors, by name: what a load must give back."""
        out = {f"model.{k}": v.detach().clone() for k, v in self.model.state_dict().items() if torch.is_tensor(v)}
        for i, m in enumerate(self.main):
            out[f"main.{i}"] = m.detach().clone()
            out.update({f"{k}.{i}": self.optim.state[m][k].clone() for k in STATES})
        return out


def batch(step: int, rows: int = 2, vocab: int = VOCAB) -> torch.Tensor:
    """The token rows of ``step`` (every rank the same: one data-parallel replica)."""
    gen = torch.Generator().manual_seed(7919 * step + 1)
    start = torch.randint(0, vocab, (rows, 1), generator=gen)
    return (start + torch.arange(SEQ + 1)) % vocab


def save(trainer: Trainer, run: Path, strategy: Any = None, queue: Any = None) -> Path:
    """Megatron-LM's save: the iteration's folder, then the tracker file; with ``queue`` (an
    ``AsyncCallsQueue``) the sharded save runs async and the tracker is written at its finalization."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    folder = run / f"iter_{trainer.step:07d}"
    if dist.get_rank() == 0:
        folder.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    step = trainer.step

    def tracker() -> None:
        if dist.get_rank() == 0:
            (run / "latest_checkpointed_iteration.txt").write_text(str(step))

    state = trainer.sharded_state_dict()
    request = dist_checkpointing.save(
        state, str(folder), sharded_strategy=strategy, async_sharded_save=queue is not None
    )
    if request is None:
        tracker()
        dist.barrier()
    else:
        request.add_finalize_fn(tracker)
        queue.schedule_async_request(request)
    return folder


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--save-every", type=int, default=2)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--load", type=Path)
    parser.add_argument("--dump", type=Path)
    parser.add_argument("--resume-from", type=Path)
    parser.add_argument("--losses-out", type=Path)
    parser.add_argument("--store", help="save into / load from this store, through tailorstore's strategies")
    parser.add_argument("--ref", default="latest", help="the stored step a load through the strategy reads")
    parser.add_argument("--async-save", action="store_true", help="async_sharded_save=True, on an AsyncCallsQueue")
    parser.add_argument(
        "--die-after-parts",
        action="store_true",
        help="every rank dies once its first async save's process is done, before the finalization",
    )
    args = parser.parse_args()
    cpu_shims()
    init_parallel(args.tp)
    import torch.distributed as dist

    rank = dist.get_rank()
    trainer = Trainer(args.tp, torch.bfloat16 if args.dtype == "bf16" else torch.float32)
    saving = loading = None
    if args.store is not None:
        from tailorstore.integrations.megatron import TailorLoadShardedStrategy, TailorSaveShardedStrategy

        saving, loading = TailorSaveShardedStrategy(args.store), TailorLoadShardedStrategy(args.store, args.ref)
    if args.load is not None:
        trainer.load(args.load, loading)
        torch.save(trainer.tensors(), f"{args.dump}.rank{rank}")
        dist.destroy_process_group()
        return
    if args.resume_from is not None:
        trainer.load(args.resume_from, loading)
    queue = None
    if args.async_save:
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

        queue = AsyncCallsQueue()
    losses: dict[int, float] = {}
    while trainer.step < args.steps:
        loss = trainer.train_step()
        losses[trainer.step] = loss
        if queue is not None:
            queue.maybe_finalize_async_calls(blocking=False)  # as Megatron-LM does every iteration
        if args.out is not None and trainer.step % args.save_every == 0:
            folder = save(trainer, args.out, saving, queue)
            if args.dump is not None:
                torch.save(trainer.tensors(), f"{args.dump}.{folder.name}.rank{rank}")
            if args.die_after_parts:
                queue.async_calls[0].async_caller.process.join()  # this rank's part is committed
                os._exit(3)  # killed before the finalization: no step may be recorded
    if queue is not None:
        queue.maybe_finalize_async_calls(blocking=True)
    if rank == 0 and args.losses_out is not None:
        args.losses_out.write_text(json.dumps(losses))
    dist.destroy_process_group()


if __name__ == "__main__":  # dist_checkpointing.save starts a multiprocessing manager
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
