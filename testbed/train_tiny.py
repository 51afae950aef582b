"""A tiny Llama-style model trained with DeepSpeed on the CPU.

Tests, the demo and the benchmarks need real checkpoints written by real DeepSpeed
runs; this script makes them. It is launched with
``torchrun --nproc_per_node 2 -m testbed.train_tiny ...`` and writes the
losses of every step it ran to ``--losses-out`` (JSON, from rank 0), so that a resumed
run can be compared bit for bit with an uninterrupted one.

The parameter names follow Hugging Face Llama (``model.layers.N.self_attn.q_proj.weight``)
so that layer labelling sees what it sees in real models. The data of step N depends only
on N, which makes a resumed run see the batches the uninterrupted run saw.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import math
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from tailorstore.api import Store
from tailorstore.integrations.deepspeed import attach, load_checkpoint, save_checkpoint
from testbed.memory import resident_bytes
from testbed.teardown import exit_without_teardown


class RMSNorm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)
        return (normed * self.weight.float()).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.q_proj = nn.Linear(dim, dim, bias=False)
        self.k_proj = nn.Linear(dim, dim, bias=False)
        self.v_proj = nn.Linear(dim, dim, bias=False)
        self.o_proj = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.heads

        def split(y: torch.Tensor) -> torch.Tensor:
            return y.view(b, t, h, d // h).transpose(1, 2)

        q, k, v = split(self.q_proj(x)), split(self.k_proj(x)), split(self.v_proj(x))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, d))


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(dim)
        self.self_attn = Attention(dim, heads)
        self.post_attention_layernorm = RMSNorm(dim)
        self.mlp = MLP(dim, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int, heads: int, hidden: int) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim, heads, hidden) for _ in range(layers))
        self.norm = RMSNorm(dim)


class Fp32ComputeLinear(nn.Linear):
    """A linear layer whose parameters keep their dtype (bf16 in the checkpoint) but whose
    arithmetic runs in the input's dtype: this CPU (AVX2, no AVX512-BF16) multiplies bf16
    matrices 27x slower than fp32 ones, which would make a benchmark of hundreds of steps
    at 50M parameters take hours."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight.to(x.dtype))


class TinyLlama(nn.Module):
    def __init__(
        self,
        vocab: int,
        dim: int,
        layers: int,
        heads: int,
        hidden: int,
        tie: bool = False,
        fp32_compute: bool = False,
    ) -> None:
        super().__init__()
        self.model = Backbone(vocab, dim, layers, heads, hidden)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        if tie:  # one parameter under two names, as tie_word_embeddings makes it
            self.lm_head.weight = self.model.embed_tokens.weight
        self.fp32_compute = fp32_compute
        if fp32_compute:  # same parameters and checkpoint layout; activations in fp32
            for module in self.modules():
                if type(module) is nn.Linear:
                    module.__class__ = Fp32ComputeLinear

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.model.embed_tokens(tokens)
        if self.fp32_compute:
            x = x.float()
        for block in self.model.layers:
            x = block(x)
        logits = self.lm_head(self.model.norm(x)).float()
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), tokens[:, 1:].reshape(-1))


def layer_group_name(param_name: str) -> str:
    parts = param_name.split(".")
    if "layers" in parts:
        i = parts.index("layers")
        return f"block{parts[i + 1]}"
    return parts[-2] if len(parts) > 1 else parts[0]


