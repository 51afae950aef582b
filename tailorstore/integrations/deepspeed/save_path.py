"""The engine's save path: what DeepSpeed's ``save_checkpoint`` calls, and the commit that follows.

``engine.save_checkpoint`` hands each file to the engine, which serializes it into a staging
folder in memory (``/dev/shm``, or ``$TAILOR_STAGING``), never into ``save_dir``. Once every rank
has saved, global rank 0 commits the staged step through the same container path as ``tailor
commit`` (one process, so every policy works) and deletes the staged copy once the manifest is
durable and its blobs are checked; on several nodes each node's leader commits its ranks' files as
a part (:mod:`.nodes`). DeepSpeed still writes its small ``latest`` pointer and recovery scripts
into ``save_dir`` itself.

Call order, as DeepSpeed makes it on every rank: ``create(info)`` once a save begins; ``makedirs``
and ``save(state_dict, path)`` for each file; ``commit(info)`` once the rank's files are written
(global rank 0 then submits the step's commit); ``flush`` before exit.

If a background commit fails, its staged files are moved to where DeepSpeed would have written
them (``save_dir/tag``), so nothing is lost, and the error is raised at the next save or at
``flush``. A staging folder without room, read-only or failing mid-save costs no save: that save
is written where DeepSpeed writes it and committed from there.
"""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo

from tailorstore import CommitResult
from tailorstore.api import Store
from tailorstore.core.environment import STAGING_ENV
from tailorstore.core.errors import Call, StoreError
from tailorstore.core.metric_values import checked as checked_metrics
from tailorstore.core.policies import Policy
from tailorstore.integrations.common import ranks
from tailorstore.integrations.common.distributed import RankParallelResult, commit_rank_parallel
from tailorstore.integrations.common.rewind import Rewind
from tailorstore.integrations.common.store_session import StoreSession, owner_of
from tailorstore.integrations.deepspeed import nodes, snapshot
from tailorstore.integrations.deepspeed import staging as staged
from tailorstore.integrations.deepspeed.helpers import T, log, step_of_tag
from tailorstore.integrations.deepspeed.recovery import name_in_head
from tailorstore.integrations.deepspeed.snapshot import Snapshots
from tailorstore.integrations.deepspeed.startup import Started


class SavePath:
    """One engine's saves: staged, snapshotted, and committed by global rank 0 or by each node's
    leader. ``policy`` and its parameters choose the layers stored at each step, as in
    ``Store.commit``; ``rewind`` is the engine's, which the load path moves when it resumes."""

    def __init__(
        self,
        started: Started,
        rewind: Rewind,
        *,
        policy: str | Policy = "full",
        policy_params: Mapping[str, float] | None = None,
        asynchronous: bool = True,
        global_steps: Callable[[], int] | None = None,
        snapshot: bool = True,
        gpu_buffers: bool | None = None,
        metrics: Callable[[int | None], Mapping[str, float] | None] | None = None,
    ) -> None:
        self.session, self.store, self.folder = started.session, started.store, started.folder
        # Several nodes, each leader with a store: each node commits its own ranks' files as a part
        # and global rank 0 finalizes the step, so no folder but the store is shared (nodes.py).
        self.parts, self.leaders_group = started.parts, started.leaders_group
        self.rewind = rewind
        self.policy = policy
        self.policy_params = dict(policy_params or {})
        self.asynchronous = asynchronous
        self._global_steps = global_steps
        self._metrics_of = metrics  # called on global rank 0 with the step of each save it commits
        self._pending_metrics: dict[str, float] | None = None  # set_metrics: for the next save only
        self.saves = 0
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

    def create(self, info: CheckpointCommitInfo) -> None:
        """A new save begins: it gets its own staged folder (the previous one may still be committing).
        Where staging cannot take it (no room for a save the size of the last, read-only, gone),
        the save is written where DeepSpeed would write it and committed from there."""
        self.saves += 1
        if self._snapshots is not None:
            self._snapshots.begin(self.saves)  # the save before last is written: its buffers are free
        real = (Path(info.save_dir) / info.tag).absolute()
        self._save = (real, self.folder.root / f"save-{self.saves:06d}" / info.tag)
        self._staged_names = []
        self._direct = False
        self._save_bytes = 0
        self._snapshotted = False
        try:
            self.folder.hold()
            self._check_room()
            staged.record_target(self._save[1].parent, self._save[0])
        except OSError as exc:
            self._go_direct(exc)

    def _check_room(self) -> None:
        need = self._last_bytes * max(1, ranks.ranks_on_node())  # every rank of this node stages into one folder
        free = shutil.disk_usage(self.folder.staging).free
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
                self.folder.staging,
                why,
                real,
                STAGING_ENV,
            )

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
        if self.parts and nodes.each_node_apart(folder, every, self.session.group):
            if ranks.is_leader():
                label = nodes.save_label(self.folder.root.name, self.saves, len(self.parts))
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
        count = len(self.parts)

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
                store, source, step=step, group=self.leaders_group, policy=self.policy, label=label,
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

    def _move_head(self, store: Store, save_dir: Path, step: int | None) -> None:
        """Global rank 0, once a step is committed: the job's head (head.py) names it."""
        if step is not None:
            name_in_head(store, save_dir, self.rewind.run or store.run, step)

    def flush(self) -> None:
        """Wait for the files still being written (every rank) and the commits in flight, and raise
        the first failure (where this rank commits)."""
        if self._snapshots is not None:
            self._snapshots.drain()
        if self.store is not None:
            self.store.flush()
            self.folder.remove_if_empty()


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
