"""Megatron-Core on CPU ranks over gloo: the shims a machine without a GPU needs, in the harness only.

Megatron-Core's ``dist_checkpointing`` calls ``torch.cuda.synchronize()`` around a save and
places buffers on ``torch.cuda.current_device()``; on a CPU machine the first raises and the
second has no device to name. The tests make the first a no-op and the second answer ``"cpu"``,
and attention's fork of the CUDA RNG (around a dropout of p=0 here) a plain context
(Megatron-LM PR 6270 removes the first upstream; Megatron-Bridge wraps CPU conversion the same
way). The library never does this: it runs beside Megatron as Megatron runs.
"""

from __future__ import annotations

import os
import warnings

import torch


def cpu_shims() -> None:
    """Make the two CUDA calls Megatron's checkpointing makes harmless on a CPU-only machine."""
    torch.cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    import contextlib

    from megatron.core.tensor_parallel import random as megatron_random

    # attention forks the CUDA RNG around its dropout (p=0 here); the fork reads CUDA's RNG state
    tracker = megatron_random.get_cuda_rng_tracker()
    tracker.fork = lambda *a, **k: contextlib.nullcontext()  # type: ignore[method-assign]
    warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex.*")
    warnings.filterwarnings("ignore", message=".*Apex is not installed.*")


def init_parallel(tp: int = 1, pp: int = 1) -> None:
    """gloo ranks as torchrun started them, and Megatron's model-parallel groups over them."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    if not dist.is_initialized():
        dist.init_process_group("gloo", rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