def param_groups(model: nn.Module, recipe: str, lr: float) -> list[dict]:
    """Build optimizer param groups in the shapes real recipes use."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]  # frozen ones: no optimizer state
    if recipe == "one":
        return [{"params": [p for _, p in named], "weight_decay": 0.01}]
    if recipe == "two":
        decay = [p for n, p in named if p.dim() >= 2]
        no_decay = [p for n, p in named if p.dim() < 2]
        return [{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}]
    if recipe == "per-layer":
        groups: dict[str, list[nn.Parameter]] = {}
        for n, p in named:
            groups.setdefault(layer_group_name(n), []).append(p)
        return [{"params": ps, "weight_decay": 0.01, "lr": lr} for ps in groups.values()]
    raise SystemExit(f"unknown --param-groups {recipe!r}")


def batch_for_step(step: int, rank: int, batch: int, seq: int, vocab: int) -> torch.Tensor:
    """Tokens that depend only on (step, rank): a resumed run sees the same data."""
    gen = torch.Generator().manual_seed(1_000_003 * step + rank)
    # A learnable pattern (a noisy ramp) so that losses fall and layers really change.
    start = torch.randint(0, vocab, (batch, 1), generator=gen)
    ramp = (start + torch.arange(seq).unsqueeze(0)) % vocab
    noise = torch.randint(0, vocab, (batch, seq), generator=gen)
    keep = torch.rand((batch, seq), generator=gen) < 0.8
    return torch.where(keep, ramp, noise)


@functools.cache
def _chain_tables(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed successor for every token and Zipf(1.1) token frequencies, as text has."""
    successor = torch.randperm(vocab, generator=torch.Generator().manual_seed(42))
    zipf = 1.0 / torch.arange(1, vocab + 1, dtype=torch.float64) ** 1.1
    return successor, zipf / zipf.sum()


def chain_batch_for_step(step: int, rank: int, batch: int, seq: int, vocab: int) -> torch.Tensor:
    """Text-like tokens: a token follows its fixed successor 3 times in 4, else a Zipf draw.

    With a large vocabulary the ramp above is not learnable in a few hundred steps; this is:
    the loss falls from ln(vocab) as frequent tokens' successors are learnt, and, as in real
    text, rare tokens' rows move little. Depends only on (step, rank), like the ramp."""
    successor, zipf = _chain_tables(vocab)
    gen = torch.Generator().manual_seed(1_000_003 * step + rank)
    draws = torch.multinomial(zipf, batch * seq, replacement=True, generator=gen).view(batch, seq)
    follow = torch.rand((batch, seq), generator=gen) < 0.75
    tokens = draws.clone()
    for t in range(1, seq):
        tokens[:, t] = torch.where(follow[:, t], successor[tokens[:, t - 1]], draws[:, t])
    return tokens


DATA = {"ramp": batch_for_step, "chain": chain_batch_for_step}
HELD_OUT = 10_000_000  # held-out batches are those of steps from here on, which no training reaches


def held_out_loss(engine: object, args: argparse.Namespace) -> float:
    """Mean loss over --eval-batches held-out batches. Every rank runs the same batches, so a
    ZeRO-3 engine, which gathers parameters collectively, evaluates as well as the others."""
    make = DATA[args.data]
    engine.eval()
    with torch.no_grad():
        batches = [make(HELD_OUT + i, 0, args.micro_batch, args.seq, args.vocab) for i in range(args.eval_batches)]
        losses = [engine(tokens).item() for tokens in batches]
    engine.train()
    return sum(losses) / len(losses)


def saved_bytes(model: nn.Module) -> int:
    """Rank 0's tensor bytes of one ZeRO 1/2 bf16 save: what a snapshot of its state must copy."""
    n = sum(p.numel() for p in model.parameters())
    return n * 2 + n * 12 // torch.distributed.get_world_size()  # bf16 weights; this rank's fp32 master, two moments


def copy_floor(nbytes: int, cuda: bool, *, together: bool = False) -> float:
    """Seconds to copy ``nbytes`` into host memory that is already mapped (pinned, from the GPU,
    with --cuda; else from memory to memory), the best of 3 after a warm-up: the least a snapshot
    of the save can block for. ``together``: every rank copies at once, as every rank snapshots
    its share of a save at the same moment (collective: all ranks call it); on a machine whose
    ranks share the memory bus and cores, that is the floor the save itself runs against."""
    source = torch.ones(nbytes, dtype=torch.uint8, device="cuda" if cuda else "cpu")
    target = torch.zeros(nbytes, dtype=torch.uint8, pin_memory=cuda)  # zeros: every page touched
    times = []
    for _ in range(4):
        if together:
            torch.distributed.barrier()
        if cuda:
            torch.cuda.synchronize()
        began = time.perf_counter()
        target.copy_(source, non_blocking=cuda)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - began)
    return min(times[1:])


