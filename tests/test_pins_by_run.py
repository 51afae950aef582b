"""Pins name their run (I2). A pin object was named by its manifest key's last segment alone
(``refs/pins/step-...-v1.json.zst``), so run ``main``'s step 8 and a branch's step 8 shared it:
committing step 8 in a branch (after a rewind, the ordinary case) deleted main's pin, and the next
gc dropped main's pinned step; unpinning or removing one step unpinned the other."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import tailor

from tailorstore import Store


@pytest.fixture
def store_with_a_branch(tmp_path: Path) -> Path:
    """Main holds steps 4, 8 and 12, step 8 pinned; run ``b`` branched at step 4 holds its own step 8."""
    location = tmp_path / "store"
    save = tmp_path / "save"
    save.mkdir()
    with Store.init(location) as store:
        for step in (4, 8, 12):
            torch.save({"w": torch.full((8,), float(step))}, save / "ckpt.pt")
            store.commit(save, step=step)
        store.pin("step=8")
        store.create_run("b", base="step=4")
    torch.save({"w": torch.full((8,), -8.0)}, save / "ckpt.pt")
    with Store.open(location, run="b") as branch:
        branch.commit(save, step=8)
    return location


def steps(location: Path, run: str) -> dict[int, dict]:
    done = tailor("log", "--json", "--run", run, store=location)
    assert done.returncode == 0, done.stderr
    return {s["step"]: s for s in json.loads(done.stdout) if s["run"] == run}


def test_a_branch_committing_a_step_main_pinned_leaves_the_pin(store_with_a_branch: Path) -> None:
    location = store_with_a_branch
    assert tailor("index", "rebuild", store=location).returncode == 0  # a host that reads the objects alone
    assert steps(location, "main")[8]["pinned"] and not steps(location, "b")[8]["pinned"]
    assert tailor("gc", "--keep-last", "1", "--run", "main", store=location).returncode == 0
    assert sorted(steps(location, "main")) == [8, 12], "main's pinned step 8 stays"


def test_unpinning_or_removing_one_runs_step_leaves_the_others_pin(store_with_a_branch: Path) -> None:
    location = store_with_a_branch
    assert tailor("pin", "b:step=8", store=location).returncode == 0
    assert tailor("unpin", "step=8", store=location).returncode == 0  # main's
    assert tailor("index", "rebuild", store=location).returncode == 0
    assert steps(location, "b")[8]["pinned"] and not steps(location, "main")[8]["pinned"]
    assert tailor("pin", "step=8", store=location).returncode == 0
    assert tailor("rm", "b:step=8", "--force", store=location).returncode == 0
    assert tailor("index", "rebuild", store=location).returncode == 0
    assert steps(location, "main")[8]["pinned"]
