"""`tailor report`: one offline page of a store's history.

Each chart's data is held to what the commands print for the same store (``log --json``,
``usage --json``, ``diff --json``, ``show --json``, ``run list --json``, ``gc --dry-run --json``),
read from the JSON the written page carries; the page itself is opened in a real headless
chromium with the network off (testbed/browser.py), each part drawn, no console error, and a
screenshot kept. The store is real: tiny Llama-shaped trainings saved with ``torch.save`` and
committed (testbed/history_store.py), with tags, pins, a branch, composites, an average, a merge,
thinned and archived steps and a keep-best retention.
"""

from __future__ import annotations

import json
import re
import shutil
from collections import Counter
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest

from tailorstore.report.page.render import inline_script, packed_json, script_json, unpack_json
from tailorstore.store.repo import Repository
from tests.conftest import REPO_ROOT, one_line, tailor, tailor_here

ARTIFACTS = REPO_ROOT / ".artifacts"  # ignored by git: screenshots a run leaves


def page_data(page: Path) -> dict[str, Any]:
    """The data the page carries, as its script reads it (the one data element: gzipped JSON in base64)."""
    text = page.read_text(encoding="utf-8")
    found = re.findall(r'<script type="application/gzip" id="tailor-data"[^>]*>(.*?)</script>', text, re.DOTALL)
    assert len(found) == 1
    assert re.fullmatch(r"[A-Za-z0-9+/=]*", found[0].strip())  # base64: nothing in it can close the element
    return unpack_json(found[0])


def table(data: dict[str, Any]) -> list[dict[str, Any]]:
    """The table of steps as one dict a row: the other parts name their steps by index into it."""
    t = data["steps"]
    return [dict(zip(t["columns"], row, strict=True)) for row in t["rows"]]


def cli_json(store: Path, *args: str) -> Any:
    done = tailor_here(*args, "--json", store=store)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@dataclass
class History:
    store: Path
    page: Path
    data: dict[str, Any]
    log: list[dict[str, Any]]


@pytest.fixture(scope="module")
def history(tmp_path_factory: pytest.TempPathFactory) -> History:
    from testbed.history_store import build_history

    root = tmp_path_factory.mktemp("history")
    store = build_history(root)
    page = root / "out" / "history.html"
    done = tailor("report", "--out", str(page), store=store)  # the command as a user runs it
    assert done.returncode == 0 and "wrote" in done.stdout, done.stderr
    return History(store, page, page_data(page), cli_json(store, "log"))


# -- pure: the data cannot close its script element ----------------------------------------------------------

HOSTILE = ["</script><script>window.__pwned=1</script>", "<!--", "a&b", "\u2028\u2029", "<img src=x onerror=alert(1)>"]


def test_the_embedded_json_is_inert_inside_a_script_element() -> None:
    data = {"tags": HOSTILE, "nested": {h: h for h in HOSTILE}, "surrogate": "bad\udcff byte"}
    text = script_json(data)
    assert not set(text) & {"<", ">", "&", "\u2028", "\u2029"} and text.isascii(), text
    assert json.loads(text) == data
    packed = packed_json(data)
    assert re.fullmatch(r"[A-Za-z0-9+/=]+", packed) and unpack_json(packed) == data
    with pytest.raises(ValueError):
        script_json({"x": float("nan")})  # the data maps NaN to null before; a NaN left is a bug
    with pytest.raises(Exception, match="cannot be inlined"):
        inline_script("var a = '</SCRIPT>';", "a script")


def test_report_refuses_a_path_that_is_no_new_html_file_before_reading(tmp_path: Path) -> None:
    store = tmp_path / "store"
    Repository.init(store).close()
    (tmp_path / "dir.html").mkdir()
    for out, words in (
        (tmp_path / "r.png", ("HTML page", ".html")),
        (tmp_path / "dir.html", ("not a regular file",)),
        (store / "r.html", ("inside the store",)),
    ):
        one_line(tailor_here("report", "--out", str(out), store=store), 2, *words)
    assert not (store / "r.html").exists()
    done = tailor_here("report", "--out", str(tmp_path / "empty.html"), "--json", store=store)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["steps"] == 0
    empty = page_data(tmp_path / "empty.html")
    assert empty["steps"]["rows"] == [] and empty["layers"] == [] and empty["bytes"]["rows"] == []


# -- each chart's data is what the commands say ----------------------------------------------------------


def commits(log: list[dict[str, Any]], run: str) -> list[dict[str, Any]]:
    return sorted((s for s in log if s["run"] == run and s["origin"] == "commit"), key=lambda s: s["step"])


