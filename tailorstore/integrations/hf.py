"""The Hugging Face Trainer: commit every ``checkpoint-N`` as the Trainer saves it.

::

    from tailorstore.integrations.hf import TailorCallback

    trainer = Trainer(..., callbacks=[TailorCallback("ckpt-store", delete_after_commit=True)])
    trainer.train()

    # to resume (on every rank): the store's newest step of the run, checked out for this world size
    from tailorstore.integrations.hf import checkout_for_resume

    folder = checkout_for_resume("ckpt-store", "restored")  # None: the run holds no step yet
    trainer.train(resume_from_checkpoint=folder)

In a distributed run the commit is rank-parallel, under every policy
(:mod:`tailorstore.integrations.common.distributed`): every rank writes its own files' blobs, the
policy is decided once from every rank's survey, and global rank 0 finalizes the one manifest,
the one a single-process commit would record. Background commits then talk over a process group
of their own, so their collectives never interleave with training's.

With ``save_total_limit``, the Trainer deletes the oldest checkpoint when it writes the next
one; the callback therefore waits for the commits in flight before each save, so a commit
never reads a folder the Trainer is deleting.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from collections.abc import Collection
from pathlib import Path
from typing import Any

import torch.distributed as dist
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from tailorstore.api import Store
from tailorstore.core.errors import MetricError, StoreError
from tailorstore.core.metric_values import checked
from tailorstore.core.policies import Policy, policy_spec
from tailorstore.integrations.common.distributed import RankParallelResult, commit_rank_parallel
from tailorstore.integrations.common.ranks import is_distributed, local_rank_and_size, rank
from tailorstore.integrations.common.rewind import Rewind, warn_if_composite
from tailorstore.integrations.common.session import Session
from tailorstore.integrations.common.store_session import StoreSession, opened_store


def evaluation_metrics(state: TrainerState, names: Collection[str] | None = None) -> dict[str, float]:
    """The Trainer's metrics at this step: from the log entries at ``state.global_step`` (the Trainer
    evaluates before it saves at a step where both fall), every evaluation metric (``eval_loss``,
    ...) unless ``names`` are given, else exactly those, from any entry of the step (``loss`` and
    ``grad_norm`` of the training log too). Metrics of an earlier step are not this step's, and are
    left out."""
    found: dict[str, float] = {}
    for entry in state.log_history or []:
        if not isinstance(entry, dict) or entry.get("step") != state.global_step:
            continue
        for key, value in entry.items():
            if not isinstance(key, str) or not isinstance(value, int | float) or isinstance(value, bool):
                continue
            if key.startswith("eval_") if names is None else key in names:
                found[key] = float(value)
    return found


def _metric_names(names: Collection[str] | None) -> frozenset[str] | None:
    """The names to keep, checked as a recorded metric's name is (a string would be its letters)."""
    if names is None:
        return None
    if isinstance(names, str | bytes) or not all(isinstance(n, str) for n in names):
        raise MetricError(f"metrics={names!r}: give a list of metric names, such as ['eval_loss']")
    checked(dict.fromkeys(names, 0.0))  # names only: 1-100 of letters, digits, ._-/:, at most 64
    return frozenset(names)


