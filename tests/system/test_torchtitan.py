"""torchtitan's checkpoint manager over the store: ``TailorCheckpointManager`` saves
every step straight into the store (sync and async), resumes from it bit for bit, writes nothing
into torchtitan's checkpoint folder, and keeps ``keep_latest_k`` steps by the store's gc.

Real parts: torchtitan 0.3.0's own ``CheckpointManager`` (installed without the dependencies its
trainer needs), a real FSDP2 training on 2 CPU ranks, a real store."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tailorstore import Store
from testbed.runs import torchrun

pytestmark = pytest.mark.slow  # torchtitan itself is installed by the README's install (make install)


def train(store: Path, folder: Path, losses: Path, *extra: str) -> dict:
    args = ["--store", str(store), "--folder", str(folder), "--losses-out", str(losses), *extra]
    torchrun("testbed.train_titan", args, nproc=2, log=losses.with_suffix(".log"))
    return json.loads(losses.read_text())


def steps(store: Path) -> list[int]:
    with Store.open(store) as opened:
        return [s.step for s in opened.log()]


def test_a_restarted_training_resumes_from_the_store_bit_for_bit(tmp_path: Path) -> None:
    """Async saves every 2 steps; a job stopped after step 4 and started again goes on from the
    store's step 4, with the losses of steps 5 and 6 equal to an uninterrupted run's."""
    for name in ("whole", "stopped"):
        Store.init(tmp_path / name).close()
    every = ("--interval", "2", "--async-mode", "async")
    whole = train(tmp_path / "whole", tmp_path / "ckpt-whole", tmp_path / "whole.json", "--steps", "6", *every)
    assert whole["first"] == 1 and len(whole["losses"]) == 6
    assert steps(tmp_path / "whole") == [2, 4, 6]
    train(tmp_path / "stopped", tmp_path / "ckpt", tmp_path / "first.json", "--steps", "4", *every)
    resumed = train(tmp_path / "stopped", tmp_path / "ckpt", tmp_path / "again.json", "--steps", "6", *every)
    assert resumed["first"] == 5, "resumed from the store's step 4"
    assert resumed["losses"] == whole["losses"][4:]  # bit for bit: the floats as JSON wrote them
    assert not (tmp_path / "ckpt").exists() and not (tmp_path / "ckpt-whole").exists(), "no raw file anywhere"
    with Store.open(tmp_path / "stopped") as store:
        assert store.verify(deep=True).ok


def test_keep_latest_k_is_the_stores_gc(tmp_path: Path) -> None:
    """A save every step with ``keep_latest_k=2``: after each, rank 0's gc thread keeps the last
    two recorded steps; torchtitan's last save is never purged after, so 4 may stay beside 5 and
    6, as the gc after step 5 ran before or after step 6 was recorded."""
    Store.init(tmp_path / "store").close()
    args = ("--steps", "6", "--interval", "1", "--keep-latest-k", "2")
    train(tmp_path / "store", tmp_path / "ckpt", tmp_path / "losses.json", *args)
    held = set(steps(tmp_path / "store"))
    assert {5, 6} <= held <= {4, 5, 6}, held
    with Store.open(tmp_path / "store") as store:
        assert store.verify(deep=True).ok