def values(rows: list[dict[str, Any]], series: dict[str, Any]) -> list[Any]:
    """A curve's values: its metric's column at its rows of the table."""
    return [rows[i][f"metric:{series['metric']}"] for i in series["rows"]]


def kind(s: dict[str, Any]) -> str:
    """What a step is, from its ``log --json`` fields alone."""
    if s["origin"] != "commit":
        return "average" if s["policy"].get("name") == "average" else "merge"
    if s["tier"] == "archive":
        return "archived"
    return "thinned" if s["tier"] else "whole" if s["exact"] else "composite"


@pytest.mark.slow
def test_the_metrics_chart_is_what_log_says(history: History) -> None:
    """Part 1: a curve per run and metric through its commits' values; a marker per stored step by
    what it is, with its tag and pin; the stars are the steps keep-best keeps (gc's own plan)."""
    m, log, rows = history.data["metrics"], history.log, table(history.data)
    names = sorted({n for s in log for n in s["metrics"]})
    assert m["names"] == names == ["eval_loss", "lr"]
    expected = []
    for run in ("main", "exp"):
        for name in names:
            points = [s for s in commits(log, run) if name in s["metrics"]]
            if points:
                expected.append((run, name, [s["step"] for s in points], [s["metrics"][name] for s in points]))
    drawn = [
        (
            s["run"],
            s["metric"],
            [rows[i]["step"] for i in s["rows"]],
            [rows[i][f"metric:{s['metric']}"] for i in s["rows"]],
        )
        for s in m["series"]
    ]
    assert drawn == expected
    track = {t["run"]: [rows[i] for i in t["rows"]] for t in m["track"]}
    for run in ("main", "exp"):
        mine = sorted((s for s in log if s["run"] == run), key=lambda s: s["step"])
        t = track[run]
        assert [r["id"] for r in t] == [s["id"] for s in mine] and [r["kind"] for r in t] == [kind(s) for s in mine]
        assert [r["tag"] for r in t] == [s["tag"] for s in mine] and [r["pinned"] for r in t] == [
            s["pinned"] for s in mine
        ]
    kinds = {r["kind"] for t in track.values() for r in t}
    assert kinds == {"whole", "composite", "thinned", "archived", "average", "merge"}, kinds
    # The keep-best choice: what gc keeps under the keep-best rule alone, less what it keeps anyway.
    plan = cli_json(history.store, "gc", "--dry-run", "--keep-best", "eval_loss:min:2", "--run", "main")
    kept = Counter(step for m, step in plan["keep"] if plan["runs"][str(m)] == "main")
    kept -= Counter(s["step"] for s in log if s["run"] == "main" and s["origin"] != "commit")  # merges stay anyway
    kept_steps = set(kept)  # the commits gc keeps
    anyway = {s["step"] for s in log if s["run"] == "main" and s["origin"] == "commit" and (s["tag"] or s["pinned"])}
    starred = {rows[i]["step"] for s in m["series"] if s["run"] == "main" for i in s["rows"] if rows[i]["best"]}
    assert starred == kept_steps - anyway and len(starred) == 2, (starred, kept_steps)


@pytest.mark.slow
def test_the_bytes_chart_is_what_log_and_usage_say(history: History) -> None:
    """Part 2: running sums in commit order of log's raw, held and new bytes, and of usage's bytes
    held alone by each tier's steps; the totals now are usage's, gc's frees among them."""
    b, log = history.data["bytes"], history.log
    usage = cli_json(history.store, "usage")
    ordered = sorted(log, key=lambda s: s["created_at"])
    rows = table(history.data)
    assert [rows[i]["id"] for i in b["rows"]] == [s["id"] for s in ordered]

    def running(values: list[int]) -> list[int]:
        out, total = [], 0
        for v in values:
            total += v
            out.append(total)
        return out

    assert b["saved"] == running([s["raw_bytes"] for s in ordered]) and b["saved"][-1] == usage["saved_bytes"]
    assert b["held"] == running([s["held_bytes"] for s in ordered]) and b["held"][-1] == usage["raw_bytes"]
    assert b["new"] == running([s["new_bytes"] for s in ordered])
    alone = {u["id"]: u["held_alone"] for u in usage["steps"]}
    for tier in ("whole", "weights", "archive"):
        mine = [alone[s["id"]] if (s["tier"] or "whole") == tier else 0 for s in ordered]
        assert b["alone_by_tier"][tier] == running(mine), tier
    now = b["now"]
    for key in ("saved_bytes", "raw_bytes", "stored_bytes", "index_bytes", "gc_frees"):
        assert now[key] == usage[key], key
    assert now["gc_frees"] > 0  # main's retention (keep the last 2 and the 2 best) drops steps
    assert now["shared_bytes"] == usage["stored_bytes"] - usage["index_bytes"] - sum(alone.values())


