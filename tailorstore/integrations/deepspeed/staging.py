"""TailorCheckpointEngine's staging folders, and what a killed run leaves in them.

A save is staged in memory (``/dev/shm``) until global rank 0 has committed it. A training run
killed before that (preempted, OOM-killed, a node lost) left its staged saves there for good:
up to two raw saves of a node's ranks held in RAM until the machine restarts, and among them
the only copy of a save whose commit had not finished.

So each process holds a shared ``flock`` on its engine's folder (``tailor-staging-*``) while it
uses it, and records beside each staged save where DeepSpeed would have written it. An engine
that starts later takes an exclusive lock on every other such folder of the same user, which it
gets only when no live process holds one (the kernel lets go of a dead process's locks, however
it died), and then does what a failed commit does: moves each staged save to where DeepSpeed
would have written it, so nothing is lost, and deletes the rest. On a file system without
``flock`` nothing is recovered: a folder that cannot be locked is taken for a live one.
"""

from __future__ import annotations

import logging
import os
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path

from tailorstore.core.dir_locks import hold_dir, removed, take_abandoned
from tailorstore.core.errors import BadCheckpointError, TailorError
from tailorstore.core.local_files import Beneath, write_atomic
from tailorstore.integrations.common.store_session import NAME_LIMIT, read_small_text

log = logging.getLogger("tailorstore")
WRITTEN, FAILED = ".written-", ".failed-"  # the snapshot's markers in a save's folder (snapshot.py)

PREFIX = "tailor-staging-"
TARGET = "target"  # in save-N/, beside the staged tag folder: the absolute path DeepSpeed would have written
UNCOMMITTED = ".uncommitted"  # a recovered save's folder: its tag and this, a name DeepSpeed never loads


@dataclass(frozen=True)
class Rescued:
    """A dead run's staged save, moved out of staging (paths as text: it is shipped to rank 0)."""

    staged: str  # where it was staged, resolved: what its own commit records as its source, if one was made
    folder: str  # where it is now: ``save_dir/tag.uncommitted/tag`` (:func:`aside`), which DeepSpeed never loads
    target: str  # where DeepSpeed would have written it (``save_dir/tag``)


def aside(real: Path) -> Path:
    """Where a recovered save goes instead of ``real`` (``save_dir/tag``): a folder of its own tag's
    name, so that a commit records DeepSpeed's tag, inside a free folder beside ``real`` whose
    name DeepSpeed never loads (``save_dir/tag.uncommitted/tag``)."""
    first = real.with_name(real.name + UNCOMMITTED)
    taken = 1
    candidate = first
    while os.path.lexists(candidate):
        taken += 1
        candidate = first.with_name(f"{first.name}-{taken}")
    return candidate / real.name


def hold(root: Path) -> int:
    """Create ``root`` if needed and hold a shared lock on it (every rank of a node stages into
    the same folder); returns the fd that keeps the lock until it is closed."""
    while True:
        root.mkdir(parents=True, exist_ok=True)
        try:
            fd = hold_dir(root, shared=True)
        except FileNotFoundError:  # deleted between the mkdir and the open: make it again
            continue
        if not removed(fd):  # not deleted by a recovery between the mkdir and the lock
            return fd
        os.close(fd)


def still_held(fd: int | None, root: Path) -> bool:
    """Whether ``fd`` is the folder now at ``root`` (the engine deletes its folder when it empties)."""
    if fd is None:
        return False
    try:
        return os.stat(root).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        return False


def record_target(save: Path, real: Path) -> None:
    """Write where the save staged under ``save`` (``save-N/``) would have gone; every rank of the
    node may write it, with the same content."""
    save.mkdir(parents=True, exist_ok=True)
    write_atomic(save, TARGET, str(real.absolute()).encode())  # never through a link planted in staging


def finish(save: Path) -> None:
    """A staged save was committed (or rescued): drop its record and its folder if empty. Clean-up,
    so it never fails: where staging is no folder (``TAILOR_STAGING`` naming a file) or was
    remounted read-only, the save itself is already where it belongs (I3: clean-up after a durable
    commit is never reported as a failure; tests/system/test_cleanup_failures.py)."""
    try:
        (save / TARGET).unlink(missing_ok=True)
    except OSError as exc:
        log.warning("tailorstore: could not remove the staging record in %s (%s)", save, exc)
        return
    try:
        save.rmdir()
    except OSError:
        pass


