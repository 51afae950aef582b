"""This process's memory, as the soaks sample it."""

from __future__ import annotations

import os


def resident_bytes() -> int:
    """This process's resident memory now (not the peak, which ``getrusage`` gives)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
