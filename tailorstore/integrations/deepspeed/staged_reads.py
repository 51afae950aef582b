"""Reading the files the engine staged for a resume: the model states mapped, any other file read,
and only files inside the engine's own restore folders, never through a link."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from tailorstore.integrations.common.store_session import is_model_states, load_torch_file


def mapped(path: str | os.PathLike) -> bool:
    """Whether a file staged for a resume is mapped rather than read: its model states, not its
    optimizer states.

    Staged files lie in tmpfs, so a read copies every byte into fresh memory, and a private
    mapping spares that copy: DeepSpeed copies the module's weights out of the loaded state
    into its own parameters. It keeps the optimizer's moments as they were loaded, though
    (torch's ``Optimizer.load_state_dict`` keeps a tensor that needs no cast), and training
    then writes them in place. A mapped moment is then copied page by page on first write,
    which cost a large resume far more than reading it (docs/PERFORMANCE.md, "Resuming from
    staged files"). Other files are read, as DeepSpeed's own engine reads them; a file that
    someone else may cut short is never mapped at all."""
    return is_model_states(Path(path).name)


def load_staged(path: str | os.PathLike) -> Any:
    """A file staged for a resume, loaded through the allowlist; mapped where :func:`mapped` says
    and only while nobody else can cut it short (:func:`only_ours`)."""
    return load_torch_file(path, mmap=mapped(path) and only_ours(path))[0]


def only_ours(path: str | os.PathLike) -> bool:
    """Whether only this user can write ``path`` or replace it in its folder. A mapped file that
    someone cuts short kills the process with SIGBUS, and a checkout applies the modes the store
    records, which a stranger with write access to the store may have set (0o666)."""
    try:
        file, folder = os.stat(path), os.stat(Path(path).parent)
    except OSError:
        return False
    return file.st_uid == os.getuid() and not (file.st_mode | folder.st_mode) & 0o022


def below(path: str | os.PathLike, root: Path) -> Path | None:
    """``path`` relative to ``root`` when it lies below it, else None (links resolved)."""
    try:
        inside = Path(path).resolve().relative_to(root.resolve())
    except ValueError:
        return None
    return inside if inside.parts else None
