"""Sizes of folders that other processes write and delete while they are measured."""

from __future__ import annotations

from pathlib import Path


def dir_bytes(path: Path) -> int:
    """Bytes of the files under ``path``; a file deleted while it is walked (a gc or a commit
    running beside the walk) counts as gone."""
    total = 0
    for p in path.rglob("*"):
        try:
            total += p.stat().st_size if p.is_file() else 0
        except FileNotFoundError:
            pass
    return total