@pytest.mark.slow
def test_the_lineage_graph_is_what_run_list_and_show_say(history: History) -> None:
    """Part 3: the runs and where each forked (``run list``); an average's edges from the steps its
    spec averaged, a merge's from the steps whose layers it uses (``show``)."""
    g, log = history.data["lineage"], history.log
    runs = cli_json(history.store, "run", "list")
    drop_id = [(r["name"], r["base"] and {"run": r["base"]["run"], "step": r["base"]["step"]}) for r in g["runs"]]
    assert drop_id == [(r["name"], r["base"]) for r in runs]  # `run list --json` names a base by run and step
    assert {r["name"]: r["steps"] for r in g["runs"]} == {
        r["name"]: [s["step"] for s in commits(log, r["name"])] for r in runs
    }
    forks = [e for e in g["edges"] if e["kind"] == "fork"]
    assert [(e["from"]["run"], e["from"]["step"], e["to"]["run"], e["to"]["step"]) for e in forks] == [
        ("main", 3, "exp", 4)
    ]
    for merge in (s for s in log if s["origin"] != "commit"):
        shown = cli_json(history.store, "show", f"id={merge['id']}")
        if kind(merge) == "average":
            expected = set(shown["summary"]["policy"]["spec"]["steps"])
        else:
            expected = {layer["source_step"] for layer in shown["layers"]}
        into = {e["from"]["step"] for e in g["edges"] if e["to"]["id"] == merge["id"]}
        assert into == expected and len(into) >= 2, (merge["tag"], into, expected)
        assert {e["kind"] for e in g["edges"] if e["to"]["id"] == merge["id"]} == {kind(merge)}
    nodes = {n["id"]: n for n in g["nodes"]}
    for s in log:
        if s["tag"] or s["pinned"] or s["origin"] != "commit":
            assert nodes[s["id"]]["tag"] == s["tag"] and nodes[s["id"]]["kind"] == kind(s)


@pytest.mark.slow
def test_the_layers_heatmap_is_what_diff_says(history: History) -> None:
    """Part 4: each column is ``diff`` of a run's consecutive commits, per layer: the FP32 master's
    change where both steps hold masters, the weight's where both hold only weights, none where one
    holds masters and the other only weights (an archived step); inherited as ``show`` says."""
    log, rows = history.log, table(history.data)
    maps = {h["run"]: h for h in history.data["layers"]}
    assert set(maps) == {"main", "exp"}
    checked = 0
    for run, h in maps.items():
        steps = [s["step"] for s in commits(log, run)]
        columns = [rows[i]["step"] for i in h["rows"]]
        assert columns == steps[1:] and [rows[i]["run"] for i in h["rows"]] == [run] * len(columns)
        shows = {step: cli_json(history.store, "show", f"{run}:step={step}") for step in steps}
        for a, b in pairwise(steps):
            changed = cli_json(history.store, "diff", f"{run}:step={a}", f"{run}:step={b}")
            column = columns.index(b)
            kinds_b = {x["layer"]: x for x in shows[b]["layers"]}
            kinds_a = {x["layer"]: x for x in shows[a]["layers"]}
            assert [x["layer"] for x in changed["layers"]] == h["layers"]
            for row, layer in enumerate(changed["layers"]):
                name = layer["layer"]
                measured = ["master" if "master" in k[name]["kinds"] else "weight" for k in (kinds_a, kinds_b)]
                value = h["values"][row][column]
                if measured[0] != measured[1]:
                    assert value is None, (run, a, b, name)
                else:
                    assert value == pytest.approx(layer[measured[0]], rel=1e-12, abs=0), (run, a, b, name)
                    checked += 1
                assert h["inherited"][row][column] == (kinds_b[name]["source_step"] != b), (run, b, name)
    assert checked > 30
    assert any(any(line) for h in maps.values() for line in h["inherited"])  # the parity commits inherit


