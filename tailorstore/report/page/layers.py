"""Part 4, layers: each layer's relative change between a run's stored steps, as a heatmap.

The matrix is ``tailor plot``'s (:func:`~tailorstore.report.diff.change_matrix`): per committed step
and layer, ``||w - w_prev|| / ||w_prev||`` since the previous committed step (the FP32 master, else
the weight), which is what ``tailor diff`` prints for that pair; a layer the step inherited is
flagged, not shown as no change. A run with fewer than two commits has no column to show.

A column names its step by its row in the table of steps (part 5), where its step, id and tag are;
the inherited flags are 0 or 1, which at 10,000 columns a layer is a fifth of ``false``'s size.
"""

from __future__ import annotations

import math
from typing import Any

from tailorstore.core.errors import StoreError
from tailorstore.report.diff import change_matrix
from tailorstore.store.repo import StepReader


def layer_changes(repo: StepReader, runs: list[str], ids: list[str]) -> list[dict[str, Any]]:
    """One heatmap a run: ``{run, rows, layers, values[layer][column], inherited[layer][column]}``,
    ``rows`` each column's index into ``ids`` (the table's steps, in its order)."""
    at = {name: i for i, name in enumerate(ids)}
    out = []
    for run in runs:
        try:
            m = change_matrix(repo, run)
        except StoreError:  # fewer than two committed steps: nothing changed between any two
            continue
        values = [[v if v is not None and math.isfinite(v) else None for v in line] for line in m.values]
        out.append(
            {"run": run, "rows": [at[name] for name in m.ids], "layers": m.layers, "values": values,
             "inherited": [[int(flag) for flag in line] for line in m.inherited]}
        )  # fmt: skip
    return out
