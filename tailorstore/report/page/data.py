"""The page's data: one JSON-ready document with a key for each of the five parts.

Each step's fields are written once, in the table of steps (part 5); the other parts name a step
by its index there, so the page's data grows by one table row and a few numbers a step.
Everything comes from the read paths of the commands (``log``, ``usage``, ``show``, the change
matrix ``diff`` and ``plot`` measure), so each chart's numbers are the numbers those commands print
for the same store; tests/system/test_report_page.py holds each part to them.
"""

from __future__ import annotations

import time
from typing import Any

from tailorstore.report.inspect import log
from tailorstore.report.page.facts import HistoryFacts
from tailorstore.report.page.layers import layer_changes
from tailorstore.report.page.lineage import lineage
from tailorstore.report.page.metrics import metric_series
from tailorstore.report.page.steps import StepRow, step_rows
from tailorstore.report.page.storage import bytes_over_time
from tailorstore.report.usage import usage
from tailorstore.store.repo import Repository

TABLE_COLUMNS = (
    "id", "run", "step", "kind", "tag", "pinned", "tier", "created_at", "raw_bytes", "held_bytes", "new_bytes",
    "held_alone", "best", "next_gc", "source", "digest",
)  # fmt: skip


def report_data(repo: Repository, facts: HistoryFacts, *, store_id: str | None = None) -> dict[str, Any]:
    """The five parts (``metrics``, ``bytes``, ``lineage``, ``layers``, ``steps``) and a header."""
    steps = log(repo)
    used = usage(repo, gc_frees=facts.gc.frees)
    rows = step_rows(steps, used.steps, facts.gc)
    runs = [r.name for r in facts.runs] or list(dict.fromkeys(r.run for r in rows))
    return {
        "store": {"location": str(repo.location), "id": store_id, "made_at": time.time(), "steps": len(rows)},
        "metrics": metric_series(rows),
        "bytes": bytes_over_time(rows, used),
        "lineage": lineage(repo, rows, facts.runs),
        "layers": layer_changes(repo, runs, [r.id for r in rows]),
        "steps": steps_table(rows),
    }


def steps_table(rows: list[StepRow]) -> dict[str, Any]:
    """Part 5, the table: ``columns`` (the fields, then one per metric) and a list of ``rows``."""
    metrics = sorted({name for r in rows for name in r.metrics})
    table = [
        [
            *(list(getattr(r, c)) if c == "best" else getattr(r, c) for c in TABLE_COLUMNS),
            *(r.metrics.get(m) for m in metrics),
        ]
        for r in rows
    ]
    return {"columns": [*TABLE_COLUMNS, *(f"metric:{m}" for m in metrics)], "metrics": metrics, "rows": table}
