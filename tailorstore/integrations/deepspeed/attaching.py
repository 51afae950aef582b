"""``attach(engine, store)``: the collective call that starts a :class:`TailorCheckpointEngine`, puts
it in DeepSpeed's engine, and guards the parameters a snapshot still copies from the next optimizer
step.

Call order, on every rank: the options are checked (a misspelt policy parameter fails before any
rank waits for another); the engine's start-up runs, once (:func:`.startup.start_up`, whose
docstring numbers its steps: the rank session, the nodes' parts and a killed job's saves whose
parts are all in, the staging folder, the recovery of dead runs' staging and its commit); the
engine is built over what it left (:func:`start_engine`); then ``attach`` installs it as DeepSpeed's
checkpoint engine, guards the optimizer step, and routes ``engine.load_checkpoint`` through it.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

import torch

from tailorstore.api import Store
from tailorstore.core.policies import Policy, policy_spec
from tailorstore.integrations.common import ranks
from tailorstore.integrations.common.rewind import check_on_existing
from tailorstore.integrations.deepspeed.engine import TailorCheckpointEngine
from tailorstore.integrations.deepspeed.helpers import shape_of
from tailorstore.integrations.deepspeed.startup import start_up


def attach(
    engine: Any,
    store: Store | None,
    *,
    policy: str | Policy = "full",
    asynchronous: bool = True,
    staging: str | os.PathLike | None = None,
    on_existing: str = "branch",
    snapshot: bool = True,
    gpu_buffers: bool | None = None,
    metrics: Callable[[int | None], Mapping[str, float] | None] | None = None,
    staged_resume: bool = False,
    **policy_params: float,
) -> TailorCheckpointEngine:
    """Install a :class:`TailorCheckpointEngine` on a DeepSpeed engine, on every rank (collective).

    ``engine.save_checkpoint`` then saves into the store and ``engine.load_checkpoint`` resumes
    from it (a tag folder that exists on disk is still loaded from disk). ``on_existing`` says what
    a save of a step the store already holds does, after training went back to an earlier step:
    ``"branch"`` (a new run from the resumed step, with a warning), ``"replace"`` or ``"error"``.
    ``snapshot`` (default) makes ``save_checkpoint`` block only for a copy of the tensors into
    reused memory; the files are written in the background (:mod:`.snapshot`). On a GPU the copy
    runs beside the next step, and its optimizer step waits (on the GPU) only for the copy into
    ``gpu_buffers``: buffers in GPU memory kept from save to save, used where the GPU has room
    (None), always (True) or never (False: the step waits for the copy to host memory).
    ``metrics(step)``
    (on global rank 0) gives the metrics recorded with each saved step, e.g. the last evaluation's
    ``{"eval_loss": ...}``; or call ``tailor.set_metrics({...})`` before a save.
    ``engine.load_checkpoint`` then loads each rank's files straight from the store, built in memory
    (nothing staged); ``staged_resume=True`` checks the step out into staging files first instead.
    """
    tailor = start_engine(
        store,
        policy=policy,
        asynchronous=asynchronous,
        staging=staging,
        global_steps=lambda: int(engine.global_steps),
        on_existing=on_existing,
        shape=lambda: shape_of(engine),
        snapshot=snapshot,
        gpu_buffers=gpu_buffers,
        metrics=metrics,
        staged_resume=staged_resume,
        **policy_params,
    )
    engine.checkpoint_engine = tailor
    if snapshot:
        _guard_changes(engine, tailor)
    if tailor.started.parts and ranks.is_leader():
        # Each node's part needs the model states to cut its optimizer states by parameter: every
        # node's leader writes them, as DeepSpeed's use_node_local_storage makes it do. The copies
        # are the same bytes, which finalize checks.
        engine.save_non_zero_checkpoint = True
    original = engine.load_checkpoint

    def load_checkpoint(load_dir: str, tag: str | None = None, **kw: Any) -> Any:
        return tailor.load_checkpoint(original, load_dir, tag, **kw)

    engine.load_checkpoint = load_checkpoint
    return tailor


def start_engine(
    store: Store | None,
    *,
    policy: str | Policy = "full",
    asynchronous: bool = True,
    staging: str | os.PathLike | None = None,
    global_steps: Callable[[], int] | None = None,
    on_existing: str = "branch",
    shape: Callable[[], tuple[int, int]] | None = None,
    snapshot: bool = True,
    gpu_buffers: bool | None = None,
    metrics: Callable[[int | None], Mapping[str, float] | None] | None = None,
    staged_resume: bool = False,
    **policy_params: float,
) -> TailorCheckpointEngine:
    """A :class:`TailorCheckpointEngine`, started (collective: every rank calls it): what :func:`attach`
    does before it installs the engine, and all of it for a caller without a DeepSpeed engine. The
    policy and ``on_existing`` are checked first, alike on every rank, so a misspelt one fails before
    any rank waits in a collective; then :func:`.startup.start_up` runs, once, and the engine is
    built over what it left (``global_steps`` and ``shape`` say the step and the world size and ZeRO
    stage training is at; :func:`attach` takes them from DeepSpeed's engine)."""
    policy_spec(policy, policy_params)  # a misspelt parameter fails here, not at the first save
    check_on_existing(on_existing)
    started = start_up(store, staging=staging, on_existing=on_existing)
    return TailorCheckpointEngine(
        started, policy=policy, asynchronous=asynchronous, global_steps=global_steps, on_existing=on_existing,
        shape=shape, snapshot=snapshot, gpu_buffers=gpu_buffers, metrics=metrics, staged_resume=staged_resume,
        **policy_params,
    )  # fmt: skip


def _guard_changes(engine: Any, tailor: TailorCheckpointEngine) -> None:
    """A snapshot's copies out of GPU memory run beside the next step, so whatever changes the
    saved tensors first waits for them: each torch optimizer under the engine's (ZeRO wraps one)
    before its step, or else ``engine.step``; and the module's forward where it has persistent
    buffers, which a forward may update in place (running statistics)."""

    def wait(*_: Any, **__: Any) -> None:
        tailor.before_change()

    optimizers = _torch_optimizers(getattr(engine, "optimizer", None))
    for optimizer in optimizers:
        optimizer.register_step_pre_hook(wait)
    if not optimizers:
        step = engine.step

        def guarded_step(*args: Any, **kw: Any) -> Any:
            tailor.before_change()
            return step(*args, **kw)

        engine.step = guarded_step
    module = getattr(engine, "module", None)
    if isinstance(module, torch.nn.Module) and _has_persistent_buffers(module):
        module.register_forward_pre_hook(wait)


def _torch_optimizers(optimizer: Any, depth: int = 4) -> list[torch.optim.Optimizer]:
    """The torch optimizers in a chain of wrappers (``engine.optimizer.optimizer``...)."""
    found: list[torch.optim.Optimizer] = []
    while optimizer is not None and depth > 0:
        if isinstance(optimizer, torch.optim.Optimizer):
            found.append(optimizer)
        optimizer, depth = getattr(optimizer, "optimizer", None), depth - 1
    return found


def _has_persistent_buffers(module: torch.nn.Module) -> bool:
    return any(
        name not in sub._non_persistent_buffers_set
        for sub in module.modules()
        for name, b in sub._buffers.items()
        if b is not None
    )