def ds_config(args: argparse.Namespace) -> dict:
    config: dict = {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "steps_per_print": 10_000,
        "zero_optimization": {"stage": args.stage},
        "wall_clock_breakdown": False,
    }
    if args.dtype == "bf16":
        config["bf16"] = {"enabled": True}
        if args.grad_accum_dtype:
            config["data_types"] = {"grad_accum_dtype": args.grad_accum_dtype}
    elif args.dtype == "fp16":
        config["fp16"] = {"enabled": True, "initial_scale_power": 8}
    if args.load_universal:  # resume from a universal checkpoint (any world size)
        config["checkpoint"] = {"load_universal": True}
    if args.fast_writer:  # DeepSpeed's FastCheckpointEngine, for the training-stall benchmark
        config["checkpoint"] = {"writer": {"type": "python", "decoupled": False, "data_parallel": "replica"}}
    return config


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--save-dir", required=True)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--save-every", type=int, default=3)
    p.add_argument("--resume-from", default=None, help="a DeepSpeed save dir to load_checkpoint from")
    p.add_argument("--resume-tag", default=None, help="the tag to load (default: what 'latest' names)")
    p.add_argument(
        "--fresh-if-none", action="store_true", help="--resume-from finding nothing to load starts fresh (first launch)"
    )
    p.add_argument("--losses-out", default=None)
    p.add_argument("--stage", type=int, default=2)
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    p.add_argument("--grad-accum-dtype", default=None)
    p.add_argument("--param-groups", choices=["one", "two", "per-layer"], default="one")
    p.add_argument("--vocab", type=int, default=128)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--hidden", type=int, default=172)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--save-on-load", default=None, help="save the loaded state into this dir (tag 'loaded')")
    p.add_argument("--save-at-start", action="store_true", help="also save before the first step (global_step0)")
    p.add_argument("--load-universal", action="store_true", help="--resume-from names a universal checkpoint")
    p.add_argument("--tie-embeddings", action="store_true", help="lm_head shares the embedding's weight")
    p.add_argument("--cuda", action="store_true", help="train on this rank's GPU (nccl) instead of the CPU")
    p.add_argument("--load-from-store", default=None, help="a ref of --commit-to to resume from, without attach")
    p.add_argument(
        "--staged-resume", action="store_true", help="resume through staged files, not straight from the store"
    )
    p.add_argument("--commit-to", default=None, help="a tailorstore: rank 0 commits after every save")
    p.add_argument("--delete-after-commit", action="store_true", help="remove each tag folder once committed")
    p.add_argument(
        "--tailor-engine",
        action="store_true",
        help="attach TailorCheckpointEngine: saves go into --commit-to, and --resume-from loads from it",
    )
    p.add_argument("--no-snapshot", action="store_true", help="the engine serializes each file inside the save")
    p.add_argument(
        "--gpu-buffers",
        choices=("auto", "on", "off"),
        default="auto",
        help="the snapshot copies through buffers in GPU memory (auto: where the GPU has room)",
    )
    p.add_argument("--engine-policy", default="full", help="the policy TailorCheckpointEngine commits with")
    p.add_argument("--record-loss-metric", action="store_true", help="attach records rank 0's loss as train_loss")
    p.add_argument("--freeze-bottom", action="store_true", help="freeze the embedding and the lower half of the blocks")
    p.add_argument("--eval-at-save", action="store_true", help="held-out loss (--eval-batches) before each save")
    p.add_argument("--evals-out", default=None, help="JSON: the held-out loss at each save (rank 0)")
    p.add_argument("--on-existing", default="branch", help="what the engine does with a save of a step the store holds")
    p.add_argument("--fast-writer", action="store_true", help="save with DeepSpeed's FastCheckpointEngine")
    p.add_argument("--timings-out", default=None, help="JSON: each save's stall and the training loop's seconds")
    p.add_argument("--rss-out", default=None, help="JSON: rank 0's resident memory after each save, in bytes")
    p.add_argument(
        "--floor-together",
        action="store_true",
        help="with --timings-out: also time the stall's floor on every rank at once (two more copies of "
        "each rank's share of a save in memory for a moment: off in the scale runs, which fill memory)",
    )
    p.add_argument("--data", choices=sorted(DATA), default="ramp", help="ramp (tests) or chain (text-like)")
    p.add_argument("--fp32-compute", action="store_true", help="bf16 parameters, fp32 arithmetic (fast on CPU)")
    p.add_argument("--eval-batches", type=int, default=0, help="held-out batches to evaluate after training")
    p.add_argument("--eval-out", default=None, help="JSON: the held-out loss after training (rank 0)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.cuda:  # one GPU a rank; deterministic kernels, so that a resume can be checked bit for bit
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cuda.enable_flash_sdp(False)  # its backward adds in no fixed order
        torch.backends.cuda.enable_mem_efficient_sdp(False)
        torch.backends.cuda.enable_cudnn_sdp(False)  # nor does cuDNN's: the math kernel is deterministic
        torch.use_deterministic_algorithms(True, warn_only=True)
    else:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        torch.set_num_threads(1)
    import deepspeed

    # Skip DeepSpeed's JIT build of its shared-memory op (47 to 95 s on a fresh machine);
    # gloo then carries all communication and losses stay bit-identical.
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    if args.fast_writer:  # its writer config reads what DeepSpeed's own launcher sets; torchrun runs one node
        os.environ.setdefault("CROSS_SIZE", "1")
        os.environ.setdefault("CROSS_RANK", "0")
        os.environ.setdefault("LOCAL_SIZE", os.environ.get("LOCAL_WORLD_SIZE", "1"))
    deepspeed.init_distributed(dist_backend="nccl" if args.cuda else "gloo")
    rank = torch.distributed.get_rank()

    torch.manual_seed(args.seed)
    model = TinyLlama(
        args.vocab,
        args.dim,
        args.layers,
        args.heads,
        args.hidden,
        tie=args.tie_embeddings,
        fp32_compute=args.fp32_compute,
    )
    if args.freeze_bottom:  # the embedding and the lower half of the blocks stop training
        frozen = [model.model.embed_tokens, *model.model.layers[: args.layers // 2]]
        for module in frozen:
            module.requires_grad_(False)
    optimizer = torch.optim.AdamW(
        [g for g in param_groups(model, args.param_groups, args.lr) if g["params"]], lr=args.lr
    )
    warmup = 4
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup) * (0.5 + 0.5 * math.cos(min(s, 1000) / 1000 * math.pi))
    )
    engine, _, _, _ = deepspeed.initialize(
        model=model, optimizer=optimizer, lr_scheduler=scheduler, config=ds_config(args)
    )

    # global rank 0 commits; each node's local rank 0 may resume from the store
    leader = rank == 0 or os.environ.get("LOCAL_RANK", "0") == "0"
    store = Store.open(args.commit_to) if args.commit_to and leader else None
    tailor = None
    if args.tailor_engine:
        tailor = attach(
            engine, store, policy=args.engine_policy, on_existing=args.on_existing, snapshot=not args.no_snapshot,
            gpu_buffers={"auto": None, "on": True, "off": False}[args.gpu_buffers],
            metrics=(lambda step: {"train_loss": losses[step]}) if args.record_loss_metric else None,
            staged_resume=args.staged_resume,
        )  # fmt: skip

    start_step = 0
    resume_began = time.perf_counter()  # time to resume: load_checkpoint called to the first step done
    if args.load_from_store:  # no attach: resume straight from the store at this world size
        _, client_state = load_checkpoint(engine, store, args.load_from_store, staged=args.staged_resume)
        start_step = int(client_state["my_step"])
    elif args.resume_from:
        load_path, client_state = engine.load_checkpoint(args.resume_from, tag=args.resume_tag)
        if load_path is None and not args.fresh_if_none:
            raise SystemExit(f"DeepSpeed found no checkpoint to resume from in {args.resume_from}")
        start_step = int(client_state["my_step"]) if load_path is not None else 0
        if args.save_on_load:  # what DeepSpeed holds right after the load, saved as it saves it
            engine.save_checkpoint(args.save_on_load, tag="loaded", client_state={"my_step": start_step})

    if args.save_at_start and not args.resume_from:  # no optimizer step yet: AdamW holds no moments
        engine.save_checkpoint(args.save_dir, client_state={"my_step": 0})

    losses: dict[int, float] = {}
    evals: dict[int, float] = {}  # held-out loss at each save (--eval-at-save)
    stalls: list[float] = []  # how long each save blocked training (rank 0)
    step_ends: dict[int, float] = {}  # when each step's loss was on the host (tokens/s around a save)
    rss: list[int] = []  # rank 0's resident bytes after each save (--rss-out)
    loop_began = time.perf_counter()
    for step in range(start_step + 1, args.steps + 1):
        tokens = DATA[args.data](step, rank, args.micro_batch, args.seq, args.vocab).to(engine.device)
        loss = engine(tokens)
        engine.backward(loss)
        engine.step()
        losses[step] = loss.item()
        step_ends[step] = time.perf_counter() - loop_began
        if step == start_step + 1:
            resume_seconds = time.perf_counter() - resume_began
        if args.save_every and step % args.save_every == 0:
            if args.eval_at_save:  # evaluated before the save (as the HF Trainer does), recorded with it
                evals[step] = held_out_loss(engine, args)
                if tailor is not None and rank == 0:
                    tailor.set_metrics({"eval_loss": evals[step]})
            save_began = time.perf_counter()
            if tailor is not None:  # the engine saves into the store itself
                engine.save_checkpoint(args.save_dir, client_state={"my_step": step})
            elif store is not None or args.commit_to:
                # the save on every rank, then rank 0 commits it in the background
                save_checkpoint(
                    engine,
                    args.save_dir,
                    store,
                    client_state={"my_step": step},
                    delete_after_commit=args.delete_after_commit,
                    on_existing=args.on_existing,
                )
            else:
                engine.save_checkpoint(args.save_dir, client_state={"my_step": step})
            stalls.append(time.perf_counter() - save_began)
            if args.rss_out:
                rss.append(resident_bytes())

    if tailor is not None:
        tailor.flush()  # rank 0: waits for the last commit and raises any failure
    if args.fast_writer:
        engine.checkpoint_engine.cleanup()  # DeepSpeed's writer finishes what it still holds
    if store is not None:
        store.close()  # waits for the last commit and raises any failure
        with Store.open(args.commit_to) as done:
            for s in done.log():
                print(f"[tailor] committed step {s.step}: {s.raw_bytes} raw, {s.new_bytes} newly stored", flush=True)
    torch.distributed.barrier()
    loop_seconds = time.perf_counter() - loop_began
    together = None
    if args.save_every and args.timings_out and args.floor_together:  # every rank, at once
        together = copy_floor(saved_bytes(engine.module), args.cuda, together=True)
    if rank == 0 and args.timings_out:
        timings = {"stalls": stalls, "loop_seconds": loop_seconds, "step_ends": step_ends}
        if together is not None:
            timings["copy_floor_together_seconds"] = together
        if args.resume_from or args.load_from_store:
            timings["resume_seconds"] = resume_seconds
        if args.save_every:  # the floor of a stall: rank 0's bytes of a save copied into mapped memory
            nbytes = saved_bytes(engine.module)
            timings |= {"copy_floor_seconds": copy_floor(nbytes, args.cuda), "copy_floor_bytes": nbytes}
        Path(args.timings_out).write_text(json.dumps(timings))
    if args.eval_batches:
        held_out = held_out_loss(engine, args)
        if rank == 0 and args.eval_out:
            Path(args.eval_out).write_text(json.dumps({"held_out_loss": held_out, "batches": args.eval_batches}))
    if rank == 0 and args.evals_out:
        Path(args.evals_out).write_text(json.dumps(evals))
    if rank == 0 and args.rss_out:
        Path(args.rss_out).write_text(json.dumps(rss))
    if rank == 0 and args.losses_out:
        # float.hex keeps every bit, so equality checks are exact.
        Path(args.losses_out).write_text(json.dumps({str(k): v.hex() for k, v in losses.items()}))


if __name__ == "__main__":
    main()
    exit_without_teardown()
