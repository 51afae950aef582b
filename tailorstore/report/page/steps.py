"""One row per stored step, as ``log --json`` and ``usage --json`` say it: the table's rows, and what
the other parts mark on their curves (what a step is, its tag and pin, the keep-best choice)."""

from __future__ import annotations

from dataclasses import dataclass, field

from tailorstore.core.records import COMMIT, THIN_ARCHIVE
from tailorstore.report.inspect import StepSummary
from tailorstore.report.page.facts import GcOutlook
from tailorstore.report.usage import StepUsage

WHOLE, COMPOSITE, THINNED, ARCHIVED, AVERAGE, MERGE = "whole", "composite", "thinned", "archived", "average", "merge"


def kind_of(s: StepSummary) -> str:
    """What a step is, as the page's markers tell it: a commit whole (every layer its own) or
    composite (layers inherited), thinned or archived by gc; a merge an average or a composite."""
    if s.origin != COMMIT:
        return AVERAGE if s.policy.get("name") == "average" else MERGE
    if s.tier == THIN_ARCHIVE:
        return ARCHIVED
    if s.tier is not None:
        return THINNED
    return WHOLE if s.exact else COMPOSITE


@dataclass
class StepRow:
    """A step of the table: ``log``'s fields, ``usage``'s bytes held alone, what the next gc does."""

    id: str
    run: str
    step: int
    origin: str
    kind: str
    tier: str | None
    tag: str | None
    pinned: bool
    created_at: float
    raw_bytes: int  # the save as committed
    held_bytes: int  # what it checks out to now (less, once thinned)
    new_bytes: int  # what its commit newly stored
    held_alone: int  # stored bytes no other step uses
    metrics: dict[str, float | None] = field(default_factory=dict)
    best: tuple[str, ...] = ()  # the keep-best rules that keep it
    next_gc: str = ""  # "", "drop" or "thin to TIER"
    source: str = ""
    digest: str = ""
    manifest: int = 0  # this index's row: the join key, never shown
    policy: dict = field(default_factory=dict)  # the policy or merge spec it was made by (``show``'s)


def step_rows(log: list[StepSummary], usage: list[StepUsage], gc: GcOutlook) -> list[StepRow]:
    """The steps in ``log``'s order, each with its usage row and the gc plan's word on it."""
    alone = {u.manifest: u.held_alone for u in usage}
    rows = []
    for s in log:
        action = (
            "drop" if s.manifest in gc.drops else f"thin to {gc.thins[s.manifest]}" if s.manifest in gc.thins else ""
        )
        rows.append(
            StepRow(
                id=s.id, run=s.run, step=s.step, origin=s.origin, kind=kind_of(s), tier=s.tier,
                tag=", ".join(s.tags) or None, pinned=s.pinned, created_at=s.created_at, raw_bytes=s.raw_bytes,
                held_bytes=s.raw_bytes if s.held_bytes is None else s.held_bytes, new_bytes=s.new_bytes,
                held_alone=alone.get(s.manifest, 0), metrics=dict(s.metrics), best=gc.best.get(s.manifest, ()),
                next_gc=action, source=s.source, digest=s.digest, manifest=s.manifest,
                policy=s.policy,
            )
        )  # fmt: skip
    return rows
