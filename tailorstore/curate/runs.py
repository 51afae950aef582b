"""Runs: several lines of training in one store, like git branches.

Steps are numbered per run, so a fine-tune can count from 0 again beside its pre-training.
Blobs are content-addressed and shared by every run: a fine-tune branched from a
pre-training step stores only what changed. ``tailor run create NAME --from [RUN:]step=N``
records the branch point (its *base*): the run's first commits inherit layers from it, its
model must match it, and gc keeps it while the run exists. A run also comes into being at
its first commit (``tailor commit DIR --run NAME``), without a base.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from tailorstore.core.errors import LOCK_TIMEOUT, Call, StepExistsError, UnknownStepError
from tailorstore.core.failpoints import operation
from tailorstore.core.records import MAIN_RUN, ManifestRecord, RunRecord
from tailorstore.store.backends.roles import Writer
from tailorstore.store.manifests import runs as run_objects
from tailorstore.store.repo import Repository


class RunRows(Protocol):
    """The index as runs are listed and created."""

    def runs(self) -> list[RunRecord]: ...

    def created_runs(self) -> dict[str, RunRecord]: ...

    def manifests(self, run: str | None = None) -> list[ManifestRecord]: ...

    def set_runs(self, runs: Iterable[RunRecord]) -> None: ...


@dataclass(frozen=True)
class BaseStep:
    """The step a run branched from."""

    run: str
    step: int
    id: str  # its manifest's id, the same on every host

    @classmethod
    def of(cls, record: ManifestRecord | None) -> BaseStep | None:
        return None if record is None else cls(record.run, record.step, record.name)


@dataclass(frozen=True)
class RunInfo:
    """A run of the store: its name, where it branched from, and how far it has come."""

    name: str
    created_at: float
    base: BaseStep | None  # the step it branched from, if any
    steps: int  # commits of its own
    latest_step: int | None


def qualify(selector: str, run: str | None) -> str:
    """The selector read in ``run``: ``step=N`` and ``latest`` become ``RUN:step=N`` and
    ``RUN:latest``; ``tag=``, ``id=``, ``digest=`` and selectors that already name a run stay as they are."""
    text = selector.strip()
    if run is None or text.startswith(("tag=", "id=", "digest=")) or re.match(r"[A-Za-z0-9._-]+:", text):
        return text
    return f"{run_objects.check_run_name(run)}:{text}"


def list_runs(repo: Repository) -> list[RunInfo]:
    runs = repo.view(RunRows).runs()
    if not any(r.name == MAIN_RUN for r in runs):
        runs.insert(0, RunRecord(MAIN_RUN, 0.0))
    out = []
    for run in runs:
        commits = [m for m in repo.view(RunRows).manifests(run.name) if m.origin == "commit"]
        out.append(
            RunInfo(
                run.name,
                run.created_at,
                BaseStep.of(repo.run_base(run.name)),
                len(commits),
                max((m.step for m in commits), default=None),
            )
        )
    return out


def create_run(
    repo: Repository,
    name: str,
    base_selector: str | None,
    *,
    from_run: str = MAIN_RUN,
    lock_timeout: float = LOCK_TIMEOUT,
) -> RunInfo:
    """Create run ``name``, branched from the manifest ``base_selector`` names (in ``from_run``
    unless it says ``RUN:``), or empty when no base is given.

    It holds the store's shared lock, like a commit: a gc waits for it, then sees the new run
    and keeps its base.
    """
    run_objects.check_run_name(name)
    with operation("run-create"), repo.lock(exclusive=False, timeout=lock_timeout) as lock:
        repo.refresh(lock)
        if name == MAIN_RUN or any(r.name == name for r in repo.view(RunRows).runs()):
            raise StepExistsError(f"run {name!r} already exists; ", Call("runs"), " shows the runs.")
        base: ManifestRecord | None = None
        if base_selector is not None:
            base = repo.manifest(repo.resolve(base_selector, from_run))
            if base.object_key is None:
                raise UnknownStepError(f"step {base.step} has no manifest object yet; run ", Call("verify"), " first.")
        record = RunRecord(name, time.time(), base.object_key if base else None)
        with repo.transaction(RunRows) as edit:
            run_objects.create_run(repo.objects(Writer), record)  # the object first: it is the truth
            edit.set_runs([*edit.created_runs().values(), record])
    return RunInfo(name, record.created_at, BaseStep.of(base), 0, None)
