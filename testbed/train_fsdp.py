"""A tiny Llama trained with FSDP2 (``fully_shard``) and AdamW on the CPU, saved with DCP.

Each decoder block and then the root are ``fully_shard``ed, as torchtitan and the FSDP2
tutorials do; every ``--save-every`` steps rank 0 and the others write
``OUT/step-N/`` with ``dcp.save({"model", "optim", "train"})`` of ``get_state_dict``:
``.metadata`` and one ``__R_0.distcp`` a rank. ``--resume-from DIR`` loads such a folder
(``dcp.load``, which reshards at any world size) and goes on from its step. Rank 0 writes
the loss of every step to ``--losses-out``, so a resumed run can be compared bit for bit
with an uninterrupted one. Launch with ``torchrun --nproc_per_node 2 -m testbed.train_fsdp``.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

from testbed.memory import resident_bytes


def batch(step: int, rank: int, world: int, vocab: int, seq: int = 16, rows: int = 2) -> torch.Tensor:
    """The token rows rank ``rank`` trains on at ``step``: the same for a given (step, rank, world)."""
    gen = torch.Generator().manual_seed(7919 * (step * world + rank) + 1)
    start = torch.randint(0, vocab, (rows, 1), generator=gen)
    ids = (start + torch.arange(seq)) % vocab
    noise = torch.randint(0, vocab, (rows, seq), generator=gen)
    return torch.where(torch.rand(rows, seq, generator=gen) < 0.8, ids, noise)


def build_model(layers: int, hidden: int = 64, vocab: int = 128) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config)


def sharded(model: torch.nn.Module) -> torch.nn.Module:
    """Each decoder block, then the root, ``fully_shard``ed (as torchtitan and the FSDP2 tutorials do)."""
    from torch.distributed.fsdp import fully_shard

    for block in model.model.layers:
        fully_shard(block)
    fully_shard(model)
    return model


def train_step(model: torch.nn.Module, optim: torch.optim.Optimizer, step: int, vocab: int) -> float:
    """One step on this rank's rows of ``step``; returns the loss averaged over the ranks."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    ids = batch(step, rank, world, vocab)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optim.step()
    optim.zero_grad()
    total = loss.detach().clone()
    dist.all_reduce(total)
    return float(total) / world


def save_as_accelerate(
    model: torch.nn.Module, optim: torch.optim.Optimizer, folder: Path, step: int, rank: int, *, trainer: bool = True
) -> None:
    """The folder the HF Trainer writes under FSDP2 with a sharded state dict, through Accelerate's
    own save functions (the Trainer calls these), plus the trainer_state.json it writes beside;
    or (``trainer`` False) what Accelerate's own ``save_state`` writes: the same two DCP folders
    and each rank's random states beside them, as ``random_states_R.pkl``."""
    from types import SimpleNamespace

    from accelerate import PartialState
    from accelerate.utils.fsdp_utils import save_fsdp_model, save_fsdp_optimizer
    from torch.distributed.fsdp.fully_sharded_data_parallel import StateDictType

    PartialState(cpu=True)  # Accelerate's logging needs its state; the process group is ours already
    plugin = SimpleNamespace(
        fsdp_version=2,
        state_dict_type=StateDictType.SHARDED_STATE_DICT,
        state_dict_config=SimpleNamespace(),
        optim_state_dict_config=None,
    )
    accelerator = SimpleNamespace(process_index=rank, num_processes=torch.distributed.get_world_size())
    save_fsdp_model(plugin, accelerator, model, str(folder))
    save_fsdp_optimizer(plugin, accelerator, optim, model, str(folder))
    if trainer and rank == 0:
        (folder / "trainer_state.json").write_text(json.dumps({"global_step": step, "log_history": []}))
    if not trainer:  # as accelerate.checkpointing.save_accelerator_state names and writes them
        states = {"step": step, "torch_manual_seed": torch.get_rng_state()}
        torch.save(states, folder / f"random_states_{rank}.pkl")