class TailorCallback(TrainerCallback):
    def __init__(
        self,
        store: Store | str | os.PathLike,
        *,
        policy: str | Policy = "full",
        delete_after_commit: bool = False,
        asynchronous: bool = True,
        on_existing: str = "branch",
        metrics: Collection[str] | None = None,
        **policy_params: float,
    ) -> None:
        """``metrics``: the names of the Trainer's logged metrics to record with each step (the
        evaluation's ``eval_loss``, the training log's ``loss``); None records every evaluation
        metric of the step, an empty list none."""
        self.rewind = Rewind(on_existing)  # a save of a step the store holds: a rewind (common/rewind.py)
        self._store_arg = store
        self._store: Store | None = store if isinstance(store, Store) else None
        self.spec = policy_spec(policy, policy_params)  # a misspelt parameter fails here, not at the first save
        self.policy = policy
        self.policy_params = policy_params
        self.delete_after_commit = delete_after_commit
        self.asynchronous = asynchronous
        self._group: Any = None  # the background commits' own process group
        self.metrics = _metric_names(metrics)  # a misspelt name fails here too

    def _open(self) -> Store:
        if self._store is None:
            self._store = Store.open(self._store_arg)  # type: ignore[arg-type]
        return self._store

    def rank_parallel(self) -> bool:
        """Whether every rank commits its own files (a distributed run, under any policy)."""
        return is_distributed() and dist.get_world_size() > 1

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any) -> None:
        if self.rank_parallel() and self.asynchronous and self._group is None:
            self._group = dist.new_group(backend="gloo")  # collective: every rank calls on_train_begin
        if state.global_step > 0:  # resumed (the Trainer has loaded the checkpoint's state by now)
            self.rewind.resumed_step = state.global_step
            if state.is_world_process_zero:
                store = self._open()
                try:  # the Trainer loaded the checkpoint itself: ask the store what the step holds
                    detail = store.show(f"{self.rewind.run or store.run}:step={state.global_step}")
                except StoreError:
                    return  # a step the store does not hold: nothing to say about it
                step = detail.summary.step
                warn_if_composite(step, {x.layer: x.source_step for x in detail.layers if x.source_step != step})

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any) -> None:
        if control.should_save and self._store is not None and args.save_total_limit:
            self._store.flush()  # the coming save may delete a folder a commit is still reading

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any) -> None:
        folder = Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
        metrics = evaluation_metrics(state, self.metrics)
        if self.rank_parallel():
            store = self._open()
            step = state.global_step
            if self.asynchronous:
                in_order = StoreSession(store).background
                in_order(str(folder), lambda handle: self._commit_parallel(handle, folder, step, metrics))
            else:
                self._commit_parallel(store, folder, step, metrics)
            return
        if not state.is_world_process_zero:
            return
        store = self._open()
        options: dict[str, Any] = {"policy": self.policy, **self.policy_params, "metrics": metrics or None}
        step = state.global_step

        def job(handle: Store) -> Any:
            delete = self.delete_after_commit
            return self.rewind.commit(handle, folder, step=step, delete_after_commit=delete, **options)

        if self.asynchronous:
            StoreSession(store).background(str(folder), job)
        else:
            job(store)

    def _commit_parallel(
        self, store: Store, folder: Path, step: int, metrics: dict[str, float] | None = None
    ) -> RankParallelResult:
        """Every rank's share, rank 0's manifest; rank 0 deletes the folder once its blobs are checked.
        Rank 0 decides the run first (a rewind may branch one) and every rank commits to it."""
        run = Session(self._group).decide(lambda: self.rewind.run_for(store, step), f"choosing the run of step {step}")
        self.rewind.run = run
        if run != store.run:
            store = StoreSession(store).in_run(run).store
        result = commit_rank_parallel(
            store, folder, step=step, group=self._group, policy=self.policy, metrics=metrics or None,
            **self.policy_params,
        )  # fmt: skip
        if self.delete_after_commit and rank() == 0:
            StoreSession(store).delete_once_durable(result.finalized.manifest, folder)
        return result

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any) -> None:
        if self._store is not None:
            self._store.flush()

    def close(self) -> None:
        """Flush and close the store this callback opened (one passed in stays open)."""
        if self._store is not None and not isinstance(self._store_arg, Store):
            self._store.close()
            self._store = None


def checkout_for_resume(
    store: Store | str | os.PathLike, into: str | os.PathLike, *, ref: str | None = None
) -> str | None:
    """The folder to hand to ``trainer.train(resume_from_checkpoint=...)``: ``ref`` (default: the
    newest whole step of the store's run) checked out under ``into`` as ``checkpoint-N``, for this
    job's world size; None where the run holds no step yet (train from the start).

    Collective in a distributed run (every rank calls it, after the Trainer is built): the step is
    chosen once, on global rank 0, by its manifest id, so no rank can resume another step (a
    commit landing meanwhile, or a folder one rank sees and another does not); each node's first
    rank checks it out, every byte hash-checked, into a fresh folder renamed into place, so a
    killed checkout never leaves a half folder under the name the Trainer loads. Every rank returns
    the same path, or raises the same :class:`RanksFailedError`."""
    session = Session.open()
    world = dist.get_world_size() if is_distributed() else 1

    def choose() -> tuple[str, int, int | None] | None:
        with _opened(store) as handle:
            if ref is not None:
                chosen = handle.step(ref)
            else:
                whole = [s for s in handle.log() if s.tier is None]
                if not whole:
                    return None
                chosen = max(whole, key=lambda s: (s.step, s.created_at))
            return chosen.id, chosen.step, chosen.world_size

    decided = session.decide(choose, "choosing the step to resume")
    if decided is None:
        return None
    ident, step, saved_world = decided
    target = Path(into) / f"{PREFIX_CHECKPOINT_DIR}-{step}"

    def fetch() -> None:
        if local_rank_and_size()[0] != 0:
            return  # the node's first rank writes the node's copy
        resharded = saved_world is not None and saved_world != world
        with _opened(store) as handle:
            _checkout_into(handle, f"id={ident}", target, world if resharded else None)

    session.all_or_none(fetch, f"checking out step {step} to resume")
    return str(target)


def _opened(store: Store | str | os.PathLike) -> contextlib.AbstractContextManager[Store]:
    """``store`` for one use: the one given (left open), or one opened from its location (closed after)."""
    return contextlib.nullcontext(store) if isinstance(store, Store) else opened_store(store)

def _checkout_into(store: Store, ref: str, target: Path, world_size: int | None) -> None:
    """``ref`` checked out as ``target``: written beside it under a name of its own, then renamed
    in; a folder already there (an earlier resume's) is moved aside first and removed."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fresh = target.parent / f".{target.name}.{uuid.uuid4().hex[:12]}.tmp"
    try:
        store.checkout(ref, fresh, world_size=world_size)
        if target.exists() or target.is_symlink():
            aside = target.parent / f".{target.name}.{uuid.uuid4().hex[:12]}.old"
            os.rename(target, aside)
            shutil.rmtree(aside, ignore_errors=True)
        os.rename(fresh, target)
    finally:
        if fresh.exists():
            shutil.rmtree(fresh, ignore_errors=True)
