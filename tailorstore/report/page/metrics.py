"""Part 1, metrics over steps: one curve per run and metric, a marker at each stored step.

A curve runs through a run's commits in step order; a merge carries its base's step, so it is no
point of training and is left off the curves (it stays a marker on the steps track). Every stored
step is a marker on that track, whatever it recorded, so a store with no metrics still shows
which steps it holds and what each is.

A point is named by its row in the table of steps (part 5), which holds its step, id, kind, tag,
pin, keep-best rules and metric values once: at 10,000 steps, writing them again for each curve
and the track would make the page most of its size again.
"""

from __future__ import annotations

from typing import Any

from tailorstore.core.records import COMMIT
from tailorstore.report.page.steps import StepRow


def metric_series(rows: list[StepRow]) -> dict[str, Any]:
    """``{"names", "series": [{run, metric, rows}], "track": [{run, rows}]}``, each ``rows`` the
    points' indices into ``rows`` (the table's order), in step order."""
    names = sorted({name for r in rows for name in r.metrics})
    at = {id(r): i for i, r in enumerate(rows)}
    series = []
    runs = list(dict.fromkeys(r.run for r in rows))
    for run in runs:
        commits = sorted((r for r in rows if r.run == run and r.origin == COMMIT), key=lambda r: r.step)
        for name in names:
            points = [at[id(r)] for r in commits if name in r.metrics]
            if points:
                series.append({"run": run, "metric": name, "rows": points})
    track = [
        {"run": run, "rows": [at[id(r)] for r in sorted((r for r in rows if r.run == run), key=lambda r: r.step)]}
        for run in runs
    ]
    return {"names": names, "series": series, "track": track}