class Saver:
    """``dcp.save`` of each step, to a folder or through TailorStorageWriter, sync or async (an
    async save waits for the one before it, as torchtitan does)."""

    def __init__(self, args: argparse.Namespace, out: Path) -> None:
        self.args, self.out, self.pending = args, out, None
        self.store, self.group = None, None
        if args.async_save:  # as torchtitan does: the save's collectives on a group of their own
            import torch.distributed as dist

            self.group = dist.new_group(backend="gloo")
        if args.save_to_store:
            from tailorstore import Store

            self.store = Store.open(args.save_to_store)

    def writer(self, step: int):
        if self.store is None:
            return None
        from tailorstore.integrations.dcp.writer import TailorStorageWriter

        return TailorStorageWriter(self.store, step=step, policy=self.args.store_policy)

    def __call__(self, state: dict, step: int) -> None:
        import torch.distributed.checkpoint as dcp

        writer = self.writer(step)
        where = {"storage_writer": writer} if writer is not None else {"checkpoint_id": str(self.out / f"step-{step}")}
        if self.args.async_save is None:
            dcp.save(state, **where)
            return
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        self.wait()
        kind = AsyncCheckpointerType.PROCESS if self.args.async_save == "process" else AsyncCheckpointerType.THREAD
        self.pending = dcp.async_save(state, async_checkpointer_type=kind, process_group=self.group, **where)

    def wait(self) -> None:
        if self.pending is not None:
            self.pending.result()
            self.pending = None


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--output-dir", required=True)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--save-every", type=int, default=3)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=64, help="model width (benchmarks make it larger)")
    p.add_argument("--vocab", type=int, default=128)
    p.add_argument("--resume-from", default=None, help="a DCP folder (step-N) to load before training")
    p.add_argument(
        "--resume-from-store",
        nargs=2,
        metavar=("STORE", "REF"),
        default=None,
        help="load the step REF of STORE straight from the store (TailorStorageReader), every rank",
    )
    p.add_argument(
        "--save-to-store",
        default=None,
        metavar="STORE",
        help="save each step straight into STORE through TailorStorageWriter (no DCP folder written)",
    )
    p.add_argument("--store-policy", default="full", help="the layer policy of --save-to-store")
    p.add_argument(
        "--async-save",
        choices=("thread", "process"),
        default=None,
        help="save with dcp.async_save and this checkpointer type (each save waits for the one before)",
    )
    p.add_argument(
        "--rank-failpoints",
        nargs=2,
        default=None,
        metavar=("RANK", "SPEC"),
        help="TAILOR_FAILPOINTS=SPEC for rank RANK alone (before-part-publish=kill@2: killed at its second part)",
    )
    p.add_argument("--losses-out", default=None)
    p.add_argument("--rss-out", default=None, help="JSON: rank 0's resident memory after each save, in bytes")
    p.add_argument("--final-weights", default=None, help="rank 0 saves the full weights here (safetensors)")
    p.add_argument(
        "--accelerate-layout",
        nargs="?",
        const="trainer",
        choices=("trainer", "save-state"),
        help="save as the HF Trainer with FSDP does: checkpoint-N/ holding pytorch_model_fsdp_0/ and optimizer_0/, "
        "written by Accelerate's own save_fsdp_model and save_fsdp_optimizer; save-state: as Accelerate's "
        "save_state does (checkpoint_N/, the same folders and each rank's random states)",
    )
    args = p.parse_args(argv)

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_state_dict,
        set_state_dict,
    )

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if args.rank_failpoints and rank == int(args.rank_failpoints[0]):  # read once, at the first failpoint reached
        os.environ["TAILOR_FAILPOINTS"] = args.rank_failpoints[1]
    save = Saver(args, Path(args.output_dir))
    model = sharded(build_model(args.layers, args.hidden, args.vocab))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    out = Path(args.output_dir)
    first = 1
    if args.resume_from or args.resume_from_store:
        msd, osd = get_state_dict(model, optim)
        state = {"model": msd, "optim": osd, "train": {"step": 0}}
        if args.resume_from_store:
            from tailorstore import Store
            from tailorstore.integrations.dcp.reader import TailorStorageReader

            location, ref = args.resume_from_store
            with Store.open(location) as store:
                dcp.load(state, storage_reader=TailorStorageReader(store, ref))
        else:
            dcp.load(state, checkpoint_id=args.resume_from)
        set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
        first = int(state["train"]["step"]) + 1
    losses: list[float] = []
    rss: list[int] = []  # rank 0's resident bytes after each save (--rss-out)
    for step in range(first, args.steps + 1):
        losses.append(train_step(model, optim, step, args.vocab))
        if step % args.save_every == 0 and args.accelerate_layout:
            trainer = args.accelerate_layout == "trainer"
            name = f"checkpoint-{step}" if trainer else f"checkpoint_{step}"
            save_as_accelerate(model, optim, out / name, step, rank, trainer=trainer)
        elif step % args.save_every == 0:
            msd, osd = get_state_dict(model, optim)
            save({"model": msd, "optim": osd, "train": {"step": step}}, step)
            if args.rss_out:
                rss.append(resident_bytes())
    save.wait()
    if args.final_weights:
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if rank == 0:
            from safetensors.torch import save_file

            save_file({k: v.contiguous() for k, v in full.items()}, args.final_weights)
    if rank == 0 and args.rss_out:
        Path(args.rss_out).write_text(json.dumps(rss))
    if rank == 0 and args.losses_out:
        Path(args.losses_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.losses_out).write_text(json.dumps({"first": first, "losses": losses}))
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    main()
