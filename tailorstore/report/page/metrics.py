"""Part 1, metrics over steps: one curve per run and metric, a marker at each stored step.

A curve runs through a run's commits in step order; a merge carries its base's step, so it is no
point of training and is left off the curves (it stays a marker on the steps track). Every stored
step is a marker on that track, whatever it recorded, so a store with no metrics still shows
which steps it holds and what each is.
"""

from __future__ import annotations

from typing import Any

from tailorstore.core.records import COMMIT
from tailorstore.report.page.steps import StepRow


def metric_series(rows: list[StepRow]) -> dict[str, Any]:
    """``{"names", "series": [{run, metric, steps, values, ids, kinds, tags, pinned, best}], "track"}``."""
    names = sorted({name for r in rows for name in r.metrics})
    series = []
    runs = list(dict.fromkeys(r.run for r in rows))
    for run in runs:
        commits = sorted((r for r in rows if r.run == run and r.origin == COMMIT), key=lambda r: r.step)
        for name in names:
            points = [r for r in commits if name in r.metrics]
            if points:
                series.append(
                    {"run": run, "metric": name, **_marks(points), "values": [r.metrics[name] for r in points]}
                )
    track = [{"run": run, **_marks(sorted((r for r in rows if r.run == run), key=lambda r: r.step))} for run in runs]
    return {"names": names, "series": series, "track": track}


def _marks(points: list[StepRow]) -> dict[str, list[Any]]:
    """What each point's marker says: its step and id, what it is, its tag, pin and keep-best rules."""
    return {
        "steps": [r.step for r in points],
        "ids": [r.id for r in points],
        "kinds": [r.kind for r in points],
        "tags": [r.tag for r in points],
        "pinned": [r.pinned for r in points],
        "best": [list(r.best) for r in points],
    }
