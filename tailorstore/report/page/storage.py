"""Part 2, bytes over time: what the saves stand for against what the store holds, per tier.

In the order the steps were committed: the running sum of each save's raw bytes (``log``'s
``raw_bytes``), of what the steps check out to now (``held_bytes``), of what each commit newly
stored (``new_bytes``), and of the stored bytes each tier's steps hold alone (``usage``'s
``held_alone``, by the step's tier now). The totals now are ``usage``'s: the store's bytes with its
index, the part several steps share, and what the next gc would free. A point names its step by
its row in the table of steps (part 5), where its id, run, step and time are.
"""

from __future__ import annotations

from itertools import accumulate
from typing import Any

from tailorstore.report.page.steps import StepRow
from tailorstore.report.usage import Usage

TIER_NAMES = ("whole", "weights", "master", "archive")  # a step's tier, None read as whole


def bytes_over_time(rows: list[StepRow], usage: Usage) -> dict[str, Any]:
    """``{"rows": the table's rows in commit order, "saved", "held", "new", "alone_by_tier", "now"}``."""
    order = sorted(range(len(rows)), key=lambda i: (rows[i].created_at, rows[i].manifest))
    ordered = [rows[i] for i in order]
    tiers = {name: [r.held_alone if (r.tier or "whole") == name else 0 for r in ordered] for name in TIER_NAMES}
    used = {name: list(accumulate(v)) for name, v in tiers.items() if any(v)}
    alone = sum(r.held_alone for r in rows)
    return {
        "rows": order,
        "saved": list(accumulate(r.raw_bytes for r in ordered)),
        "held": list(accumulate(r.held_bytes for r in ordered)),
        "new": list(accumulate(r.new_bytes for r in ordered)),
        "alone_by_tier": used,
        "now": {
            "saved_bytes": usage.saved_bytes,
            "raw_bytes": usage.raw_bytes,
            "stored_bytes": usage.stored_bytes,
            "index_bytes": usage.index_bytes,
            "shared_bytes": max(0, usage.stored_bytes - usage.index_bytes - alone),
            "alone_by_tier": {name: sum(v) for name, v in tiers.items() if any(v)},
            "gc_frees": usage.gc_frees,
            "ratio": usage.ratio,
        },
    }
