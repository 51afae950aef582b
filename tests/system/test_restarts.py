"""DeepSpeed jobs with ``attach`` killed at the moments that matter, then restarted at the same
world size (real 2-rank gloo trainings): every rank takes the same way to resume, a save cut
short is never loaded, a rewind's recovery keeps its rule, and a first launch starts fresh."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tailorstore import Store
from tailorstore.integrations.deepspeed import staging as staged
from testbed.compare import same_tree
from testbed.runs import TrainingFailed, train_tiny
from tests.conftest import Runs

# a rank stuck in a collective fails after this long, not after the default half hour
TIMEOUT = "120"


def setup(runs: Runs, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, **extra: object) -> tuple:
    """The reference run, the save folder, the options that save through an empty store with
    ``attach``, and the staging folder (under ``tmp_path``)."""
    reference = runs.get(name)
    staging = tmp_path / "staging"
    monkeypatch.setenv("TAILOR_STAGING", str(staging))
    monkeypatch.setenv("TAILOR_COLLECTIVE_TIMEOUT", TIMEOUT)
    Store.init(tmp_path / "store").close()
    options = {"commit_to": tmp_path / "store", "tailor_engine": True, **reference.options, **extra}
    return reference, tmp_path / "save", options, staging


def killed(monkeypatch: pytest.MonkeyPatch, failpoints: str, save: Path, out: Path, **options: object) -> None:
    """A training that ``TAILOR_FAILPOINTS`` kills (rank 0 first; the launcher then ends the rest)."""
    monkeypatch.setenv("TAILOR_FAILPOINTS", failpoints)
    with pytest.raises(TrainingFailed, match="exited with code"):
        train_tiny(save, losses_out=out, **options)
    monkeypatch.delenv("TAILOR_FAILPOINTS")


def staged_saves(staging: Path) -> list[Path]:
    return sorted(staging.glob(f"{staged.PREFIX}*/save-*/global_step*"))


@pytest.mark.parametrize("name", ["zero2-bf16", "zero3-bf16"])
def test_a_job_killed_while_its_save_commits_restarts_with_every_rank_alike(
    runs: Runs, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    """Regression: killed while its first save was committing (its staged save whole,
    ``latest`` naming it), the job restarted and deadlocked: rank 0 committed the recovered save
    and deleted it while rank 1 saw the folder and loaded it from disk, in DeepSpeed's
    collectives. Now rank 0 finishes the recovery before any rank decides, and decides for all."""
    reference, save, options, staging = setup(runs, tmp_path, monkeypatch, name)
    killed(monkeypatch, "before-publish=kill@1", save, tmp_path / "first.json", steps=3, save_every=3, **options)
    assert (save / "latest").read_text() == "global_step3"
    [left] = staged_saves(staging)
    kept = shutil.copytree(left, tmp_path / "as-staged")  # the only copy of the save
    resumed = train_tiny(save, losses_out=tmp_path / "again.json", resume_from=save, steps=6, save_every=3, **options)
    assert resumed == {s: reference.losses[s] for s in (4, 5, 6)}, "resumed from the recovered step 3"
    log = (tmp_path / "again.log").read_text()
    assert log.count("committed step 3 of run 'main' from the save a run that is gone left in staging") == 1, log
    with Store.open(tmp_path / "store") as store:
        assert [s.step for s in store.log()] == [3, 6]
        store.checkout("step=3", tmp_path / "out")
    assert same_tree(tmp_path / "out" / "global_step3", kept)
    assert not list(save.glob("global_step*")), "the recovered save went once committed; nothing else is left"


@pytest.mark.parametrize("name", ["zero2-bf16", "zero3-bf16"])
def test_a_job_killed_while_its_save_is_written_resumes_from_its_last_committed_step(
    runs: Runs, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    """Regression: killed while the files of its step-6 save were still being written
    (the first file of rank 0's share, rank 1 ended by the launcher), the job restarted on a
    partial save that the recovery had put where DeepSpeed loads, and ``latest`` named it:
    DeepSpeed died on a bare assertion (ZeRO-3) or the load on a truncated file (ZeRO-2). Now the
    partial save is kept under a name DeepSpeed never loads, and the resume takes the head's
    step 3, in one line."""
    reference, save, options, staging = setup(runs, tmp_path, monkeypatch, name)
    killed(monkeypatch, "snapshot-file-written=kill@3", save, tmp_path / "first.json", steps=6, save_every=3, **options)
    # the step-6 save is cut short; step 3's commit may still have been running (then its staged
    # copy is left too, and the recovery finds it committed or commits it)
    assert "global_step6" in [p.name for p in staged_saves(staging)]
    # DeepSpeed writes ``latest`` as save_checkpoint returns, while the files are still written
    # in the background; where the kill came first, this is what it would have written
    (save / "latest").write_text("global_step6")
    resumed = train_tiny(save, losses_out=tmp_path / "again.json", resume_from=save, steps=6, save_every=3, **options)
    assert resumed == {s: reference.losses[s] for s in (4, 5, 6)}
    log = (tmp_path / "again.log").read_text()
    said = "names step 6, which run 'main' of the store lacks (the job stopped before it was committed); resuming "
    assert log.count(said + "from step 3, the last step this training committed") == 1, log
    assert "it is kept in" in log and "a name DeepSpeed never loads" in log, log
    assert sorted(p.name for p in save.glob("global_step*")) == [f"global_step6{staged.UNCOMMITTED}"], "kept"
    with Store.open(tmp_path / "store") as store:
        assert [s.step for s in store.log()] == [3, 6]
        assert store.verify(deep=True).ok


def test_a_first_launch_on_an_empty_store_starts_fresh(
    runs: Runs, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression: the README's loop calls ``engine.load_checkpoint(save_dir)`` on
    every launch; on the first, the store is empty and every rank raised "holds no steps yet".
    Now it returns (None, None) as DeepSpeed does, decided once, in one line (rank 0's)."""
    reference, save, options, _ = setup(runs, tmp_path, monkeypatch, "zero2-bf16")
    losses = train_tiny(
        save, losses_out=tmp_path / "first.json", resume_from=save, fresh_if_none=True, steps=3, save_every=3,
        **options,
    )  # fmt: skip
    assert losses == {s: reference.losses[s] for s in (1, 2, 3)}
    log = (tmp_path / "first.log").read_text()
    assert log.count("holds no step to resume from; training starts fresh") == 1, log
    with Store.open(tmp_path / "store") as store:
        assert [s.step for s in store.log()] == [3]
    # a step asked for by name that the store lacks is no fresh start: every rank raises rank 0's error, whole
    with pytest.raises(TrainingFailed):
        train_tiny(save, losses_out=tmp_path / "asked.json", resume_from=save, resume_tag="global_step9", steps=9,
                   save_every=0, **options)  # fmt: skip
    log = (tmp_path / "asked.log").read_text()
    raised = f"RanksFailedError: resuming from {save} failed on rank 0: step 9 is not in the store"
    assert log.count(raised) == 2, log


def test_a_replacing_rewind_killed_while_it_records_a_step_is_recovered_under_its_rule(
    runs: Runs, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression: with on_existing='replace', training went back to step 3 (on other
    data, so the new timeline differs) and was killed while it recorded step 6 again. The
    recovery committed without the rule, took the store's refusal for "committed before", and
    kept the abandoned timeline's step 6 among the new ones. Now it replaces it, as the dead
    run's own commit would have, and the store's step 6 is the save the job resumed from."""
    _, save, options, staging = setup(runs, tmp_path, monkeypatch, "zero2-bf16", on_existing="replace")
    train_tiny(save, losses_out=tmp_path / "first.json", steps=6, save_every=3, **options)
    with Store.open(tmp_path / "store") as store:
        old = {s.step: s.manifest for s in store.log()}
    killed(
        monkeypatch, "before-publish=kill@1", save, tmp_path / "rewind.json", resume_from=save,
        resume_tag="global_step3", steps=6, save_every=3, data="chain", **options,
    )  # fmt: skip
    [left] = staged_saves(staging)
    kept = shutil.copytree(left, tmp_path / "as-staged")  # the new timeline's step 6, its only copy
    train_tiny(save, losses_out=tmp_path / "again.json", resume_from=save, steps=7, save_every=0, data="chain",
               **options)  # fmt: skip
    log = (tmp_path / "again.log").read_text()
    assert "was committed before" not in log, log
    assert "step 6 is already in run 'main'; replacing it (on_existing='replace')" in log, log
    with Store.open(tmp_path / "store") as store:
        now = {s.step: s.manifest for s in store.log()}
        assert sorted(now) == [3, 6] and now[3] == old[3] and now[6] != old[6]
        store.checkout("step=6", tmp_path / "out")
    assert same_tree(tmp_path / "out" / "global_step6", kept), "the store's step 6 is the rewound timeline's"


def test_a_save_its_dead_run_committed_is_told_apart_from_another_timelines_step(
    runs: Runs, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The other half of high 6: the dead run's own commit of its staged save got through, and it
    died before deleting it. The store's step records that very staged folder as its source, so
    the recovery only deletes the copy: nothing is replaced or committed again, under any rule."""
    reference, save, options, staging = setup(runs, tmp_path, monkeypatch, "zero2-bf16", on_existing="replace")
    dead = staging / f"{staged.PREFIX}999999-dead" / "save-000001"
    shutil.copytree(reference.save_dir / "global_step3", dead / "global_step3")
    (dead / staged.TARGET).write_text(str(save / "global_step3"))
    save.mkdir()
    (save / "latest").write_text("global_step3")
    with Store.open(tmp_path / "store") as store:
        first = store.commit(dead / "global_step3", step=3)  # what the dead run committed before it died
    resumed = train_tiny(save, losses_out=tmp_path / "again.json", resume_from=save, steps=6, save_every=0, **options)
    assert resumed == {s: reference.losses[s] for s in (4, 5, 6)}
    log = (tmp_path / "again.log").read_text()
    assert "(that run committed this very save before it died); its copy was deleted" in log, log
    assert "replacing it" not in log and "was committed before" not in log, log
    assert not list(save.glob("global_step3*")), "the copy is gone"
    with Store.open(tmp_path / "store") as store:
        assert [s.manifest for s in store.log()] == [first.manifest]
