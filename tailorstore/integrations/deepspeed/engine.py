"""``TailorCheckpointEngine``: DeepSpeed's checkpoint engine, saving into the store.

``engine.save_checkpoint`` hands each file to the engine, which serializes it into a staging
folder in memory (``/dev/shm``, or ``$TAILOR_STAGING``), never into ``save_dir``. Once every rank
has saved, global rank 0 commits the staged step through the same container path as ``tailor
commit`` (one process, so every policy works) and deletes the staged copy once the manifest is
durable and its blobs are checked. DeepSpeed still writes its small ``latest`` pointer and
recovery scripts into ``save_dir`` itself.

Call order, as DeepSpeed makes it on every rank: ``create(info)`` once a save begins;
``makedirs`` and ``save(state_dict, path)`` for each file; ``commit(info)`` once the rank's
files are written (global rank 0 then submits the step's commit); ``load(path)`` for each file
of a resume, inside :meth:`TailorCheckpointEngine.load_checkpoint`; ``flush`` before exit.

If a background commit fails, its staged files are moved to where DeepSpeed would have written
them (``save_dir/tag``), so nothing is lost, and the error is raised at the next save or at
:meth:`TailorCheckpointEngine.flush`. What a killed run left staged (perhaps cut short) is moved by
the next engine to start beside that folder, under a name DeepSpeed never loads, and global
rank 0 commits it from there (:mod:`.staging`, :mod:`.recovery`).
"""

from __future__ import annotations

import errno
import os
import secrets
import shutil
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo, CheckpointEngine

from tailorstore import CommitResult, StepObjects
from tailorstore.api import Store
from tailorstore.core.environment import STAGING_ENV
from tailorstore.core.errors import Call, StoreError, UnknownStepError
from tailorstore.core.metrics import checked as checked_metrics
from tailorstore.core.policies import Policy, policy_spec
from tailorstore.integrations.common import ranks
from tailorstore.integrations.common.distributed import RankParallelResult, commit_rank_parallel
from tailorstore.integrations.common.rewind import Rewind, warn_if_composite
from tailorstore.integrations.common.session import Session
from tailorstore.integrations.common.store_session import (
    COMMIT,
    StoreSession,
    is_model_states,
    load_torch_file,
    owner_of,
    read_latest,
)
from tailorstore.integrations.deepspeed import nodes, resume, serving, snapshot
from tailorstore.integrations.deepspeed import staging as staged
from tailorstore.integrations.deepspeed.head import read_head
from tailorstore.integrations.deepspeed.helpers import ENGINE_NAME, RESTORE_PREFIX, T, default_staging, log, step_of_tag
from tailorstore.integrations.deepspeed.recovery import commit_recovered, name_in_head
from tailorstore.integrations.deepspeed.snapshot import Snapshots
from tailorstore.integrations.deepspeed.staged_reads import below, load_staged


