"""The engine's load path: ``engine.load_checkpoint`` through the store, and the checkpoint engine's
``load`` of each file DeepSpeed reads.

Which way every rank loads, and which step, global rank 0 decides once (``Session.decide``): a tag
folder on disk that holds DeepSpeed's model states is loaded as it is; otherwise the step the tag
(or ``latest``, or the job's head, :mod:`.head`) names in the engine's run. Every rank then builds
the files it loads straight from the store, in memory (:mod:`.serving`, :mod:`.resume`), or, with
``staged_resume`` or an engine that cannot be served, each node's leader checks its ranks' share
out into the engine's staging folder, every rank loads it through the allowlist, and it is
deleted. Nothing to resume returns ``(None, None)``, as DeepSpeed does without a checkpoint.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from tailorstore import StepObjects
from tailorstore.api import Store
from tailorstore.core.errors import StoreError, UnknownStepError
from tailorstore.integrations.common.rewind import Rewind, warn_if_composite
from tailorstore.integrations.common.store_session import (
    COMMIT,
    has_latest,
    is_model_states,
    load_torch_file,
    read_latest,
)
from tailorstore.integrations.deepspeed import resume, serving
from tailorstore.integrations.deepspeed.head import HEAD_FILE, read_head
from tailorstore.integrations.deepspeed.helpers import RESTORE_PREFIX, log, step_of_tag
from tailorstore.integrations.deepspeed.staged_reads import below, load_staged
from tailorstore.integrations.deepspeed.startup import Started


class LoadPath:
    """One engine's resumes. ``rewind`` is the engine's: a resume sets the step a later save of a
    step the store holds branches from, and the run the job's head names."""

    def __init__(
        self,
        started: Started,
        rewind: Rewind,
        *,
        shape: Callable[[], tuple[int, int]] | None = None,
        staged_resume: bool = False,
    ) -> None:
        self.session, self.store, self.folder = started.session, started.store, started.folder
        self.rewind = rewind
        self._shape = shape
        # a resume loads each rank's files straight from the store (serving.py); ``staged_resume``
        # checks the step out into staging files first, as before (DeepSpeed then reads them)
        self._staged_resume = staged_resume
        self._resumes = 0

    def _restore_folder(self) -> Path:
        """Where this resume's files are staged (or named, when served: never made)."""
        return self.folder.root / f"{RESTORE_PREFIX}{self._resumes:06d}"

    def load(self, path: str, map_location: Any = None) -> Any:
        """Files come from a checkout of the store; loaded with the allowlist, never running unknown code.

        A model-states file this engine staged for a resume is mapped, not read (:func:`mapped`);
        a resume served from the store hands over its objects instead (:mod:`.serving`)."""
        if self._restoring(path):
            return load_staged(path)
        return load_torch_file(path, mmap=False)[0]

    def _restoring(self, path: str) -> bool:
        """Whether ``path`` lies in a restore folder of this engine's staging."""
        inside = below(path, self.folder.root)
        return bool(inside and inside.parts[0].startswith(RESTORE_PREFIX))

    def load_checkpoint(self, original: Callable[..., Any], load_dir: str, tag: str | None = None, **kw: Any) -> Any:
        """``engine.load_checkpoint`` through the store: a folder on disk is loaded as it is; otherwise
        the step is written into each node's staging folder for the world size and ZeRO stage
        training runs at now (:mod:`.resume`), every rank loads it, and it is deleted. Nothing to
        resume (no step in the store, nothing on disk) returns ``(None, None)``, as DeepSpeed does.

        Which of these it is, and which step, is decided once, on global rank 0, for every rank
        (:meth:`_plan`): a rank that looked at the folder itself could see what rank 0 was deleting."""
        plan = self.session.decide(lambda: self._plan(tag, Path(load_dir)), f"resuming from {load_dir}")
        if plan.on_disk:
            return original(load_dir, plan.tag, **kw)
        if plan.found is None:
            return None, None
        found = plan.found
        self.folder.hold()
        world_size, zero_stage = self._shape() if self._shape else (1, 0)
        engine = getattr(original, "__self__", None)
        if not self._staged_resume and engine is not None and serving.servable(engine):
            loaded = resume.load_in_memory(
                self.store,
                found,
                lambda objects, built: self._load_served(engine, original, objects, built, kw),
                world_size,
                zero_stage,
                self.session,
            )
        else:
            loaded = resume.restore_and_load(
                self.store,
                found,
                lambda folder, restored_tag: original(folder, restored_tag, **kw),
                self._restore_folder(),
                world_size,
                zero_stage,
                self.session,
            )
        self.rewind.resumed_step = found.step  # a save of a step after it that the store holds branches here
        self._resumes += 1
        return loaded

    def _plan(self, tag: str | None, load_dir: Path) -> _Plan:
        """Global rank 0: how every rank loads. The tag is the one given, else the one ``latest``
        names; a tag folder on disk that holds DeepSpeed's model states is loaded from disk,
        anything else from the store (:meth:`_find`; None there: nothing to resume)."""
        from_latest = tag is None
        if tag is None and has_latest(load_dir):
            tag = read_latest(load_dir)
        if tag and any(is_model_states(p.name) for p in (load_dir / tag).glob("*")):
            return _Plan(tag, on_disk=True)
        if self.store is None:
            raise StoreError("global rank 0 needs the store to resume from")
        found = self._find(self.store, tag, load_dir, from_latest)
        if found is not None:
            found = replace(found, location=self.store.location)
        return _Plan(tag, on_disk=False, found=found)

    def _load_served(
        self, engine: Any, original: Callable[..., Any], objects: StepObjects, built: dict[str, Any], kw: dict
    ) -> Any:
        """DeepSpeed's own ``load_checkpoint`` over the step's objects (:mod:`.serving`); no file is written."""
        root = self._restore_folder()  # a name only: the folder is never made
        with serving.served(engine, root, objects, built):
            return original(str(root), objects.tag, **kw)

    def _find(self, store: Store, tag: str | None, load_dir: Path, from_latest: bool) -> resume.Found | None:
        """Rank 0: the step ``tag`` names in this engine's run (the latest without one). Without a
        run of its own yet, the engine takes the run its head names (head.py): a restart after a
        rewind goes on in the run the rewind branched, not in the one the user abandoned.

        Loading what ``latest`` names: a step the store lacks (the job died before its commit, and
        its save was cut short or refused) resumes from the head's own step, saying so; and with
        no step in the run at all (the first launch, or a first save that never got in), there is
        nothing to resume (None), as DeepSpeed without a checkpoint says."""
        store.flush()  # the step asked for may still be committing
        step = step_of_tag(tag) if tag else None
        if tag and step is None:
            raise StoreError(f"the DeepSpeed tag {tag!r} names no step; load 'global_stepN' or leave tag=None")
        head = read_head(load_dir) if self.rewind.run is None else None
        if head is not None and not head.matches(store.id):
            head = None  # written for another store
        if head is not None:
            self.rewind.run = head.run
        run = self.rewind.run or store.run
        if from_latest and not _holds_any(store, run):
            log.warning(
                "tailorstore: %s; run %r of the store holds no step to resume from; training starts fresh "
                "(load_checkpoint returns (None, None), as DeepSpeed's does without a checkpoint)",
                f"{load_dir / 'latest'} names {tag}, which is not on disk"
                if tag
                else f"no tag and no {load_dir / 'latest'}",
                run,
            )
            return None
        try:
            found = resume.find(store, f"{run}:step={step}" if step is not None else f"{run}:latest")
        except UnknownStepError:
            if not (from_latest and step is not None and head is not None):
                raise
            log.warning(
                "tailorstore: %s names step %d, which run %r of the store lacks (the job stopped before it was "
                "committed); resuming from step %d, the last step this training committed",
                load_dir / "latest",
                step,
                run,
                head.step,
            )
            found = resume.find(store, f"{run}:step={head.step}")
        if head is not None and from_latest and found.step != head.step and found.created_at < head.created_at:
            log.warning(  # what is known, no more: how the two came apart (a stale latest, a rewind) is not
                "tailorstore: %s names step %d; run %r holds a step %d recorded before step %d, the last step "
                "this training committed (%s), so it resumes from step %d",
                load_dir / "latest",
                found.step,
                run,
                found.step,
                head.step,
                HEAD_FILE,
                head.step,
            )
            found = resume.find(store, f"{run}:step={head.step}")
        _warn_if_in_several_runs(store, run, found.step)
        warn_if_composite(found.step, found.inherited)
        return found


@dataclass(frozen=True)
class _Plan:
    """How every rank resumes, as global rank 0 decided it."""

    tag: str | None  # the tag asked for, or the one ``latest`` names
    on_disk: bool  # DeepSpeed loads ``load_dir/tag`` itself
    found: resume.Found | None = None  # else this step of the store (None: nothing to resume)


def _holds_any(store: Store, run: str) -> bool:
    """Whether ``run`` has a step to resume from (its own, or its base's)."""
    try:
        store.step(f"{run}:latest")
    except UnknownStepError:
        return False
    return True


def _warn_if_in_several_runs(store: Store, run: str, step: int) -> None:
    """One line when the step a resume loads is in other runs too (a rewind branched after it): the
    tag ``global_stepN`` names a step in each, and the user should know which one training takes."""
    others = [
        r.name
        for r in store.runs()
        if r.name != run and r.steps and any(s.step == step for s in store.log(run=r.name) if s.origin == COMMIT)
    ]
    if others:
        log.warning(
            "tailorstore: step %d is in run(s) %s too; resuming run %r's (the run this training commits to)",
            step,
            ", ".join(map(repr, others)),
            run,
        )
