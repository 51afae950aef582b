"""Small text files a user hands us: DeepSpeed's ``latest``, an HF Trainer's ``trainer_state.json``,
a merge spec, a model's ``config.json``.

They are read whole, so each read is bounded and decoded strictly: a ``latest`` that is a
gigabyte of anything, or a binary file under a text file's name, is one clear error naming
the file, not a process that fills memory or stops on a ``UnicodeDecodeError`` traceback.
"""

from __future__ import annotations

from tailorstore.core.errors import BadCheckpointError, TailorError
from tailorstore.core.local_files import LeadsOutside, NotRegularFile, TooLarge, Where, path_of, read_small

TEXT_LIMIT = 64 << 20  # a Trainer's trainer_state.json grows with its log history: a few MB after long runs
NAME_LIMIT = 64 << 10  # DeepSpeed's `latest` holds one tag name


def read_small_text(
    where: Where, what: str, limit: int = TEXT_LIMIT, error: type[TailorError] = BadCheckpointError
) -> str:
    """The UTF-8 text of ``where`` (``what`` it should be, for the message), at most ``limit`` bytes:
    a path the user named, or a file beneath a checkpoint (``core/local_files``). Other OSErrors
    go up as they are: the command line reports a file it cannot read. A FIFO or a device is
    refused rather than read (reading a FIFO nobody writes would wait forever), and so is a link
    out of the checkpoint."""
    path = path_of(where)
    fix = "Check that the path is right."
    try:
        data = read_small(where, limit)
    except NotRegularFile as exc:
        raise error(f"{path}: {exc.kind}, not a regular file; {what} is a text file. {fix}") from None
    except LeadsOutside:
        raise error(f"{path}: a symbolic link that leads outside the checkpoint; {what} belongs in it.") from None
    except TooLarge:
        raise error(f"{path}: over {_size(limit)}; {what} is a small text file. {fix}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise error(
            f"{path}: not UTF-8 text (byte {exc.start}); {what} is a text file. Check that the path is right."
        ) from None


def _size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"
