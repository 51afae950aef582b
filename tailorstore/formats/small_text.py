"""Small text files a user hands us: DeepSpeed's ``latest``, an HF Trainer's ``trainer_state.json``,
a merge spec, a model's ``config.json``.

They are read whole, so each read is bounded and decoded strictly: a ``latest`` that is a
gigabyte of anything, or a binary file under a text file's name, is one clear error naming
the file, not a process that fills memory or stops on a ``UnicodeDecodeError`` traceback.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from tailorstore.core.errors import BadCheckpointError, TailorError

TEXT_LIMIT = 64 << 20  # a Trainer's trainer_state.json grows with its log history: a few MB after long runs
NAME_LIMIT = 64 << 10  # DeepSpeed's `latest` holds one tag name


def read_small_text(
    path: Path, what: str, limit: int = TEXT_LIMIT, error: type[TailorError] = BadCheckpointError
) -> str:
    """The UTF-8 text of ``path`` (``what`` it should be, for the message), at most ``limit`` bytes.
    OSError goes up as it is: the command line reports it as a file it cannot read. A FIFO or a
    device is refused rather than read: reading a FIFO nobody writes would wait forever."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO opens at once, and is refused below
    with open(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise error(f"{path}: not a regular file; {what} is a text file. Check that the path is right.")
        data = f.read(limit + 1)
    if len(data) > limit:
        raise error(f"{path}: over {_size(limit)}; {what} is a small text file. Check that the path is right.")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise error(
            f"{path}: not UTF-8 text (byte {exc.start}); {what} is a text file. Check that the path is right."
        ) from None


def _size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"