class TailorCheckpointEngine(CheckpointEngine):
    """A DeepSpeed checkpoint engine whose saves go into a tailorstore store.

    Build it with :func:`attach`, which also routes ``engine.load_checkpoint`` through it.
    ``store`` is needed on global rank 0 only. ``policy`` and its parameters choose the layers
    stored at each step, as in :meth:`Store.commit`.
    """

    def __init__(
        self,
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
    ) -> None:
        super().__init__(None)
        # a resume loads each rank's files straight from the store (serving.py); ``staged_resume``
        # checks the step out into staging files first, as before (DeepSpeed then reads them)
        self._staged_resume = staged_resume
        self._metrics_of = metrics  # called on global rank 0 with the step of each save it commits
        self._pending_metrics: dict[str, float] | None = None  # set_metrics: for the next save only
        self.rewind = Rewind(on_existing)  # a save of a step the store holds: a rewind (rewind.py)
        self.name = ENGINE_NAME
        self.group = ranks.tailor_group()  # our collectives never interleave with training's, and time out
        # every choice more than one rank acts on is made once, on global rank 0 (session.py)
        self.session = Session(self.group)
        self.session.decide(lambda: _needs_store(store), "starting the TailorCheckpointEngine")
        # global rank 0 commits; each node's local rank 0 may hold one to resume from (resume.py)
        self.store = store if ranks.rank() == 0 or ranks.is_leader() else None
        self._shape = shape
        # Several nodes, each leader with a store: each node commits its own ranks' files as a part
        # and global rank 0 finalizes the step, so no folder but the store is shared (nodes.py).
        self._parts = nodes.parts_possible(store, self.group)  # the leader ranks, or empty
        # the leaders' own group: their background commits decide a policy together over it
        self._leaders_group = nodes.leaders_group(self._parts)
        if self._parts and ranks.rank() == 0:
            assert store is not None
            nodes.finish_pending(store)  # a killed job's saves whose every part is in
        policy_spec(policy, policy_params)  # a misspelt parameter fails here, not at the first save
        self.policy = policy
        self.policy_params = dict(policy_params)
        self.asynchronous = asynchronous
        self._global_steps = global_steps
        # One folder per engine, the same on every rank: rank 0 commits what all ranks staged.
        token = self.session.decide(lambda: f"{staged.PREFIX}{os.getpid()}-{secrets.token_hex(4)}")
        self.staging = Path(staging) if staging is not None else default_staging()
        # A killed run's staged saves leave staging, each beside where DeepSpeed would have put it
        # under a name DeepSpeed never loads. No rank creates its folder before every rank of the
        # node has recovered: a recovery takes a folder nobody holds yet for a dead run's, between
        # its creation and its lock (``each`` is that barrier).
        every = self.session.each(lambda: staged.recover(self.staging), "recovering a dead run's staging")
        rescued = [one for mine in every for one in mine]
        # Rank 0 commits them (or keeps them aside) before any rank goes on: every rank decides how to
        # load only once the recovery is finished.
        self.recovered = self.session.decide(
            lambda: commit_recovered(store, rescued, on_existing) if rescued and store is not None else [],
            "committing the saves a dead run left in staging",
        )
        self._root = self.staging / token
        self._lock: int | None = None  # our shared lock on _root while it exists: a later engine leaves it be
        self._saves = 0
        self._save: tuple[Path, Path] | None = None  # (the real tag folder, its staged twin)
        self._staged_names: list[str] = []
        self._direct = False  # this save is written where DeepSpeed would write it: staging failed
        self._warned = False
        self._last_bytes = 0  # this rank's bytes in its last save: the room the next one needs
        self._save_bytes = 0  # this rank's bytes of the save under way
        # save() copies the tensors into reused memory and writes the file in the background (snapshot.py)
        self._snapshots = (
            Snapshots(
                on_staging_failed=self._warn_staging, ranks_on_node=ranks.ranks_on_node(), device_buffers=gpu_buffers
            )
            if snapshot
            else None
        )
        self._snapshotted = False  # this save's files are being written in the background

    # -- what DeepSpeed calls while saving ----------------------------------------------
    def create(self, info: CheckpointCommitInfo) -> None:
        """A new save begins: it gets its own staged folder (the previous one may still be committing).
        Where staging cannot take it (no room for a save the size of the last, read-only, gone),
        the save is written where DeepSpeed would write it and committed from there."""
        self._saves += 1
        if self._snapshots is not None:
            self._snapshots.begin(self._saves)  # the save before last is written: its buffers are free
        real = (Path(info.save_dir) / info.tag).absolute()
        self._save = (real, self._root / f"save-{self._saves:06d}" / info.tag)
        self._staged_names = []
        self._direct = False
        self._save_bytes = 0
        self._snapshotted = False
        try:
            self._hold()
            self._check_room()
            staged.record_target(self._save[1].parent, self._save[0])
        except OSError as exc:
            self._go_direct(exc)

    def _check_room(self) -> None:
        need = self._last_bytes * max(1, ranks.ranks_on_node())  # every rank of this node stages into one folder
        free = shutil.disk_usage(self.staging).free
        if need and free < need:
            raise OSError(errno.ENOSPC, f"{free:,} bytes free, and the last save of this node's ranks took {need:,}")

    def _go_direct(self, why: BaseException | str) -> None:
        """Write this save where DeepSpeed would, moving what this rank staged of it there first."""
        if self._direct or self._save is None:
            return
        real, twin = self._save
        self._direct = True
        if self._snapshots is not None:
            self._snapshots.drain()  # what this rank copied is on disk before it moves
            snapshot.clear_markers(twin.parent)
        for name in self._staged_names:
            (real / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.move(str(twin / name), str(real / name))
        staged.finish(twin.parent)
        self._warn_staging(why, real)

    def _warn_staging(self, why: BaseException | str, real: Path) -> None:
        """Once per process: staging failed, and saves go where DeepSpeed writes them."""
        if not self._warned:
            self._warned = True
            log.warning(
                "tailorstore: staging in %s failed (%s); the save goes to %s, where DeepSpeed writes it, and is "
                "committed from there. Give staging= (or $%s) a folder with room for a save of this node's ranks.",
                self.staging,
                why,
                real,
                STAGING_ENV,
            )

    def _hold(self) -> None:
        """Lock our staging folder (again, when it was emptied and deleted since)."""
        if not staged.still_held(self._lock, self._root):
            if self._lock is not None:
                os.close(self._lock)
            self._lock = staged.hold(self._root)

    def _staged(self, path: str | os.PathLike) -> Path | None:
        """The staged twin of a path inside the save's tag folder (None for anything else, and for
        everything while this save is written directly)."""
        if self._save is None or self._direct:
            return None
        real, twin = self._save
        if Path(path).absolute() == real:
            return twin
        name = self._name_in_save(path)
        return None if name is None else twin / name

    def _name_in_save(self, path: str | os.PathLike) -> str | None:
        if self._save is None:
            return None
        target = Path(path).absolute()
        return str(target.relative_to(self._save[0])) if self._save[0] in target.parents else None

    def makedirs(self, path: str | os.PathLike, exist_ok: bool = False) -> None:
        twin = self._staged(path)
        if twin is not None:
            try:
                twin.mkdir(parents=True, exist_ok=True)
                return
            except OSError as exc:
                self._go_direct(exc)
        in_save = self._save is not None and (Path(path).absolute() == self._save[0] or self._name_in_save(path))
        Path(path).mkdir(parents=True, exist_ok=exist_ok or bool(in_save))

    def save(self, state_dict: Any, path: str) -> None:
        """Serialize one file into memory; the tensors may change as soon as this returns. A staging
        folder that fails (full, read-only: torch says "unexpected pos") costs no save: the file and
        those this rank staged before it go where DeepSpeed would have written them."""
        twin = self._staged(path)
        name = self._name_in_save(path)
        if twin is not None:
            try:
                twin.parent.mkdir(parents=True, exist_ok=True)
                if self._snapshot_into(state_dict, twin, Path(path)):
                    self._staged_names.append(str(name))
                    return
                torch.save(state_dict, twin)
                self._save_bytes += _size(twin)
                self._staged_names.append(str(name))
                return
            except (OSError, RuntimeError) as exc:
                twin.unlink(missing_ok=True)
                self._go_direct(exc)
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        torch.save(state_dict, path)  # DeepSpeed's own behaviour, and this save's when staging failed
        if name is not None:
            self._staged_names.append(name)

    def before_change(self) -> None:
        """The saved tensors are about to change (an optimizer step): on a GPU, the training stream
        waits for the last save's copies (:mod:`.side_copy`); the host does not wait. :func:`attach`
        calls it before each optimizer step; call it before changing them any other way."""
        if self._snapshots is not None:
            self._snapshots.guard()

    def set_metrics(self, metrics: Mapping[str, float]) -> None:
        """Metrics recorded with the next save's step (``{"eval_loss": 2.31}``), on global rank 0;
        ``gc --keep-best`` reads them. Checked now, so a bad name fails here, not in the background."""
        self._pending_metrics = dict(checked_metrics(metrics)) or None  # type: ignore[arg-type]

    def _metrics_for(self, step: int | None) -> dict[str, float] | None:
        """This save's metrics: those set for it, else what the ``metrics`` callable returns."""
        found, self._pending_metrics = self._pending_metrics, None
        if found is None and self._metrics_of is not None:
            given = self._metrics_of(step)
            found = dict(checked_metrics(given)) if given else None  # type: ignore[arg-type]
        return found or None

    def load(self, path: str, map_location: Any = None) -> Any:
        """Files come from a checkout of the store; loaded with the allowlist, never running unknown code.

        A model-states file this engine staged for a resume is mapped, not read (:func:`mapped`);
        a resume served from the store hands over its objects instead (:mod:`.serving`)."""
        if self._restoring(path):
            return load_staged(path)
        return load_torch_file(path, mmap=False)[0]

    def _restoring(self, path: str) -> bool:
        """Whether ``path`` lies in a restore folder of this engine's staging."""
        inside = below(path, self._root)
        return bool(inside and inside.parts[0].startswith(RESTORE_PREFIX))

    def commit(self, info: CheckpointCommitInfo) -> bool:
        """Every rank has staged its files: rank 0 commits the step (in the background by default)."""
        if self._save is None:
            return True
        real, twin = self._save
        if self._snapshotted and self._snapshots is not None and not self._direct:
            self._snapshots.finish(twin.parent, ranks.rank())  # the marker the committer waits for
        every, direct, snapshotted = self._gathered_names()
        names = sorted({n for one in every for n in one})
        if direct:  # some rank's staging failed: the whole save is committed from where DeepSpeed writes it
            self._go_direct("another rank's staging failed")
            self.session.barrier()  # every rank has moved what it had staged
        self._save = None
        folder = real if direct else twin
        self._last_bytes = self._save_bytes
        written = [] if direct else snapshotted  # ranks whose files are still being written
        if not names:  # nothing staged: save_16bit_model writes beside the tag folder
            staged.finish(twin.parent)
            return True
        step = step_of_tag(info.tag)
        if step is None and self._global_steps is not None:
            step = self._global_steps()
        metrics = self._metrics_for(step) if ranks.rank() == 0 else None
        if self._parts and nodes.each_node_apart(folder, every, self.group):
            if ranks.is_leader():
                label = nodes.save_label(self._root.name, self._saves, len(self._parts))
                mine = [r for r in ranks.node_ranks(ranks.rank()) if r in written]
                self._submit_part(folder, real, step, nodes.node_names(every), label, mine, metrics)
            return True
        if ranks.rank() != 0:
            return True
        if written:  # the files are still being written: the commit job waits for them, then looks
            self._submit(folder, real, step, written, metrics)
            return True
        missing = sorted(n for n in names if not (folder / n).is_file())
        if missing and direct:
            raise StoreError(
                f"global rank 0 does not see the files {missing[:3]} of {info.tag} in {real}, where every rank "
                "wrote its share because staging failed: the ranks do not share the save folder (several "
                "nodes?). Commit the folders with ",
                Call("commit", "DIR", part=True),
                " on each node, then `finalize`.",
            )
        if missing:
            _rescue(twin, real)  # what rank 0 does see is written where DeepSpeed would have put it
            staged.finish(twin.parent)
            raise StoreError(
                f"global rank 0 does not see the staged files {missing[:3]} of {info.tag} in {twin.parent}: the "
                "ranks do not share a staging folder (several nodes?). Pass staging= a folder every node "
                "sees, or save with tailorstore.integrations.deepspeed.save_checkpoint."
            )
        self._submit(folder, real, step, metrics=metrics)
        return True

    def _gathered_names(self) -> tuple[list[list[str]], bool, list[int]]:
        """Each rank's file names of this save (by global rank), whether any rank wrote its share
        directly, and the ranks whose files are written in the background (a snapshot), after a
        barrier: every other file is complete once it passes."""
        every = self.session.gather((list(self._staged_names), self._direct, self._snapshotted))
        names = [one[0] for one in every]
        return names, any(one[1] for one in every), [r for r, one in enumerate(every) if one[2]]

    def _snapshot_into(self, state_dict: Any, twin: Path, real: Path) -> bool:
        """Copy the file's tensors and write it in the background; False where it must be written now."""
        if self._snapshots is None:
            return False
        try:
            tree, nbytes = self._snapshots.copy(state_dict, twin.name)
        except snapshot.Unsupported as why:
            log.debug("tailorstore: %s is written at once: %s", twin.name, why)
            return False
        self._snapshots.write(tree, twin, real)
        self._snapshotted = True
        self._save_bytes += nbytes
        return True

    def _submit(
        self,
        folder: Path,
        real: Path,
        step: int | None,
        written: list[int] | None = None,
        metrics: dict[str, float] | None = None,
    ) -> Future[CommitResult] | CommitResult:
        """Commit ``folder`` (the staged twin, or ``real`` itself when staging failed) in the background,
        once the ranks in ``written`` have written their files of it."""
        options: dict[str, Any] = {"policy": self.policy, **self.policy_params, "metrics": metrics}
        options["step"] = step
        return self._staged_job(
            folder, real, written or [], lambda store, source: self.rewind.commit(
                store, source, delete_after_commit=True, **options
            )
        )  # fmt: skip

    def _submit_part(
        self,
        folder: Path,
        real: Path,
        step: int | None,
        mine: list[str],
        label: str,
        written: list[int],
        metrics: dict[str, float] | None = None,
    ) -> None:
        """A node's leader: commit what this node's ranks staged as one part of the step; global
        rank 0 then waits for every node's part and finalizes (in the background by default)."""
        if self.policy != "full" or self.policy_params:  # the leaders decide the plan together
            self._submit_planned_part(folder, real, step, label, written, metrics)
            return
        root = ranks.rank() == 0
        count = len(self._parts)

        def work(store: Store, source: Path) -> CommitResult:
            missing = sorted(n for n in mine if not (source / n).is_file())
            if missing:
                raise StoreError(f"this node does not see the files {missing[:3]} its own ranks staged in {source}")
            result = store.commit(source, part=True, part_label=f"{label}-n{ranks.rank()}", step=step)
            shutil.rmtree(source, ignore_errors=True)  # the part is durable: its blobs hold the node's files now
            if root:
                nodes.await_parts(store, result.step, label, count)
                store.finalize(result.step, label=label, metrics=metrics)
            return result

        self._staged_job(folder, real, written, work)

    def _submit_planned_part(
        self,
        folder: Path,
        real: Path,
        step: int | None,
        label: str,
        written: list[int],
        metrics: dict[str, float] | None = None,
    ) -> None:
        """A node's leader, under a policy: a rank-parallel commit among the nodes' leaders over
        their own group, in the background (every leader's commits run in save order), each
        leader surveying and writing its node's files; the manifest is what one process would
        record of the whole save (ingest/rank_plan.py)."""
        node = set(ranks.node_ranks(ranks.rank()))

        def work(store: Store, source: Path) -> RankParallelResult:
            result = commit_rank_parallel(
                store, source, step=step, group=self._leaders_group, policy=self.policy, label=label,
                owns=lambda rel: owner_of(rel) in node, metrics=metrics, **self.policy_params,
            )  # fmt: skip
            shutil.rmtree(source, ignore_errors=True)  # the step is recorded: its blobs hold the node's files
            return result

        self._staged_job(folder, real, written, work)

    def _staged_job(self, folder: Path, real: Path, written: list[int], work: Callable[[Store, Path], T]) -> Any:
        """Run ``work(store, source)`` in the background (or now): ``source`` is the staged twin
        once the ranks in ``written`` have written their files, or ``real`` where staging failed.
        A failure moves the staged files where DeepSpeed would have written them; either way the
        staged save's record goes."""
        assert self.store is not None
        staged_twin = folder != real

        def job(store: Store) -> T:
            try:
                result = work(store, _written_source(folder, real, written))
                if ranks.rank() == 0:
                    self._move_head(store, real.parent, getattr(result, "step", None))
                return result
            except BaseException:
                if staged_twin:  # a save written directly is where DeepSpeed would have put it already
                    _rescue(folder, real)
                raise
            finally:
                if staged_twin:
                    staged.finish(folder.parent)

        if self.asynchronous:
            return StoreSession(self.store).background(str(real), job)
        return job(self.store)

    # -- resuming ----------------------------------------------------------------------
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
        self._hold()
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
                self._root / f"{RESTORE_PREFIX}{self._saves:06d}",
                world_size,
                zero_stage,
                self.session,
            )
        self.rewind.resumed_step = found.step  # a save of a step after it that the store holds branches here
        return loaded

    def _plan(self, tag: str | None, load_dir: Path) -> _Plan:
        """Global rank 0: how every rank loads. The tag is the one given, else the one ``latest``
        names; a tag folder on disk that holds DeepSpeed's model states is loaded from disk,
        anything else from the store (:meth:`_find`; None there: nothing to resume)."""
        from_latest = tag is None
        if tag is None and (load_dir / "latest").is_file():
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
        root = self._root / f"{RESTORE_PREFIX}{self._saves:06d}"  # a name only: the folder is never made
        with serving.served(engine, root, objects, built):
            return original(str(root), objects.tag, **kw)

    def _move_head(self, store: Store, save_dir: Path, step: int | None) -> None:
        """Global rank 0, once a step is committed: the job's head (head.py) names it."""
        if step is not None:
            name_in_head(store, save_dir, self.rewind.run or store.run, step)

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
            log.warning(
                "tailorstore: %s names step %d, which this training never committed (it stopped first); the "
                "step %d in run %r is older than the last one it committed, from a timeline it went back from, "
                "so it resumes from step %d, the last step it committed",
                load_dir / "latest",
                found.step,
                found.step,
                run,
                head.step,
            )
            found = resume.find(store, f"{run}:step={head.step}")
        _warn_if_in_several_runs(store, run, found.step)
        warn_if_composite(found.step, found.inherited)
        return found

    # -- lifecycle ---------------------------------------------------------------------
    def flush(self) -> None:
        """Wait for the files still being written (every rank) and the commits in flight, and raise
        the first failure (where this rank commits)."""
        if self._snapshots is not None:
            self._snapshots.drain()
        if self.store is not None:
            self.store.flush()
            _remove_empty(self._root)

    def cleanup(self) -> None:
        self.flush()