@pytest.mark.slow
def test_the_steps_table_is_what_log_and_usage_say(history: History) -> None:
    """Part 5: a row per step with log's fields, usage's bytes held alone, and what the next gc does
    (``gc --dry-run``: each run's own retention)."""
    t, log = history.data["steps"], history.log
    usage = {u["id"]: u for u in cli_json(history.store, "usage")["steps"]}
    plan = cli_json(history.store, "gc", "--dry-run")
    named = {s["id"]: (s["run"], s["step"]) for s in log}
    by_place = {(s["run"], s["step"], s["origin"]): s["id"] for s in log}
    dropped = {by_place[(plan["runs"][str(m)], step, "commit")] for m, step in plan["drop"]}
    assert dropped, plan["drop"]
    rows = [dict(zip(t["columns"], row, strict=True)) for row in t["rows"]]
    assert [r["id"] for r in rows] == [s["id"] for s in log]
    for r, s in zip(rows, log, strict=True):
        for field in (
            "run",
            "step",
            "tag",
            "pinned",
            "tier",
            "created_at",
            "raw_bytes",
            "held_bytes",
            "new_bytes",
            "source",
            "digest",
        ):
            assert r[field] == s[field], (field, r, s)
        assert r["kind"] == kind(s) and r["held_alone"] == usage[s["id"]]["held_alone"]
        assert r["next_gc"] == ("drop" if s["id"] in dropped else ""), (named[s["id"]], r["next_gc"])
        for name in t["metrics"]:
            assert r[f"metric:{name}"] == s["metrics"].get(name)


# -- in a browser ------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_the_page_draws_every_part_offline_with_no_console_error(history: History, tmp_path: Path) -> None:
    from testbed.browser import open_page

    shot = tmp_path / "report.png"
    with open_page(history.page, screenshot=shot) as seen:
        assert seen.errors == [] and seen.requests == [], (seen.errors, seen.requests)
        for chart in ("metrics", "bytes", "lineage", "layers"):
            drawn = seen.evaluate(f"""() => {{
                const svg = document.querySelector('#chart-{chart} svg.main-svg');
                const marks = [...document.querySelectorAll(
                    '#chart-{chart} .scatterlayer path.js-line, #chart-{chart} .scatterlayer path.point, '
                    + '#chart-{chart} .heatmaplayer image')]
                    .filter(e => (e.getAttribute('d') || e.getAttribute('href') || '').length > 4);
                const box = svg && svg.getBoundingClientRect();
                return svg ? [box.width, box.height, marks.length] : null;
            }}""")
            assert drawn is not None and drawn[0] > 100 and drawn[1] > 100 and drawn[2] > 0, (chart, drawn)
        rows = seen.evaluate("() => document.querySelectorAll('#steps-table tbody tr').length")
        assert rows == len(history.log)
        seen.evaluate("() => document.querySelector('#steps-table th[data-column=step]').click()")
        first = seen.evaluate("() => document.querySelector('#steps-table tbody td:nth-child(3)').textContent")
        assert first == str(min(s["step"] for s in history.log))  # sorted by step
    assert shot.stat().st_size > 10_000
    ARTIFACTS.mkdir(exist_ok=True)
    shutil.copy(shot, ARTIFACTS / "report-page.png")


@pytest.mark.slow
def test_a_long_curve_is_a_line_with_its_notable_steps_until_zoomed_in(history: History, tmp_path: Path) -> None:
    """Past 1,500 steps in view a curve is a line, markers only where a step is tagged, pinned, best
    or merged, and the track a band of cells (one image): thousands of SVG markers are what made a
    long history slow to draw. Zoomed in to fewer steps, every step in view is a marker again. The
    long history is the real store's rows repeated under new steps, rendered by the page's renderer."""
    from tailorstore.report.page.render import render
    from testbed.browser import open_page

    data = json.loads(json.dumps(history.data))
    t = data["steps"]
    step, run = t["columns"].index("step"), t["columns"].index("run")
    main = [row for row in t["rows"] if row[run] == "main" and row[t["columns"].index("kind")] != "merge"]
    first = len(t["rows"])
    for n in range(3000):
        row = list(main[n % len(main)])
        row[step] = 100 + n
        for name, plain in (("tag", None), ("pinned", False), ("best", [])):  # one tag in the grown steps
            row[t["columns"].index(name)] = f"grown-{n}" if name == "tag" and n == 1200 else plain
        t["rows"].append(row)
    grown = list(range(first, first + 3000))
    for series in data["metrics"]["series"]:
        if series["run"] == "main" and series["metric"] == "eval_loss":
            series["rows"] = series["rows"] + grown
    for track in data["metrics"]["track"]:
        if track["run"] == "main":
            track["rows"] = track["rows"] + grown
    page = tmp_path / "long.html"
    page.write_text(render(data))
    marks = "() => document.querySelectorAll('#chart-metrics .scatterlayer path.point').length"
    with open_page(page) as seen:
        assert seen.errors == [], seen.errors
        assert seen.evaluate("() => document.getElementById('metrics-dense').hidden") is False
        assert seen.evaluate("() => document.querySelectorAll('#chart-metrics .heatmaplayer image').length") == 1
        few = seen.evaluate(marks)
        assert 0 < few < 50, few  # the tagged, pinned, best and merged steps (and their stars), not 6,000
        seen.evaluate("() => Plotly.relayout('chart-metrics', {'xaxis.range': [1000, 1400]})")
        seen.page.wait_for_function("document.getElementById('metrics-dense').hidden === true")
        many = seen.evaluate(marks)
        assert many > 2 * 401, many  # every step near the view, on the curve and on the track
        assert seen.evaluate("() => document.querySelectorAll('#chart-metrics .heatmaplayer image').length") == 0


