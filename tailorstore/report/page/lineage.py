"""Part 3, lineage: the runs as lanes of steps, where each branched, and the merges and averages
with the steps they came from.

A run's base is ``run list``'s; an average's sources are the steps its spec averaged (``show``'s
policy), a composite merge's the steps whose layers it uses (``show``'s layer sources). Only the
steps that say something are nodes (the ends of a run, tags, pins, forks, merges and what they took):
a lane of 10,000 steps is one line, not 10,000 nodes.
"""

from __future__ import annotations

from typing import Any, Protocol

from tailorstore.core.records import COMMIT, LayerRecord
from tailorstore.report.page.facts import RunFacts
from tailorstore.report.page.steps import AVERAGE, StepRow
from tailorstore.store.repo import Repository

MOST_SOURCES = 10_000  # an average's spec names at most this many steps (curate/averaging.py)


class LineageView(Protocol):
    """The index as lineage reads a merge: where each of its layers comes from."""

    def layers(self, manifest: int) -> list[LayerRecord]: ...


def lineage(repo: Repository, rows: list[StepRow], runs: tuple[RunFacts, ...]) -> dict[str, Any]:
    """``{"runs": [{name, steps, base}], "nodes": [...], "edges": [{from, to, kind}]}``, each end
    named ``{run, step, id}``."""
    by_manifest = {r.manifest: r for r in rows}
    commits: dict[tuple[str, int], StepRow] = {(r.run, r.step): r for r in rows if r.origin == COMMIT}
    lanes = []
    for run in runs:
        own = sorted(r.step for r in rows if r.run == run.name and r.origin == COMMIT)
        base = None if run.base_run is None else {"run": run.base_run, "step": run.base_step, "id": run.base_id}
        lanes.append({"name": run.name, "steps": own, "base": base})
    edges = []
    for run in runs:
        if run.base_run is not None:
            first = min((r for r in rows if r.run == run.name), key=lambda r: r.step, default=None)
            to = _end(first) if first else {"run": run.name, "step": run.base_step, "id": None}
            edges.append(
                {"from": {"run": run.base_run, "step": run.base_step, "id": run.base_id}, "to": to, "kind": "fork"}
            )
    for merge in (r for r in rows if r.origin != COMMIT):
        if merge.kind == AVERAGE:
            sources = [commits.get((merge.run, step)) for step in averaged_steps(merge.policy)]
        else:
            found = {x.source for x in repo.view(LineageView).layers(merge.manifest)}
            sources = [by_manifest.get(m) for m in sorted(found)]
        for source in sorted({s.manifest: s for s in sources if s is not None}.values(), key=lambda s: s.step):
            edges.append({"from": _end(source), "to": _end(merge), "kind": merge.kind})
    named = {e[end]["id"] for e in edges for end in ("from", "to")}
    nodes = [
        {**_end(r), "kind": r.kind, "tag": r.tag, "pinned": r.pinned}
        for r in rows
        if r.id in named or r.tag or r.pinned or r.origin != COMMIT or _at_an_end(r, lanes)
    ]
    return {"runs": lanes, "nodes": nodes, "edges": edges}


def _end(r: StepRow) -> dict[str, Any]:
    return {"run": r.run, "step": r.step, "id": r.id}


def _at_an_end(r: StepRow, lanes: list[dict[str, Any]]) -> bool:
    lane = next((x for x in lanes if x["name"] == r.run), None)
    return lane is not None and bool(lane["steps"]) and r.step in (lane["steps"][0], lane["steps"][-1])


def averaged_steps(policy: dict[str, Any]) -> list[int]:
    """The steps an average's recorded spec names: a list, or ``{from, to, every}``."""
    spec = policy.get("spec")
    steps = spec.get("steps") if isinstance(spec, dict) else None
    if isinstance(steps, list):
        return [s for s in steps if isinstance(s, int)][:MOST_SOURCES]
    if isinstance(steps, dict) and all(isinstance(steps.get(k), int) for k in ("from", "to", "every")):
        start, stop, every = steps["from"], steps["to"], max(1, steps["every"])
        return list(range(start, stop + 1, every))[:MOST_SOURCES]
    return []
