"""The report page at scale: a store of 10,000 real steps, its page's size, and its render time.

``python -m benchmarks.report_page [--steps 10000] [--work DIR] [--loads 3] [--grow N]`` commits
``--steps`` real ``torch.save`` saves of a tiny Llama-shaped training (testbed/history_store.py:
tiny tensors, so what is measured is the page, not the codec) into one store, with what every part
shows (:func:`build`), then writes ``tailor report`` and opens it in the system's chromium
(testbed/browser.py: offline, every request but the file refused). Measured: the time to build the
store and write the page, the file's size, and the time from navigation to every part drawn
(``performance.now()`` when the page's script has drawn its five parts: parsing the inlined
plotly.js included), best and median over ``--loads`` fresh browsers, with where the best load's
time went, and the machine's load average. ``--grow N`` also renders the store's page data grown
to N steps (:func:`grown`), for a scale the build cannot reach in the time at hand; the output
names it ``grown``. Prints one JSON document.

The issue's bar: at most 2 s to render and under 10 MB.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from itertools import accumulate
from pathlib import Path
from typing import Any

import torch

from tailorstore import Retention, Store
from testbed.browser import open_page
from testbed.history_store import saves

BUILT = "built"  # written in --work when the store is whole: a later run measures it again


def build(root: Path, steps: int, *, branch_steps: int = 100) -> Path:
    """The store: ``steps`` main steps (every 10th composite), a branch of ``branch_steps`` from the
    middle, an average of the branch's last two steps and a composite merge on main, the oldest
    fifth of main thinned to weights and the odd steps of its oldest tenth archived, and a
    keep-best retention, so every part of the page has something to show. Every step is a real
    ``Store.commit`` of a real save, in this one process (a ``tailor commit`` process a step would
    spend most of its time starting up). torch gets one thread: its tiny training steps spend
    more time waking its thread pool than computing, and far more on a busy machine."""
    torch.set_num_threads(1)
    started = time.monotonic()
    location = root / "store"
    done = 0  # a store a stopped build left (its main steps are real commits): carry on from its last
    if location.exists():
        with Store.open(location) as store:
            done = max((s.step for s in store.log() if s.run == "main"), default=0)
    with Store.open(location) if done else Store.init(location) as store:
        for step, path, loss in saves(root / "saves", steps - done, blocks=2, seed=done):
            step += done
            policy = "parity" if step % 10 == 0 else "full"
            store.commit(
                path, step=step, policy=policy, metrics={"eval_loss": loss, "step_seconds": 0.5 + step % 7 / 10}
            )
            if step % 500 == 0:
                store.tag(f"step={step}", f"k{step}")
            if step % 1000 == 0:
                store.pin(f"step={step}")
                print(
                    f"committed {step} of {steps} steps, {time.monotonic() - started:.0f} s",
                    file=sys.stderr,
                    flush=True,
                )
        store.create_run("branch", base=f"step={steps // 2}")
    with Store.open(location, run="branch") as branch:
        for step, path, loss in saves(root / "branch-saves", branch_steps, blocks=2, seed=1):
            branch.commit(path, step=steps // 2 + step, metrics={"eval_loss": loss})
        spec = root / "average.yaml"
        last = steps // 2 + branch_steps
        spec.write_text(f"method: sma\nsteps: [{last - 1}, {last}]\n")
        branch.merge(spec, tag="branch-avg")
    with Store.open(location) as store:
        spec = root / "composite.yaml"
        spec.write_text(f"base: {{step: {steps}}}\nslices:\n  - sources: [{{step: 1, layer_range: [0, 1]}}]\n")
        store.merge(spec, tag="mix")
        store.gc(Retention(keep_last=steps - steps // 5, thin="weights", run="main"))
        store.gc(Retention(keep_last=steps - steps // 10, keep_every=2, thin="archive", run="main"))
        store.set_retention(Retention(keep_last=5, keep_best="eval_loss:min:5"))
    (root / BUILT).write_text(f"{steps}\n")
    return location


def grown(data: dict[str, Any], total: int) -> dict[str, Any]:
    """The page's data for ``total`` steps, grown from a real store's: main's commits repeated, in
    order, under the steps after its last (new ids and times, no keep-best), with their curves',
    bytes' and layers' points. Where a real store of ``total`` steps cannot be built in the time at
    hand (each commit lists every manifest, so a build is quadratic in its steps), this is what the
    page would carry and draw for it; the figures say which they are."""
    data = json.loads(json.dumps(data))
    t = data["steps"]
    c = {name: i for i, name in enumerate(t["columns"])}
    source = [i for i in data["metrics"]["track"][0]["rows"] if t["rows"][i][c["kind"]] not in ("average", "merge")]
    run = data["metrics"]["track"][0]["run"]
    last, when = max(t["rows"][i][c["step"]] for i in source), max(r[c["created_at"]] for r in t["rows"])
    heat = next((h for h in data["layers"] if h["run"] == run), None)
    columns = {row: j for j, row in enumerate(heat["rows"])} if heat else {}
    added = []
    for n in range(total - len(t["rows"])):
        i = source[n % len(source)]
        row = list(t["rows"][i])
        row[c["step"]], row[c["id"]], row[c["best"]] = last + n + 1, f"g{n:09x}", []
        row[c["created_at"]] = when + n + 1
        added.append(len(t["rows"]))
        t["rows"].append(row)
        if heat and i in columns:
            heat["rows"].append(added[-1])
            for line in (*heat["values"], *heat["inherited"]):
                line.append(line[columns[i]])
    for part in (*data["metrics"]["series"], *data["metrics"]["track"]):
        if part["run"] == run:
            part["rows"] += added
    b = data["bytes"]
    b["rows"] += added
    ordered = [t["rows"][i] for i in b["rows"]]
    for key, column in (("saved", "raw_bytes"), ("held", "held_bytes"), ("new", "new_bytes")):
        b[key] = list(accumulate(r[c[column]] for r in ordered))
    for tier in b["alone_by_tier"]:
        b["alone_by_tier"][tier] = list(
            accumulate(r[c["held_alone"]] if (r[c["tier"]] or "whole") == tier else 0 for r in ordered)
        )
    for lane in data["lineage"]["runs"]:
        if lane["name"] == run:
            lane["steps"] += [t["rows"][i][c["step"]] for i in added]
    data["store"]["steps"] = len(t["rows"])
    return data


def measure(page: Path, loads: int) -> dict[str, Any]:
    """``loads`` fresh browsers on ``page``: navigation to every part drawn, best and median, and where
    the best load's time went (``window.tailorTook``: the page's script starting, after HTML and
    plotly.js are parsed and run, then unpacking the data and each part; absent in older pages)."""
    renders: list[tuple[float, Any]] = []
    for _ in range(loads):
        with open_page(page, timeout_s=120) as seen:
            assert not seen.errors and not seen.requests, (seen.errors, seen.requests)
            renders.append(seen.evaluate("() => [window.tailorRenderedAt / 1000, window.tailorTook || null]"))
    best = min(renders, key=lambda r: r[0])
    return {
        "page_bytes": page.stat().st_size,
        "page_mb": round(page.stat().st_size / 1e6, 2),
        "render_s": [round(r[0], 2) for r in renders],
        "render_best_s": round(best[0], 2),
        "render_median_s": round(statistics.median(r[0] for r in renders), 2),
        "best_load_ms": {k: round(v) for k, v in best[1].items()} if best[1] else None,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=10_000)
    parser.add_argument("--loads", type=int, default=3)
    parser.add_argument("--work", type=Path, default=None)
    parser.add_argument(
        "--grow", type=int, default=0, help="also render the store's page data grown to this many steps"
    )
    args = parser.parse_args(argv)
    root = args.work or Path(tempfile.mkdtemp(prefix="report-page-"))
    root.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    location = root / "store" if (root / BUILT).exists() else build(root, args.steps)  # a stopped build carries on
    built = time.monotonic() - started
    page = root / "report.html"
    load_before = os.getloadavg()
    with Store.open(location) as store:
        result = store.report(page)
    out: dict[str, Any] = {
        "steps": result.steps,
        "runs": result.runs,
        "build_store_s": round(built, 1),
        "write_page_s": round(result.seconds, 2),
        **measure(page, args.loads),
        "store": str(location),
    }
    if args.grow:
        from tailorstore.report.page.render import render, unpack_json

        text = page.read_text(encoding="utf-8")
        packed = text.split('id="tailor-data" data-encoding="gzip+base64">', 1)[1].split("</script>", 1)[0]
        big = root / f"report-grown-{args.grow}.html"
        big.write_text(render(grown(unpack_json(packed), args.grow)), encoding="utf-8")
        out["grown"] = {"steps": args.grow, **measure(big, args.loads)}
    out["load_average"] = [round(x, 1) for x in (*load_before, *os.getloadavg())]  # 1, 5, 15 min: before, after
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
