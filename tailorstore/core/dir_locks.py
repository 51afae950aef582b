"""Locks held on working directories, so that a later process can tell one a dead process left.

A checkout's hidden output directory and an engine's staging folder are locked (``flock``)
by the process that fills them. The kernel drops a process's locks when it dies, however it
dies, so a directory nobody holds a lock on is one nobody is filling: what a killed run left.
"""

from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path

# A file system without flock (some network mounts) says so with one of these.
NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL)


def hold_dir(path: Path, *, shared: bool = False) -> int:
    """An fd of the directory that holds a lock on it until it is closed, waiting for one held
    elsewhere. Where the file system has no flock, the fd holds none; :func:`take_abandoned`
    then takes the directory for a live one, so nothing is ever deleted there."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH if shared else fcntl.LOCK_EX)
    except OSError as exc:
        if exc.errno not in NO_LOCKS:
            os.close(fd)
            raise
    return fd


def take_abandoned(path: Path) -> int | None:
    """An fd holding the exclusive lock of a directory of this user that no live process holds,
    or None: held elsewhere, no flock here, gone, a link, or another user's (``/dev/shm`` and the
    temp folder are shared)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        if os.fstat(fd).st_uid != os.getuid():
            raise BlockingIOError
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def removed(fd: int) -> bool:
    """Whether the directory of ``fd`` was deleted (by a cleaner that took it between its
    creation and our lock): then make another."""
    return os.fstat(fd).st_nlink == 0
