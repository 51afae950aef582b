"""``dcp.save`` through :class:`TailorStorageWriter`, from real FSDP2 runs (a tiny Llama,
each block ``fully_shard``ed, AdamW, 2 ranks on gloo; testbed/train_fsdp.py): every rank's items go
straight into the store, no DCP folder is written, and the step is the one a commit of the raw
folder records. Sync, and async with DCP's thread and process checkpointers; resumed through the
reader at 2 ranks and at 1; checked out as the folder ``FileSystemWriter`` writes; under the parity
policy; a rank killed in the middle of a save records no step."""

from __future__ import annotations

from pathlib import Path

import pytest

from tailorstore import Store
from tailorstore.integrations.common import StoreSession
from testbed.runs import TrainingFailed
from tests.conftest import manifest_rows, parts_of_any_age
from tests.system.test_dcp import EVERY, full_model_state, train

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def raw_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[float]]:
    """DCP's own path: ``dcp.save`` to folders (step-3/, step-6/)."""
    out = tmp_path_factory.mktemp("raw")
    return out, train(out)["losses"]


def saved_files(out: Path) -> list[Path]:
    return [p for p in out.rglob("*") if p.name not in ("losses.json", "log.txt")]


@pytest.mark.parametrize("mode", [(), ("--async-save", "thread"), ("--async-save", "process")], ids=str)
def test_a_save_through_the_writer_is_the_raw_save_committed(raw_run, tmp_path: Path, mode) -> None:
    """Same losses; no file written; each step checks out as the very .distcp files dcp.save wrote,
    with a .metadata that DCP's own FileSystemReader loads at another world size."""
    import torch

    raw, losses = raw_run
    Store.init(tmp_path / "store").close()
    run = train(tmp_path / "run", "--save-to-store", str(tmp_path / "store"), *mode)
    assert run["losses"] == losses
    assert saved_files(tmp_path / "run") == []  # nothing but the store holds the saves
    with Store.open(tmp_path / "store") as store:
        assert [(s.step, s.world_size, s.exact) for s in store.log()] == [(3, 2, True), (6, 2, True)]
        for step in (3, 6):
            out = tmp_path / f"out{step}"
            store.checkout(f"step={step}", out)
            for name in ("__0_0.distcp", "__1_0.distcp"):
                assert (out / name).read_bytes() == (raw / f"step-{step}" / name).read_bytes(), (step, name)
            assert sorted(p.name for p in out.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
            assert {p.stat().st_mode & 0o777 for p in out.iterdir()} == {0o644}
            ours, theirs = full_model_state(out), full_model_state(raw / f"step-{step}")  # one rank: resharded
            assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
        assert store.verify(deep=True).ok
        session = StoreSession(store)
        assert session.parts(3) == [] and session.parts(6) == []  # finalized, and the parts deleted


def test_a_writer_saved_step_resumes_through_the_reader_at_two_ranks_and_at_one(raw_run, tmp_path: Path) -> None:
    raw, losses = raw_run
    Store.init(tmp_path / "store").close()
    train(tmp_path / "run", "--save-to-store", str(tmp_path / "store"), "--steps", "3")
    from_store = ("--resume-from-store", str(tmp_path / "store"), "step=3")
    at_two = train(tmp_path / "two", *from_store)
    assert at_two["first"] == EVERY + 1 and at_two["losses"] == losses[EVERY:]
    at_one = train(tmp_path / "one", *from_store, nproc=1)
    raw_at_one = train(tmp_path / "raw-one", "--resume-from", str(raw / "step-3"), nproc=1)
    assert at_one["first"] == EVERY + 1 and at_one["losses"] == raw_at_one["losses"]


def test_the_parity_policy_through_the_writer_records_what_a_commit_records(raw_run, tmp_path: Path) -> None:
    """Layer for layer, atom for atom, the manifests of a parity series saved through the writer
    are those of the raw folders committed under parity; only .metadata differs (its save id)."""
    raw, _ = raw_run
    with Store.init(tmp_path / "single") as single:
        for step in (3, 6):
            single.commit(raw / f"step-{step}", policy="parity")
        expected = {step: manifest_rows(single, step) for step in (3, 6)}
        single.checkout("step=6", tmp_path / "composite")  # inherited blocks hold step 3's values
    Store.init(tmp_path / "store").close()
    train(tmp_path / "run", "--save-to-store", str(tmp_path / "store"), "--store-policy", "parity")
    with Store.open(tmp_path / "store") as store:
        for step in (3, 6):
            got = manifest_rows(store, step)
            assert (got["atoms"], got["layers"], got["policy"], got["exact"]) == (
                expected[step]["atoms"],
                expected[step]["layers"],
                expected[step]["policy"],
                expected[step]["exact"],
            ), step
            assert _without_metadata(got["files"]) == _without_metadata(expected[step]["files"])
        assert any(not x.stored for x in store.show("step=6").layers)  # step 6 inherits half its blocks
        store.checkout("step=6", tmp_path / "out")
    for name in ("__0_0.distcp", "__1_0.distcp"):
        assert (tmp_path / "out" / name).read_bytes() == (tmp_path / "composite" / name).read_bytes()


def _without_metadata(files: list[tuple]) -> list[tuple]:
    return [f for f in files if not str(f[0]).endswith(".metadata")]


def test_a_rank_killed_in_an_async_save_records_no_step(raw_run, tmp_path: Path) -> None:
    """Rank 1 is killed in its second async save, just before it publishes its part: the job
    fails, step 3 stays as it was, step 6 is not recorded, and gc collects what the save left."""
    Store.init(tmp_path / "store").close()
    with pytest.raises(TrainingFailed, match="rank 1 exited with code -9"):  # SIGKILL, at the failpoint
        train(
            tmp_path / "run",
            "--save-to-store",
            str(tmp_path / "store"),
            "--async-save",
            "thread",
            "--rank-failpoints",
            "1",
            "before-part-publish=kill@2",
        )
    with Store.open(tmp_path / "store") as store:
        assert [s.step for s in store.log()] == [3]
        assert store.verify(deep=True).ok
        with parts_of_any_age():
            store.gc(drop_parts=True)
        assert StoreSession(store).parts(6) == []
        store.checkout("step=3", tmp_path / "out")
    raw, _ = raw_run
    assert (tmp_path / "out" / "__1_0.distcp").read_bytes() == (raw / "step-3" / "__1_0.distcp").read_bytes()


def test_a_coordinator_killed_at_the_commit_point_records_nothing_and_the_restart_saves_whole(
    raw_run, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The coordinator is killed at the step's commit point (its finalize's publish) in the second
    save; the job restarts from step 3 straight from the store and saves step 6 again. Step 6 is
    the new save's alone (the dead save's parts, of another label, are never taken)."""
    raw, _ = raw_run
    Store.init(tmp_path / "store").close()
    monkeypatch.setenv("TAILOR_FAILPOINTS", "before-publish=kill@2")  # only the coordinator publishes a step
    with pytest.raises(TrainingFailed, match="rank 0 exited with code -9"):
        train(tmp_path / "first", "--save-to-store", str(tmp_path / "store"))
    monkeypatch.delenv("TAILOR_FAILPOINTS")
    with Store.open(tmp_path / "store") as store:
        parts = StoreSession(store).parts(6)
        assert [s.step for s in store.log()] == [3] and len(parts) == 3  # two ranks' and .metadata
    from_store = ("--resume-from-store", str(tmp_path / "store"), "step=3")
    train(tmp_path / "again", "--save-to-store", str(tmp_path / "store"), *from_store)
    with Store.open(tmp_path / "store") as store:
        assert [s.step for s in store.log()] == [3, 6] and len(StoreSession(store).parts(6)) == 3  # the dead save's
        store.checkout("step=6", tmp_path / "out")
        with parts_of_any_age():
            store.gc(drop_parts=True)
        assert StoreSession(store).parts(6) == [] and store.verify(deep=True).ok
    for name in ("__0_0.distcp", "__1_0.distcp"):
        assert (tmp_path / "out" / name).read_bytes() == (raw / "step-6" / name).read_bytes()
