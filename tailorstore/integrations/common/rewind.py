"""What a training's save does when its step is already in the store: a rewind.

Going back to an earlier step after a loss spike is routine: training resumes from step 4
after step 6 was committed, and saves step 6 again. That save is another history from step 4
on, not a repair of the first one, so by default (``on_existing="branch"``) it and every later
save of this training go to a new run branched at the step training resumed from, as git
would make a branch; one warning line says so. ``"replace"`` replaces the step (``force``), and
``"error"`` raises :class:`StepExistsError` as a plain commit does. No step is ever replaced
silently.

The DeepSpeed engine, ``save_checkpoint`` and the HF callback share this, and also the warning
given when training resumes from a composite (some layers come from earlier steps), which
``tailor checkout`` gives too.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tailorstore import CommitResult
from tailorstore.api import Store
from tailorstore.core.errors import StepExistsError, StoreError
from tailorstore.integrations.common.store_session import COMMIT, StoreSession

log = logging.getLogger("tailorstore")

ON_EXISTING = ("branch", "replace", "error")


def check_on_existing(value: str) -> str:
    if value not in ON_EXISTING:
        raise StoreError(f"on_existing={value!r} is not allowed: give one of {', '.join(map(repr, ON_EXISTING))}.")
    return value


@dataclass
class Rewind:
    """The run a training's saves go to, and how it reacts to a step that is already there."""

    on_existing: str = "branch"
    run: str | None = None  # once branched, the run saves go to (None: the store handle's run)
    resumed_step: int | None = None  # the step training last resumed from, where a branch starts

    def __post_init__(self) -> None:
        check_on_existing(self.on_existing)

    def commit(self, store: Store, path: str | os.PathLike, *, step: int | None, **options: Any) -> CommitResult:
        """``store.commit`` of one save at ``step``, in this training's run."""
        run = self.run or store.run
        try:
            return store.commit(path, step=step, run=run, **options)
        except StepExistsError:
            if step is None or self.on_existing == "error":
                raise
        if self.on_existing == "replace":
            log.warning("tailorstore: step %d is already in run %r; replacing it (on_existing='replace')", step, run)
            return store.commit(path, step=step, run=run, force=True, **options)
        self.run = self.branch(store, run, step)
        return store.commit(path, step=step, run=self.run, **options)

    def run_for(self, store: Store, step: int) -> str:
        """The run a save of ``step`` goes to, decided before a commit that cannot retry (the
        rank-parallel one, whose ranks must agree): a branch is created here when the step is
        already held. ``"replace"`` removes the held step first (that commit path cannot replace
        in one transaction, so until the new one is recorded the step is gone; its save is still
        on disk)."""
        run = self.run or store.run
        if not StoreSession(store).holds(step, run=run):
            return run
        if self.on_existing == "error":
            raise StepExistsError(f"step {step} is already in run {run!r}; on_existing='error' refuses a second save")
        if self.on_existing == "replace":
            log.warning("tailorstore: step %d is already in run %r; replacing it (on_existing='replace')", step, run)
            store.remove(f"{run}:step={step}", force=True)
            return run
        self.run = self.branch(store, run, step)
        return self.run

    def branch(self, store: Store, run: str, step: int) -> str:
        """Create the run this training goes on in, branched where it resumed; say so in one line."""
        steps = sorted(s.step for s in store.log(run=run) if s.origin == COMMIT)
        base = self.resumed_step if self.resumed_step is not None and self.resumed_step < step else None
        if base is None or base not in steps:
            base = max((s for s in steps if s < step), default=None)
        taken = {r.name for r in store.runs()}
        stem = f"{run[:80]}-from-{base}" if base is not None else f"{run[:80]}-rewound"
        name = next(n for i in range(1, len(taken) + 2) if (n := stem if i == 1 else f"{stem}-{i}") not in taken)
        store.create_run(name, base=f"{run}:step={base}" if base is not None else None)
        log.warning(
            "tailorstore: step %d is already in run %r, so training went back (it resumed from step %s); "
            "this save and the ones after it go to a new run %r branched there (on_existing='branch'; "
            "'replace' or 'error' do otherwise)",
            step,
            run,
            base if base is not None else "?",
            name,
        )
        return name


def warn_if_composite(step: int, inherited: Mapping[str, int]) -> None:
    """One warning when the step training resumes from is a composite (``inherited``: layer -> the
    step it comes from, as ``CheckoutResult.inherited`` says), as a checkout gives: its losses will
    differ from an exact resume, and this says why."""
    if inherited:
        layers = ", ".join(f"{k} (step {v})" for k, v in list(inherited.items())[:6])
        more = f" and {len(inherited) - 6} more" if len(inherited) > 6 else ""
        log.warning(
            "tailorstore: resuming from step %d, a composite: %d layer(s) come from earlier steps: %s%s",
            step,
            len(inherited),
            layers,
            more,
        )
