"""What global rank 0 does, when an engine starts, with the saves a dead run left in staging.

``staging.recover`` moved each of them beside where DeepSpeed would have written it, under a name
DeepSpeed never loads (``global_step6.uncommitted/global_step6``): the run may have died while its files were
written. Here global rank 0 commits each one whose step the store lacks, under the same rewind
rule (``on_existing``) the engine was given, in the run the job's head names, and deletes it once
durable. Every other rank waits for this (``Session.decide``), so no rank decides how to load
before the recovery is done.

A save the store already holds is one of two things, told apart by the source the store records
for a step (the folder it was committed from, which for a staged save is unique to the engine
and the save): the dead run's own commit of this very save got through before it died (then
the folder only goes), or the step is another timeline's (a rewind was killed while it
recorded the step again), which the rewind rule decides, as the commit the dead run was making
would have. A save that cannot be committed (cut short, refused) stays where it is, for the
user, with one line that says why.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from tailorstore.api import Store
from tailorstore.core.errors import StepExistsError, StoreError
from tailorstore.core.local_files import write_atomic
from tailorstore.integrations.common.rewind import Rewind
from tailorstore.integrations.common.store_session import COMMIT, read_latest
from tailorstore.integrations.deepspeed.head import Head, read_head, write_head
from tailorstore.integrations.deepspeed.helpers import log, step_of_tag
from tailorstore.integrations.deepspeed.staging import Rescued

COMMITTED, ALREADY, KEPT = "committed", "already committed", "kept"


@dataclass(frozen=True)
class Recovered:
    """What became of one recovered save (rank 0 ships the list to every rank)."""

    step: int | None
    run: str | None
    outcome: str  # COMMITTED, ALREADY or KEPT
    folder: str  # where the save was (gone unless KEPT)


def commit_recovered(store: Store, saves: list[Rescued], on_existing: str) -> list[Recovered]:
    """Global rank 0: commit (or drop, or keep) each save a dead run left in staging; what it did."""
    done: list[Recovered] = []
    for save in sorted(saves, key=_in_step_order):
        folder = Path(save.folder)
        step = step_of_tag(Path(save.target).name)
        if not folder.is_dir():
            continue  # another node's folder, not seen here: its own log said where it went
        if step is None:
            log.warning("tailorstore: %s names no step; it is kept there, uncommitted", folder)
            done.append(Recovered(None, None, KEPT, save.folder))
            continue
        done.append(_recover(store, save, folder, step, on_existing))
    for save in saves:
        _latest_follows_head(store, Path(save.target))
    return done


def _latest_follows_head(store: Store, target: Path) -> None:
    """After the recovery: DeepSpeed's ``latest`` names the head's step where it named an older one
    (the dead run's last save returned, so ``latest`` moved, only for saves it had begun; a save
    recovered after it is newer), so that the folder, the head and the store agree, whatever loads
    the folder next."""
    save_dir, tag = target.parent, target.name
    head = read_head(save_dir)
    if head is None or not head.matches(store.id) or head.step != step_of_tag(tag):
        return
    try:
        named = step_of_tag(read_latest(save_dir))
    except (OSError, StoreError):
        named = None
    if named is None or named < head.step:
        write_atomic(save_dir, "latest", tag.encode())


def _in_step_order(save: Rescued) -> tuple[str, int, str]:
    """Oldest step first, by number (``global_step10`` after ``global_step8``, which their names
    sort before), so that the head ends on the newest save recovered. In name order a job killed
    with steps 8 and 10 in staging recovered 10, then 8, and resumed 8 though 10 was durable."""
    step = step_of_tag(Path(save.target).name)
    return (str(Path(save.target).parent), -1 if step is None else step, save.folder)


def _recover(store: Store, save: Rescued, folder: Path, step: int, on_existing: str) -> Recovered:
    save_dir = Path(save.target).parent
    head = read_head(save_dir)
    run = head.run if head is not None and head.matches(store.id) else store.run
    mine = _committed_from(store, step, save.staged)
    if mine is not None:  # the dead run's own commit got through: only its staged copy is left
        shutil.rmtree(folder.parent, ignore_errors=True)
        _advance_head(store, save_dir, mine, step)
        log.warning(
            "tailorstore: step %d, left in staging by a run that is gone, is already in run %r (that run committed "
            "this very save before it died); its copy was deleted",
            step,
            mine,
        )
        return Recovered(step, mine, ALREADY, save.folder)
    rewind = Rewind(on_existing, run=run)
    try:
        result = rewind.commit(store, folder, step=step, delete_after_commit=True)
    except StepExistsError:
        log.warning(
            "tailorstore: step %d, left in staging by a run that is gone, was not committed: run %r holds another "
            "step %d (on_existing='error'); it is kept in %s",
            step,
            run,
            step,
            folder.parent,
        )
        return Recovered(step, run, KEPT, save.folder)
    except Exception as exc:  # a recovery that cannot be done must not stop the training
        log.warning(
            "tailorstore: step %d, left in staging by a run that is gone, was not committed (%s); it is kept in %s, "
            "a name DeepSpeed never loads",
            step,
            exc,
            folder.parent,
        )
        return Recovered(step, run, KEPT, save.folder)
    _remove_empty(folder)  # its files went once durable
    _remove_empty(folder.parent)
    run = rewind.run or store.run
    name_in_head(store, save_dir, run, step)  # a rewind's replace may name an older step: it is the job's newest
    log.warning(
        "tailorstore: committed step %d of run %r from the save a run that is gone left in staging (%d files)",
        result.step,
        run,
        result.files,
    )
    return Recovered(step, run, COMMITTED, save.folder)


def _committed_from(store: Store, step: int, staged: str) -> str | None:
    """The run whose step ``step`` the store recorded from the staged folder ``staged``, if any."""
    for summary in store.log():  # every run's manifests
        if summary.step == step and summary.origin == COMMIT and summary.source == staged:
            return summary.run
    return None


def _advance_head(store: Store, save_dir: Path, run: str, step: int) -> None:
    """For a save the dead run committed itself: the head names ``run``'s step ``step`` unless it
    names a newer step of that run already (the run went on to commit a later save, and died before
    it deleted this one's staged copy)."""
    head = read_head(save_dir)
    if head is not None and head.matches(store.id) and head.run == run and head.step > step:
        return
    name_in_head(store, save_dir, run, step)


def name_in_head(store: Store, save_dir: Path, run: str, step: int) -> None:
    """Make the job's head in ``save_dir`` name ``run``'s step ``step`` as the store records it."""
    if not save_dir.is_dir():
        return
    try:
        created = store.show(f"{run}:step={step}").summary.created_at
    except StoreError:
        return  # finalized under another run, or already gone: nothing to name
    write_head(save_dir, Head(store.id, run, step, created))


def _remove_empty(folder: Path) -> None:
    try:
        folder.rmdir()
    except OSError:
        pass  # something else is in it: it stays