def _real_dir(path: Path) -> bool:
    """A directory itself, not a link to one: a staging folder is writable by whoever shares it."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def _ours(st: os.stat_result) -> bool:
    return stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid()


def rescue(twin: Path, real: Path) -> None:
    """A staged save goes where DeepSpeed would have written it. Only what the engine stages
    moves: regular files of this user, in folders, never through a link. A link planted in a
    shared or abandoned staging folder would otherwise move files from anywhere to the target."""
    if not _real_dir(twin):
        return
    real.mkdir(parents=True, exist_ok=True)
    for entry in os.scandir(twin):
        source, dest = Path(entry.path), real / entry.name
        st = entry.stat(follow_symlinks=False)
        if stat.S_ISDIR(st.st_mode):
            rescue(source, dest)
        elif _ours(st):
            shutil.move(str(source), str(dest))
        else:
            log.warning("tailorstore: %s is no file the engine staged (a link, or not this user's); it stays", source)
    try:
        twin.rmdir()
    except OSError:
        pass  # what was left stays, named above


def recover(staging: Path) -> list[Rescued]:
    """Every engine folder in ``staging`` that no live process holds, of this user: staged saves
    moved beside where DeepSpeed would have written them (:func:`aside`), the rest deleted.
    Returns what moved where."""
    rescued: list[Rescued] = []
    try:
        found = sorted(staging.glob(f"{PREFIX}*"))
    except OSError:
        return rescued
    for root in found:
        fd = take_abandoned(root)
        if fd is None:
            continue
        try:
            rescued += _recover_one(root)
        except OSError as exc:  # never stops the training that starts
            log.warning("tailorstore: could not recover %s, left by a run that is gone (%s)", root, exc)
        finally:
            os.close(fd)
    return rescued


def _only_markers(entry: Path) -> bool:
    """Whether a dead run's save folder holds only its record and the snapshot's markers, all of
    them files of this user: such a folder is cleaned once, not warned about at every start
    (tests/system/test_cleanup_failures.py, ``test_a_dead_runs_save_folder_of_markers_only_is_cleaned_once``)."""
    for p in entry.iterdir():
        try:
            mine = _ours(os.lstat(p))
        except OSError:
            return False
        if not mine or not (p.name == TARGET or p.name.startswith((WRITTEN, FAILED))):
            return False
    return True


def _remove_markers(entry: Path) -> None:
    for p in entry.iterdir():
        p.unlink(missing_ok=True)
    entry.rmdir()


def _recover_one(root: Path) -> list[Rescued]:
    rescued: list[Rescued] = []
    for entry in sorted(root.iterdir()):
        if entry.name.startswith("restore-"):  # a checkout made for resuming: in the store already
            shutil.rmtree(entry, ignore_errors=True)
            continue
        target = entry / TARGET
        tags = [p for p in entry.iterdir() if _real_dir(p)] if _real_dir(entry) else []
        try:
            target_ok = _ours(os.lstat(target))
        except OSError:
            target_ok = False
        if entry.name.startswith("save-") and _real_dir(entry) and not tags and _only_markers(entry):
            _remove_markers(entry)  # committed, then killed before its markers went: nothing to move
            continue
        if not entry.name.startswith("save-") or not target_ok or len(tags) != 1:
            log.warning("tailorstore: %s was left by a run that is gone; it is not ours to move, so it stays", entry)
            continue
        try:
            real = Path(read_small_text(Beneath(entry, TARGET, links=False), "a staged save's target", NAME_LIMIT))
            if not real.is_absolute():
                raise BadCheckpointError(f"{target}: names no absolute path")
            source = str(tags[0].resolve())
            folder = aside(real)
            rescue(tags[0], folder)
        except (OSError, TailorError) as exc:  # a recovery that cannot be done must not stop the training
            log.warning("tailorstore: could not move %s, left by a run that is gone (%s); it stays", tags[0], exc)
            continue
        finish(entry)
        rescued.append(Rescued(source, str(folder), str(real)))
        log.warning(
            "tailorstore: a run that is gone left the staged save %s before its commit was confirmed; it was "
            "moved to %s, a name DeepSpeed never loads (it may be cut short), for global rank 0 to commit",
            tags[0].name,
            folder,
        )
    try:
        root.rmdir()
    except OSError:
        pass
    return rescued
