"""Pins name their run (I2). A pin object was named by its manifest key's last segment alone
(``refs/pins/step-...-v1.json.zst``), so run ``main``'s step 8 and a branch's step 8 shared it:
committing step 8 in a branch (after a rewind, the ordinary case) deleted main's pin, and the next
gc dropped main's pinned step; unpinning or removing one step unpinned the other."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tailorstore import Store
from tests.conftest import tailor


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
    assert sorted(steps(location, "main")) == [4, 8, 12], "main's pinned step 8 stays (4: the branch's base)"


@pytest.mark.slow  # seconds: the fast tier keeps its minute
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


def test_a_branch_pin_written_before_pins_named_their_run_still_counts(tmp_path: Path) -> None:
    """An older writer pinned a branch's step 6 under the plain key; main has no step 6, so that pin
    is the branch's. When main then commits its own step 6, the branch's step keeps its pin."""
    from tailorstore.store.backends.location import resolve

    location = tmp_path / "store"
    save = tmp_path / "save"
    save.mkdir()
    torch.save({"w": torch.ones(8)}, save / "ckpt.pt")
    with Store.init(location) as store:
        store.commit(save, step=4)
        store.create_run("b", base="step=4")
    with Store.open(location, run="b") as branch:
        branch.commit(save, step=6)
    backend = resolve(str(location)).backend
    backend.put("refs/pins/step-00000000000000000006-v1.json.zst", b"")  # as an older writer pinned b:6
    assert tailor("index", "rebuild", store=location).returncode == 0
    assert steps(location, "b")[6]["pinned"]
    with Store.open(location) as store:
        store.commit(save, step=6)  # main's own step 6: the plain key is main's from now on
    assert tailor("index", "rebuild", store=location).returncode == 0
    assert steps(location, "b")[6]["pinned"] and not steps(location, "main")[6]["pinned"]
    assert tailor("unpin", "b:step=6", store=location).returncode == 0
    assert tailor("index", "rebuild", store=location).returncode == 0
    assert not steps(location, "b")[6]["pinned"]
