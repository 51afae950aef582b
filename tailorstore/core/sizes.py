"""Byte counts as people read them (``1.2 MB``), for every message and report line: one rule, in
decimal units as ``du --si`` and disk makers count, so the command line and the library agree."""

from __future__ import annotations


def human(n: float) -> str:
    """``512 B``, ``1.2 MB``, ``3.4 TB``: whole bytes below a kilobyte, one decimal above."""
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"
