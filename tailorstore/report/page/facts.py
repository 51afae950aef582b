"""What the page shows that report/ cannot compute itself: the runs and what the next gc would do.

Both are curate's (runs, retention, the gc plan), and a verb package does not import another
(tests/system/test_layers.py); the API learns them from curate and hands them over in these records, as
``usage`` takes ``gc_frees``.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class RunFacts:
    """A run as ``tailor run list --json`` names it: where it branched from, if anywhere."""

    name: str
    base_run: str | None = None
    base_step: int | None = None
    base_id: str | None = None  # the base's manifest id, the same on every host


@dataclass(frozen=True)
class GcOutlook:
    """What ``tailor gc`` without rules (each run's own retention) would do now."""

    frees: int = 0  # stored bytes it would delete
    drops: frozenset[int] = frozenset()  # manifests (index rows) it would drop
    thins: dict[int, str] = field(default_factory=dict)  # manifest -> the tier it would thin it to
    best: dict[int, tuple[str, ...]] = field(default_factory=dict)  # manifest -> keep-best rules that keep it


@dataclass(frozen=True)
class HistoryFacts:
    runs: tuple[RunFacts, ...] = ()
    gc: GcOutlook = field(default_factory=GcOutlook)
