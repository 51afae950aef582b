"""Paths that come out of a manifest must stay inside the output directory."""

from __future__ import annotations

from pathlib import Path, PurePosixPath

from tailorstore.core.errors import UnsafePathError


def check_relative(rel: str) -> PurePosixPath:
    """A manifest path: relative, '/'-separated, no '..', no empty or odd components."""
    if not rel or "\\" in rel or "\x00" in rel:
        raise UnsafePathError(f"refusing path {rel!r}: empty or with a backslash or NUL")
    path = PurePosixPath(rel)
    if path.is_absolute() or any(part in ("..", ".", "") for part in rel.split("/")):
        raise UnsafePathError(f"refusing path {rel!r}: it is absolute or climbs out with '..'")
    return path


def safe_join(root: Path, rel: str) -> Path:
    target = root.joinpath(*check_relative(rel).parts)
    resolved_root = root.resolve()
    if resolved_root != target.resolve().parent and resolved_root not in target.resolve().parents:
        raise UnsafePathError(f"refusing path {rel!r}: it leads outside {root}")
    return target
