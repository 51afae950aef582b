"""Sizes of folders that other processes write and delete while they are measured."""

from __future__ import annotations

import os
import stat
from pathlib import Path


def dir_bytes(path: Path) -> int:
    """Bytes of the files under ``path``; a file or folder deleted while it is walked (a gc, a
    commit or a resume cleaning its staging beside the walk) counts as gone. ``os.walk`` passes
    over a folder that vanishes between listing and entering it, where ``Path.rglob`` raised."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                st = os.lstat(os.path.join(root, name))
            except FileNotFoundError:
                continue
            total += st.st_size if stat.S_ISREG(st.st_mode) else 0
    return total
