"""What every operation that writes a folder reports: which step, from which manifest, where, how many
bytes, and how long the library call took. Checkout (native, resharded, universal) and export
extend it, so a caller that only wants "where did it go and how much" needs no case per verb."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class FolderResult:
    step: int
    manifest: int
    out: Path
    bytes_written: int
    seconds: float = field(default=0.0, kw_only=True)  # the library call, without the process's start-up