@pytest.mark.slow
def test_hostile_tags_and_paths_are_shown_as_text_never_run(tmp_path: Path) -> None:
    """A tag with markup (what a tag may hold: no '/' or '='), a step committed from a folder whose
    path closes a script element, and the page's own renderer given hostile metric and run names
    (which the store refuses to record): all shown as typed, nothing run, no element added."""
    from tailorstore import Store
    from tailorstore.report.page.render import render
    from testbed.browser import open_page
    from testbed.history_store import saves

    tag = '<b>bold</b"><img src onerror>'.replace("/", "")  # '<b>bold<b"><img src onerror>'
    evil = tmp_path / "</script><script>window.__pwned=1</script>" / "<img src=x onerror=window.__pwned=2>"
    with Store.init(tmp_path / "store") as store:
        for _step, path, loss in saves(evil, 3):
            store.commit(path, metrics={"eval_loss": loss})
        store.tag("step=2", tag)
    page = tmp_path / "hostile.html"
    assert tailor("report", "--out", str(page), store=tmp_path / "store").returncode == 0
    assert "__pwned" in json.dumps(page_data(page))  # the hostile path is in the data the page unpacks
    with open_page(page) as seen:
        assert seen.errors == [] and seen.evaluate("() => window.__pwned") is None
        assert seen.evaluate("() => document.scripts.length") == 3  # the data, plotly, the page's own: none added
        cells = seen.evaluate("() => [...document.querySelectorAll('#steps-table td')].map(td => td.textContent)")
        assert tag in cells and any("__pwned=1</script>" in c for c in cells)
        labels = seen.evaluate("() => [...document.querySelectorAll('#chart-lineage text')].map(t => t.textContent)")
        assert tag in labels, labels  # plotly drew the tag as text, not as bold markup
        assert seen.evaluate("() => document.querySelectorAll('b, img, #chart-lineage a').length") == 0
    # What the store refuses to record (metric names with markup, such run names) the page shows as text too.
    data = page_data(page)
    hostile = "<img src=x onerror=window.__pwned=3>"
    data["metrics"]["names"].append(hostile)
    data["metrics"]["series"].append({**data["metrics"]["series"][0], "metric": hostile, "run": hostile})
    data["steps"]["columns"][1] = hostile
    forged = tmp_path / "forged.html"
    forged.write_text(render(data))
    with open_page(forged) as seen:
        assert seen.errors == [] and seen.evaluate("() => window.__pwned") is None
        options = seen.evaluate("() => [...document.querySelectorAll('#metric-choice option')].map(o => o.textContent)")
        assert hostile in options
        heads = seen.evaluate("() => [...document.querySelectorAll('#steps-table th')].map(t => t.textContent)")
        assert hostile in heads and seen.evaluate("() => document.querySelectorAll('img').length") == 0


@pytest.mark.slow
def test_a_report_of_an_s3_store(s3_location: str, tmp_path: Path) -> None:
    from testbed.history_store import saves

    assert tailor("init", s3_location).returncode == 0
    for _step, path, loss in saves(tmp_path / "saves", 2):
        done = tailor("commit", str(path), "--metric", f"eval_loss={loss}", store=s3_location)  # type: ignore[arg-type]
        assert done.returncode == 0, done.stderr
    page = tmp_path / "s3.html"
    done = tailor("report", "--out", str(page), store=s3_location)  # type: ignore[arg-type]
    assert done.returncode == 0, done.stderr
    data = page_data(page)
    log = json.loads(tailor("log", "--json", store=s3_location).stdout)  # type: ignore[arg-type]
    assert data["store"]["location"] == s3_location
    assert [r[0] for r in data["steps"]["rows"]] == [s["id"] for s in log] and len(log) == 2
    assert len(data["layers"][0]["rows"]) == 1
