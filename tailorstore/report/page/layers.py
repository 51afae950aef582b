"""Part 4, layers: each layer's relative change between a run's stored steps, as a heatmap.

The matrix is ``tailor plot``'s (:func:`~tailorstore.report.diff.change_matrix`): per committed step
and layer, ``||w - w_prev|| / ||w_prev||`` since the previous committed step (the FP32 master, else
the weight), which is what ``tailor diff`` prints for that pair; a layer the step inherited is
flagged, not shown as no change. A run with fewer than two commits has no column to show.
"""

from __future__ import annotations

import math
from typing import Any

from tailorstore.core.errors import StoreError
from tailorstore.report.diff import change_matrix
from tailorstore.store.repo import Repository


def layer_changes(repo: Repository, runs: list[str]) -> list[dict[str, Any]]:
    """One heatmap a run: ``{run, steps, ids, columns, layers, values[layer][column], inherited}``."""
    out = []
    for run in runs:
        try:
            m = change_matrix(repo, run)
        except StoreError:  # fewer than two committed steps: nothing changed between any two
            continue
        values = [[v if v is not None and math.isfinite(v) else None for v in line] for line in m.values]
        out.append(
            {"run": run, "steps": m.steps, "ids": m.ids, "columns": m.columns, "layers": m.layers, "values": values,
             "inherited": m.inherited}
        )  # fmt: skip
    return out
