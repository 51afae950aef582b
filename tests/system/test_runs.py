"""Runs in one store: steps numbered per run, blobs shared, branches from a step, another
model refused with a hint, and gc counting each run on its own (real DeepSpeed saves)."""

from __future__ import annotations

import json
from pathlib import Path

from tailorstore import Store
from tailorstore.core.errors import StoreError, UnknownStepError
from tailorstore.store.repo import Repository
from testbed.compare import same_tree
from tests.conftest import Runs, as_of_step, tailor


def ok(store: Path, *args: str) -> str:
    proc = tailor(*args, store=store)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_runs_number_steps_apart_share_blobs_and_branch(runs: Runs, tmp_path: Path) -> None:
    save = runs.get("tailor-zero2").save_dir
    at = {s: as_of_step(save, s, tmp_path / f"at{s}") for s in (3, 6, 9, 12)}
    odd = as_of_step(runs.get("zero2-bf16-odd-two-groups").save_dir, 6, tmp_path / "odd")
    root = tmp_path / "store"
    with Store.init(root) as store:
        for s in (3, 6, 9):
            store.commit(at[s])

    # another model: refused, and the message says how to keep it
    refused = tailor("commit", str(odd), store=root)
    assert refused.returncode == 2 and "--run NAME" in refused.stderr, refused.stderr
    ok(root, "commit", str(odd), "--run", "other")  # step 6 again, in its own numbering
    steps = {(s["run"], s["step"]) for s in json.loads(ok(root, "log", "--json"))}
    assert steps == {("main", 3), ("main", 6), ("main", 9), ("other", 6)}
    assert [s["step"] for s in json.loads(ok(root, "log", "--run", "other", "--json"))] == [6]
    ok(root, "checkout", "step=6", "--run", "other", "--out", str(tmp_path / "odd-out"))
    assert same_tree(tmp_path / "odd-out" / "global_step6", odd / "global_step6")

    # the same bytes in another run: every blob is shared, nothing new is stored
    copied = json.loads(ok(root, "commit", str(at[9]), "--run", "copy", "--json"))
    assert copied["new_blobs"] == 0 and copied["new_bytes"] == 0

    # a branch: its first commit inherits from the base step, under its own step numbers
    assert "created run ft from run main step 9" in ok(root, "run", "create", "ft", "--from", "main:step=9")
    again = tailor("run", "create", "ft", "--from", "step=3", store=root)
    assert again.returncode == 2 and "already exists" in again.stderr
    ft = json.loads(
        ok(root, "commit", str(at[12]), "--run", "ft", "--step", "1", "--policy", "filter", "--keep-first", "1",
           "--keep-last", "1", "--every", "2", "--json")
    )  # fmt: skip
    assert ft["inherited_layers"] and set(ft["inherited_layers"].values()) == {9}, ft["inherited_layers"]
    full = json.loads(ok(root, "show", "main:step=9", "--json"))
    shown = json.loads(ok(root, "show", "step=1", "--run", "ft", "--json"))
    assert shown["summary"]["run"] == "ft" and not shown["summary"]["exact"]
    sources = {x["layer"]: x["source_step"] for x in shown["layers"]}
    assert all(sources[layer] == 9 for layer in ft["inherited_layers"])
    assert ft["new_bytes"] < 0.8 * sum(x["stored_bytes"] for x in full["layers"]), "inherited layers cost nothing"
    listed = {r["name"]: r for r in json.loads(ok(root, "run", "list", "--json"))}
    assert listed["ft"]["base"] == {"run": "main", "step": 9} and listed["ft"]["steps"] == 1
    assert listed["main"]["steps"] == 3 and listed["other"]["latest_step"] == 6
    assert "branched from run main step 9" in ok(root, "log", "--run", "ft")

    # the branch's composite checks out: inherited layers hold step 9's bytes, the rest step 12's
    ok(root, "checkout", "ft:latest", "--out", str(tmp_path / "ft-out"))

    # the base is protected; gc counts each run on its own
    refused = tailor("rm", "main:step=9", store=root)
    assert refused.returncode == 2 and "base of run(s) ft" in refused.stderr, refused.stderr
    plan = json.loads(ok(root, "gc", "--keep-last", "1", "--run", "main", "--dry-run", "--json"))
    assert sorted(step for _, step in plan["drop"]) == [3, 6], "main keeps 9 (newest, and ft's base)"
    ok(root, "gc", "--keep-last", "1")
    steps = {(s["run"], s["step"]) for s in json.loads(ok(root, "log", "--json"))}
    assert steps == {("main", 9), ("other", 6), ("copy", 9), ("ft", 1)}
    with Store.open(root) as store:
        store.checkout("ft:step=1", tmp_path / "ft-again")
        assert store.verify(deep=True).ok
    assert same_tree(tmp_path / "ft-again", tmp_path / "ft-out")

    # runs live in the backend: a rebuilt index knows them, bases included
    for f in root.glob("index.sqlite*"):
        f.unlink()
    ok(root, "index", "rebuild")
    assert {r["name"]: r["base"] for r in json.loads(ok(root, "run", "list", "--json"))} == {
        "main": None, "copy": None, "ft": {"run": "main", "step": 9}, "other": None
    }  # fmt: skip
    with Store.open(root, run="ft") as store:
        assert [s.step for s in store.log(run="ft")] == [1]
        assert {s.run for s in store.log()} == {"main", "copy", "ft", "other"}, "every run unless one is named"
        assert store.show("latest").summary.step == 1
    with Repository.open(root) as repo:
        try:
            repo.resolve("nope:step=1")
        except UnknownStepError as exc:
            assert "no run 'nope'" in str(exc)
        else:
            raise AssertionError("an unknown run resolved")


def test_a_branch_inherits_before_its_first_commit_and_refuses_another_model(runs: Runs, tmp_path: Path) -> None:
    save = runs.get("tailor-zero2").save_dir
    odd = as_of_step(runs.get("zero2-bf16-odd-two-groups").save_dir, 6, tmp_path / "odd")
    with Store.init(tmp_path / "store") as store:
        store.commit(as_of_step(save, 6, tmp_path / "at6"), tag="pre")
        branch = store.create_run("ft", base="tag=pre")
        assert branch.base is not None and branch.base.step == 6
    with Store.open(tmp_path / "store", run="ft") as ft:
        assert ft.show("latest").summary.step == 6, "an empty branch reads as its base"
        try:
            ft.commit(odd)
        except StoreError as exc:
            assert "step 6 of run 'main'" in str(exc) and "`run=NAME`" in str(exc)
        else:
            raise AssertionError("a branch took another model than its base")