@dataclass(frozen=True)
class _Plan:
    """How every rank resumes, as global rank 0 decided it."""

    tag: str | None  # the tag asked for, or the one ``latest`` names
    on_disk: bool  # DeepSpeed loads ``load_dir/tag`` itself
    found: resume.Found | None = None  # else this step of the store (None: nothing to resume)


def _needs_store(store: Store | None) -> None:
    if store is None:
        raise StoreError("TailorCheckpointEngine: global rank 0 commits, so it needs the store.")


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


def _written_source(folder: Path, real: Path, writing: list[int]) -> Path:
    """The committer: wait for the ranks still writing (``writing``) their files of the save staged at ``folder``;
    where a rank could not write into staging (it wrote where DeepSpeed writes), the staged files
    join it there and the save is committed from ``real``, as when staging fails at once."""
    if not writing:
        return folder
    try:
        snapshot.await_written(folder.parent, writing, ranks.collective_timeout())
        return folder
    except snapshot.StagingFailed:
        if folder != real and folder.is_dir():
            staged.rescue(folder, real)
        return real
    finally:
        snapshot.clear_markers(folder.parent)


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _rescue(twin: Path, real: Path) -> None:
    """A failed commit's staged files go where DeepSpeed would have written them."""
    if twin.is_dir():
        staged.rescue(twin, real)
        log.error("tailorstore: the commit of %s failed; its files were written there instead", real)


def _remove_empty(folder: Path) -> None:
    try:
        folder.rmdir()
    except OSError:
        pass
