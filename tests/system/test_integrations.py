"""The training-loop integrations with real 2-rank trainings: DeepSpeed's save helper and the
HF Trainer callback commit every save in the background and delete the originals; resuming
from the store is bit-exact."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo
from safetensors.torch import load_file

from tailorstore import BackgroundCommitError, Store
from tailorstore.formats.safe_load import load_torch_file
from tailorstore.integrations.deepspeed import TailorCheckpointEngine, start_engine
from tailorstore.integrations.deepspeed import staging as staged
from tailorstore.integrations.deepspeed.head import HEAD_FILE, read_head
from testbed.compare import differences, same_tree
from testbed.runs import TrainingFailed, train_hf, train_tiny
from tests.conftest import HFRun, Run, Runs, manifest_rows
from tests.system.test_hostile import mounted


def attached_run(
    runs: Runs, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, **extra: object
) -> tuple[Run, Path, dict[str, object]]:
    """The zero2-bf16 reference run, an empty store and staging under ``tmp_path``, the save folder,
    and train_tiny's options to save through the store (``extra``: more of them)."""
    reference = runs.get("zero2-bf16")
    monkeypatch.setenv("TAILOR_STAGING", str(tmp_path / "staging"))
    Store.init(tmp_path / "store").close()
    return reference, tmp_path / "save", {"commit_to": tmp_path / "store", **extra, **reference.options}


def test_deepspeed_save_helper_commits_in_the_background_and_resume_is_bit_exact(runs: Runs, tmp_path: Path) -> None:
    reference = runs.get("zero2-bf16")
    Store.init(tmp_path / "store").close()
    save = tmp_path / "save"
    losses = train_tiny(
        save,
        losses_out=tmp_path / "losses.json",
        steps=6,
        save_every=3,
        commit_to=tmp_path / "store",
        delete_after_commit=True,
        **reference.options,
    )
    assert losses == reference.losses, "committing in the background must not change training"
    assert not list(save.glob("global_step*")), "every save was deleted once committed"
    with Store.open(tmp_path / "store") as store:
        assert [s.step for s in store.log()] == [3, 6]
        assert store.verify(deep=True).ok
        store.checkout(3, tmp_path / "restored")
    resumed = train_tiny(
        tmp_path / "resume-save",
        losses_out=tmp_path / "resumed.json",
        resume_from=tmp_path / "restored",
        steps=6,
        save_every=0,
        **reference.options,
    )
    assert {s: resumed[s] for s in (4, 5, 6)} == {s: reference.losses[s] for s in (4, 5, 6)}


def test_tailor_checkpoint_engine_saves_into_the_store_and_resumes_from_it_bit_exact(
    runs: Runs, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """engine.save_checkpoint goes through TailorCheckpointEngine into the store, nothing raw on disk;
    engine.load_checkpoint resumes from the store; the step checks out as DeepSpeed's own bytes."""
    reference = runs.get("zero2-bf16")
    staging = tmp_path / "staging"  # memory-backed by default (/dev/shm); here a folder we can inspect
    staging.mkdir()
    monkeypatch.setenv("TAILOR_STAGING", str(staging))
    Store.init(tmp_path / "store").close()
    save = tmp_path / "save"
    options = {"commit_to": tmp_path / "store", "tailor_engine": True, **reference.options}
    losses = train_tiny(
        save, losses_out=tmp_path / "losses.json", steps=6, save_every=3, record_loss_metric=True, **options
    )
    assert losses == reference.losses, "saving through the engine must not change training"
    assert sorted(p.name for p in save.iterdir()) == ["latest", HEAD_FILE, "zero_to_fp32.py", "zero_to_torch.py"], (
        "only DeepSpeed's pointer and scripts, and the job's head beside them, land in save_dir; the checkpoint "
        "went to the store"
    )
    head = read_head(save)
    assert head is not None and (head.run, head.step) == ("main", 6), head
    assert not list(staging.rglob("*")), "the staged saves were deleted once committed"
    with Store.open(tmp_path / "store") as store:
        assert [s.step for s in store.log()] == [3, 6]
        # attach(metrics=...) recorded each saved step's own loss with it
        assert {s.step: s.metrics for s in store.log()} == {
            step: {"train_loss": float.fromhex(losses[step])} for step in (3, 6)
        }
        assert store.verify(deep=True).ok
        store.checkout(6, tmp_path / "out")
    assert same_tree(tmp_path / "out" / "global_step6", reference.save_dir / "global_step6"), (
        "the store holds exactly the files DeepSpeed writes raw"
    )
    resumed = train_tiny(
        save,
        losses_out=tmp_path / "resumed.json",
        resume_from=save,
        resume_tag="global_step3",
        steps=6,
        save_every=0,
        **options,
    )
    assert resumed == {s: reference.losses[s] for s in (4, 5, 6)}
    assert sorted(p.name for p in save.iterdir()) == ["latest", HEAD_FILE, "zero_to_fp32.py", "zero_to_torch.py"]
    assert not list(staging.rglob("*")), "the checkout made for resuming was deleted"


def test_tailor_checkpoint_engine_writes_a_save_whose_commit_failed_where_deepspeed_would(
    runs: Runs, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine's calls as DeepSpeed makes them, on one rank: the second save of step 3 is refused by
    the store; the error surfaces at flush and the staged files land in save_dir, nothing lost."""
    reference = runs.get("zero2-bf16").save_dir / "global_step3"
    staging = tmp_path / "staging"
    staging.mkdir()
    monkeypatch.setenv("TAILOR_STAGING", str(staging))
    real = tmp_path / "save" / "global_step3"
    states = {f.name: load_torch_file(f, mmap=False)[0] for f in sorted(reference.iterdir())}

    def save(engine: TailorCheckpointEngine) -> None:
        info = CheckpointCommitInfo(tag="global_step3", save_dir=str(tmp_path / "save"), save_latest=True)
        engine.create(info)
        engine.makedirs(str(real), exist_ok=True)
        for name, state in states.items():
            engine.save(state, str(real / name))
        engine.commit(info)

    with Store.init(tmp_path / "store") as store:
        engine = start_engine(store, on_existing="error")  # so the store refuses the second save
        save(engine)
        engine.flush()
        assert not real.exists(), "a committed save never lands in save_dir"
        save(engine)
        with pytest.raises(BackgroundCommitError, match="step 3"):
            engine.flush()
        assert sorted(p.name for p in real.iterdir()) == sorted(states), "the refused save was written raw"
        assert all(load_torch_file(real / name, mmap=False)[0].keys() == states[name].keys() for name in states)
        assert not list(staging.rglob("*.pt")), "nothing stays behind in memory"
        assert [s.step for s in store.log()] == [3]
        assert store.verify(deep=True).ok


STAGE_AND_WAIT = """
import sys, time
from pathlib import Path
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo
from tailorstore import Store
from tailorstore.integrations.deepspeed import start_engine
from tailorstore.integrations.deepspeed.head import HEAD_FILE, read_head
from tailorstore.formats.safe_load import load_torch_file

reference, save_dir, store = Path(sys.argv[1]), Path(sys.argv[2]), Store.open(sys.argv[3])
engine = start_engine(store)
info = CheckpointCommitInfo(tag="global_step3", save_dir=str(save_dir), save_latest=True)
engine.create(info)
for f in sorted(reference.iterdir()):
    engine.save(load_torch_file(f, mmap=False)[0], str(save_dir / "global_step3" / f.name))
engine.flush()  # the snapshot's files are written (save_checkpoint returned before they were)
print("staged", flush=True)
time.sleep(600)  # killed here, before engine.commit: the staged save is the only copy
"""


def stage_and_wait(
    runs: Runs, tmp_path: Path, save_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> tuple[Path, Path, subprocess.Popen[str]]:
    """A store, a staging folder this test and its engines use, and a process that has staged
    DeepSpeed's step-3 files there through a TailorCheckpointEngine and waits, uncommitted."""
    reference = runs.get("zero2-bf16").save_dir / "global_step3"
    staging = tmp_path / "staging"
    staging.mkdir()
    monkeypatch.setenv("TAILOR_STAGING", str(staging))
    Store.init(tmp_path / "store").close()
    script = tmp_path / "stage.py"
    script.write_text(STAGE_AND_WAIT)
    proc = subprocess.Popen(
        [sys.executable, str(script), str(reference), str(save_dir), str(tmp_path / "store")],
        stdout=subprocess.PIPE,
        text=True,
    )
    if proc.stdout is None or proc.stdout.readline().strip() != "staged":
        proc.kill()
        raise AssertionError("the staging process did not stage its save")
    return reference, staging, proc


def test_a_killed_runs_staged_save_is_written_where_deepspeed_would_by_the_next_engine(
    runs: Runs, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run killed between saving and committing left its staged save in memory (/dev/shm) for
    good, the only copy of it. The next engine to start moves it to save_dir/tag, frees the
    staging folder and commits it (then deletes it once durable), but leaves a live run's staged
    save alone (its lock says it is live)."""
    save_dir = tmp_path / "save"
    reference, staging, proc = stage_and_wait(runs, tmp_path, save_dir, monkeypatch)
    try:
        staged = sorted(p.name for p in staging.rglob("*.pt"))
        assert staged == sorted(f.name for f in reference.iterdir())
        with Store.open(tmp_path / "store") as store:
            start_engine(store)  # the staging run is alive: nothing of it moves
            assert sorted(p.name for p in staging.rglob("*.pt")) == staged and not save_dir.exists()
            proc.kill()
            proc.wait(timeout=60)
            start_engine(store)
    finally:
        proc.kill()
    assert not (save_dir / "global_step3").exists(), "written where DeepSpeed would, committed, deleted once durable"
    with Store.open(tmp_path / "store") as store:
        assert [s.step for s in store.log()] == [3]
        store.checkout("step=3", tmp_path / "out")
    real = tmp_path / "out" / "global_step3"
    assert sorted(p.name for p in real.iterdir()) == staged, "the store holds the staged save"
    for f in sorted(reference.iterdir()):
        assert differences(load_torch_file(real / f.name, mmap=False)[0], load_torch_file(f, mmap=False)[0]) == []
    assert not list(staging.iterdir()), "the dead run's staging folder was freed"


def test_a_killed_runs_staged_save_that_cannot_be_moved_stays_and_training_starts(
    runs: Runs, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the save should go cannot be written (here a file took the folder's name): the new
    engine starts anyway, the staged save stays, and a later engine moves it once it can."""
    save_dir = tmp_path / "blocked" / "save"
    _, staging, proc = stage_and_wait(runs, tmp_path, save_dir, monkeypatch)
    proc.kill()
    proc.wait(timeout=60)
    staged = sorted(p.name for p in staging.rglob("*.pt"))
    (tmp_path / "blocked").write_text("a file where the save folder's parent should be")
    with Store.open(tmp_path / "store") as store:
        start_engine(store)  # does not raise
        assert sorted(p.name for p in staging.rglob("*.pt")) == staged
        (tmp_path / "blocked").unlink()
        start_engine(store)  # moves it, and commits it
        assert [s.step for s in store.log()] == [3]
        store.checkout("step=3", tmp_path / "out")
    assert sorted(p.name for p in (tmp_path / "out" / "global_step3").iterdir()) == staged
    assert not list(staging.iterdir())


def test_tailor_checkpoint_engine_leaves_a_16bit_export_where_deepspeed_writes_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """save_16bit_model goes through the engine too, with a file beside the tag folder: written as
    DeepSpeed writes it, and no commit is attempted for the empty staged step."""
    monkeypatch.setenv("TAILOR_STAGING", str(tmp_path / "staging"))
    export = tmp_path / "export"
    with Store.init(tmp_path / "store") as store:
        engine = start_engine(store)
        info = CheckpointCommitInfo(tag="global_step5", save_dir=str(export), save_latest=False)
        engine.create(info)
        engine.makedirs(str(export), exist_ok=True)
        engine.save({"w": torch.ones(3)}, str(export / "pytorch_model.bin"))
        engine.commit(info)
        engine.flush()
        assert store.log() == []
        assert not list((tmp_path / "staging").iterdir()), "the empty staged step left nothing behind"
    assert torch.equal(load_torch_file(export / "pytorch_model.bin", mmap=False)[0]["w"], torch.ones(3))


def test_hf_trainer_callback_with_delete_and_save_total_limit(hf_run: HFRun, tmp_path: Path) -> None:
    Store.init(tmp_path / "store").close()
    out = tmp_path / "out"
    train_hf(
        out,
        final_weights=tmp_path / "final.safetensors",
        steps=6,
        save_steps=3,
        tailor_store=tmp_path / "store",
        delete_after_commit=True,
        save_total_limit=1,
    )
    assert not differences(load_file(hf_run.final_weights), load_file(tmp_path / "final.safetensors"))
    assert not list(out.glob("checkpoint-*")), "every checkpoint folder was deleted once committed"
    with Store.open(tmp_path / "store") as store:
        assert [s.step for s in store.log()] == [3, 6]
        sources = [store.repo.manifest(s.manifest).source.split("; ") for s in store.log()]
        assert [len(parts) for parts in sources] == [2, 2], "rank-parallel: each rank committed a part"
        assert store.verify(deep=True).ok
        store.checkout("latest", tmp_path / "restored" / "checkpoint-6")
        store.checkout(3, tmp_path / "restored" / "checkpoint-3")
    latest = load_file(tmp_path / "restored" / "checkpoint-6" / "model.safetensors")
    assert not differences(load_file(hf_run.final_weights), latest), "latest holds the final weights"

    final = tmp_path / "resumed.safetensors"  # resume_from_checkpoint takes the checked-out folder as it is
    train_hf(tmp_path / "resumed", final_weights=final, resume_from=tmp_path / "restored" / "checkpoint-3", steps=6)
    assert not differences(load_file(hf_run.final_weights), load_file(final)), "resumed run ended elsewhere"


@pytest.mark.parametrize("engine", [True, False], ids=["attach", "save_checkpoint"])
def test_resuming_from_an_earlier_step_branches_and_says_so(
    runs: Runs, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, engine: bool
) -> None:
    """Training goes back to step 3 after step 6 was committed (a rewind), and saves step 6 again:
    by default its saves go to a new run branched at step 3, in one warning line, and the first
    step 6 stays as it was; with on_existing='error' the save fails as a plain commit would.
    Through ``attach`` (the save staged, resumed from the store) and ``save_checkpoint`` (the save
    on disk, resumed from there)."""
    reference, save, options = attached_run(runs, tmp_path, monkeypatch, tailor_engine=engine)
    train_tiny(save, losses_out=tmp_path / "first.json", steps=6, save_every=3, **options)
    with Store.open(tmp_path / "store") as store:
        first = {s.step: s.id for s in store.log()}
    rewound = train_tiny(
        save, losses_out=tmp_path / "again.json", resume_from=save, resume_tag="global_step3", steps=9, save_every=3,
        **options,
    )  # fmt: skip
    assert rewound == {s: reference.losses[s] for s in (4, 5, 6)} | {s: rewound[s] for s in (7, 8, 9)}
    log = (tmp_path / "again.log").read_text()
    assert log.count("go to a new run 'main-from-3' branched there") == 1, log
    with Store.open(tmp_path / "store") as store:
        assert {s.step: s.id for s in store.log(run="main")} == first, "main's steps stay as they were"
        branch = {r.name: r for r in store.runs()}["main-from-3"]
        assert branch.base is not None and branch.base.step == 3 and branch.latest_step == 9
        with Store.open(tmp_path / "store", run="main-from-3") as ft:
            assert [s.step for s in ft.log(run="main-from-3")] == [6, 9]
        assert store.verify(deep=True).ok

    with pytest.raises(TrainingFailed, match="already in"):
        train_tiny(
            save, losses_out=tmp_path / "strict.json", resume_from=save, resume_tag="global_step3", steps=6,
            save_every=3, on_existing="error", **options,
        )  # fmt: skip


def test_a_restart_after_a_rewind_goes_on_in_the_branch_not_the_abandoned_run(
    runs: Runs, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A restart after a rewind: train to step 9, go back to step 3 (saves 6 and 9 go to
    ``main-from-3``, and ``latest`` names ``global_step9``), then restart the same job. It resumed
    ``main:step=9``, the timeline the user had abandoned, and committed step 12 into ``main``. The
    job's head (integrations/deepspeed/head.py) names the run it last committed to."""
    _, save, options = attached_run(runs, tmp_path, monkeypatch, tailor_engine=True)
    train_tiny(save, losses_out=tmp_path / "first.json", steps=9, save_every=3, **options)
    train_tiny(save, losses_out=tmp_path / "again.json", resume_from=save, resume_tag="global_step3", steps=9,
               save_every=3, **options)  # fmt: skip
    assert (save / "latest").read_text().strip() == "global_step9"
    restarted = train_tiny(save, losses_out=tmp_path / "restart.json", resume_from=save, steps=12, save_every=3,
                           **options)  # fmt: skip
    assert sorted(restarted) == [10, 11, 12]
    log = (tmp_path / "restart.log").read_text()
    assert "step 9 is in run(s) 'main' too; resuming run 'main-from-3'" in log, log
    with Store.open(tmp_path / "store") as store:
        assert [s.step for s in store.log(run="main")] == [3, 6, 9], "nothing more went into the abandoned run"
        assert [s.step for s in store.log(run="main-from-3")] == [6, 9, 12]


def test_a_restart_after_a_replacing_rewind_never_resumes_a_step_of_the_old_timeline(
    runs: Runs, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The ``replace`` variant: after going back to step 3 and saving step 6 again (it replaced the
    first step 6), the job was killed while committing step 9 again, so ``latest`` names
    ``global_step9`` while the store's step 9 is the old timeline's. The restart resumes from
    the new step 6, the last step this training committed, and says why."""
    _, save, options = attached_run(runs, tmp_path, monkeypatch, tailor_engine=True, on_existing="replace")
    train_tiny(save, losses_out=tmp_path / "first.json", steps=9, save_every=3, **options)
    train_tiny(save, losses_out=tmp_path / "again.json", resume_from=save, resume_tag="global_step3", steps=6,
               save_every=3, **options)  # fmt: skip
    (save / "latest").write_text("global_step9")  # DeepSpeed's pointer moved on; the commit of step 9 never came
    restarted = train_tiny(save, losses_out=tmp_path / "restart.json", resume_from=save, steps=9, save_every=0,
                           **options)  # fmt: skip
    assert sorted(restarted) == [7, 8, 9], "resumed from the new step 6, not the old step 9"
    log = (tmp_path / "restart.log").read_text()
    assert "names step 9; run" in log and "the last step this training committed" in log, log
    assert "went back" not in log, "says what it knows (latest and the head), without guessing a rewind"


def test_resuming_from_a_composite_through_attach_warns_which_layers(
    runs: Runs, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, save, options = attached_run(runs, tmp_path, monkeypatch, tailor_engine=True)
    train_tiny(save, losses_out=tmp_path / "first.json", steps=6, save_every=3, engine_policy="parity", **options)
    train_tiny(save, losses_out=tmp_path / "exact.json", resume_from=save, resume_tag="global_step3", steps=4,
               save_every=0, **options)  # fmt: skip
    assert "a composite" not in (tmp_path / "exact.log").read_text()  # step 3, the first, stores every layer
    train_tiny(save, losses_out=tmp_path / "mixed.json", resume_from=save, resume_tag="global_step6", steps=7,
               save_every=0, **options)  # fmt: skip
    log = (tmp_path / "mixed.log").read_text()
    assert "resuming from step 6, a composite" in log and "(step 3)" in log, log


@pytest.mark.parametrize("mount_options", ["size=1m", "ro,size=1m"], ids=["full", "read-only"])
def test_a_staging_folder_that_fails_costs_no_save(
    runs: Runs, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mount_options: str
) -> None:
    """Staging on a 1 MB tmpfs (Docker's /dev/shm is 64 MB) or a read-only one, as a real DeepSpeed
    run with attach: each save is written where DeepSpeed writes it and committed from there, one
    warning per rank names the staging folder and $TAILOR_STAGING, and training is unchanged."""
    reference = runs.get("zero2-bf16")
    with mounted("-t", "tmpfs", "-o", mount_options, "tmpfs", str(tmp_path / "shm")) as staging:
        monkeypatch.setenv("TAILOR_STAGING", str(staging))
        Store.init(tmp_path / "store").close()
        save = tmp_path / "save"
        options = {"commit_to": tmp_path / "store", "tailor_engine": True, **reference.options}
        losses = train_tiny(save, losses_out=tmp_path / "losses.json", steps=6, save_every=3, **options)
        assert not [p for p in staging.rglob("*") if p.is_file()], "nothing is left in staging"
    assert losses == reference.losses
    log = (tmp_path / "losses.log").read_text()
    assert log.count(f"staging in {staging} failed") == 2 and "TAILOR_STAGING" in log, log  # once per rank
    assert sorted(p.name for p in save.iterdir()) == ["latest", HEAD_FILE, "zero_to_fp32.py", "zero_to_torch.py"], (
        "each save was committed from save_dir, then deleted there"
    )
    with Store.open(tmp_path / "store") as store:
        assert [s.step for s in store.log()] == [3, 6]
        assert store.verify(deep=True).ok
        store.checkout(6, tmp_path / "out")
    assert same_tree(tmp_path / "out" / "global_step6", reference.save_dir / "global_step6")


def test_a_save_a_killed_run_left_in_staging_is_committed_at_the_next_start(
    runs: Runs, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run killed before its commit left a whole staged save in staging. The next engine moved it
    where DeepSpeed writes and left it for the user to find and commit; now global rank 0 commits it
    (asked for by the first-contact trial), and the step checks out as the save."""
    reference = runs.get("zero2-bf16")
    staging = tmp_path / "staging"
    dead = staging / f"{staged.PREFIX}999999-dead" / "save-000001"
    shutil.copytree(reference.save_dir / "global_step3", dead / "global_step3")
    save = tmp_path / "save"
    (dead / staged.TARGET).write_text(str(save / "global_step3"))
    monkeypatch.setenv("TAILOR_STAGING", str(staging))
    Store.init(tmp_path / "store").close()
    options = {"commit_to": tmp_path / "store", "tailor_engine": True, **reference.options}
    train_tiny(save, losses_out=tmp_path / "losses.json", steps=1, save_every=0, **options)
    log = (tmp_path / "losses.log").read_text()
    assert "committed step 3 of run 'main' from the save a run that is gone left in staging" in log, log
    with Store.open(tmp_path / "store") as store:
        assert [s.step for s in store.log()] == [3]
        store.checkout("step=3", tmp_path / "out")
    assert same_tree(tmp_path / "out" / "global_step3", reference.save_dir / "global_step3")
    assert not (save / "global_step3").exists(), "deleted once durable, as a commit from training is"


def test_recovery_moves_only_regular_files_it_staged_never_through_a_link(tmp_path: Path) -> None:
    """An abandoned staging folder with links planted in it: the next engine's recovery moves the
    staged file and leaves every link, and what they point at, where it is."""
    outside = tmp_path / "outside"
    (outside / "tree").mkdir(parents=True)
    (outside / "secret").write_text("must stay")
    (outside / "tree" / "inner").write_text("must stay too")
    staging = tmp_path / "staging"
    save = staging / f"{staged.PREFIX}999-dead" / "save-000001"
    tag = save / "global_step3"
    tag.mkdir(parents=True)
    (tag / "mp_rank_00_model_states.pt").write_bytes(b"staged bytes")
    (tag / "link-to-file").symlink_to(outside / "secret")
    (tag / "link-to-dir").symlink_to(outside / "tree")
    real = tmp_path / "save" / "global_step3"
    (save / staged.TARGET).write_text(str(real))
    linked = staging / f"{staged.PREFIX}998-dead" / "save-000001"
    linked.mkdir(parents=True)
    (linked / "global_step6").symlink_to(outside / "tree")  # the tag folder itself a link
    (linked / staged.TARGET).write_text(str(tmp_path / "save" / "global_step6"))
    [moved] = staged.recover(staging)
    assert moved.target == str(real) and moved.folder == str(
        real.with_name(f"global_step3{staged.UNCOMMITTED}") / "global_step3"
    )
    assert not real.exists()
    real = Path(moved.folder)
    assert sorted(p.name for p in real.iterdir()) == ["mp_rank_00_model_states.pt"]
    assert (real / "mp_rank_00_model_states.pt").read_bytes() == b"staged bytes"
    assert (outside / "secret").read_text() == "must stay" and (
        outside / "tree" / "inner"
    ).read_text() == "must stay too"
    assert not (tmp_path / "save" / "global_step6").exists()


def test_hf_trainer_going_back_to_an_earlier_checkpoint_branches(hf_run: HFRun, tmp_path: Path) -> None:
    """The HF Trainer resumed from checkpoint-3 after step 6 was committed saves checkpoint-6 again:
    the callback's rank-parallel commit goes to a new run branched at step 3, in one warning, and
    main's step 6 stays as it was."""
    Store.init(tmp_path / "store").close()
    out = tmp_path / "out"
    options = {"steps": 6, "save_steps": 3, "tailor_store": tmp_path / "store"}
    train_hf(out, final_weights=tmp_path / "first.safetensors", **options)
    with Store.open(tmp_path / "store") as store:
        first = {s.step: s.id for s in store.log()}
    assert sorted(first) == [3, 6]
    train_hf(out, final_weights=tmp_path / "again.safetensors", resume_from=out / "checkpoint-3", **options)
    log = (tmp_path / "again.log").read_text()
    assert "go to a new run 'main-from-3' branched there" in log, log
    with Store.open(tmp_path / "store") as store:
        assert {s.step: s.id for s in store.log(run="main")} == first
        assert [s.step for s in store.log(run="main-from-3")] == [6]
        assert store.verify(deep=True).ok
    assert not differences(load_file(tmp_path / "first.safetensors"), load_file(tmp_path / "again.safetensors"))


def test_hf_trainer_callback_commits_rank_parallel_under_a_policy(hf_run: HFRun, tmp_path: Path) -> None:
    """The callback commits rank-parallel under a policy too: every rank writes its own files'
    pieces of the layers the budget keeps, and each step's manifest equals a single-process
    commit of the same checkpoint folders with the same policy."""
    Store.init(tmp_path / "store").close()
    train_hf(
        tmp_path / "out", final_weights=tmp_path / "final.safetensors", steps=6, save_steps=3,
        tailor_store=tmp_path / "store", tailor_policy="budget:fraction=0.4",
    )  # fmt: skip
    with Store.init(tmp_path / "single") as single:
        for step in (3, 6):
            single.commit(hf_run.output_dir / f"checkpoint-{step}", policy="budget", fraction=0.4)
        expected = {step: manifest_rows(single, step) for step in (3, 6)}
    assert not expected[6]["exact"], "the budget inherits layers at the second save"
    with Store.open(tmp_path / "store") as store:
        sources = [store.repo.manifest(s.manifest).source.split("; ") for s in store.log()]
        assert [len(parts) for parts in sources] == [2, 2], "rank-parallel: each rank committed a part"
        for step in (3, 6):
            found = manifest_rows(store, step)
            # training_args.bin holds the run's output_dir, which differs between the two runs
            for rows in (found, expected[step]):
                rows["files"] = [f for f in rows["files"] if f[0] != "training_args.bin"]
            assert found == expected[step], step
        assert store.verify(deep=True).ok


def mapped_file(tensor: torch.Tensor) -> str:
    """What /proc/self/maps names the mapping holding ``tensor``'s bytes: a file's path, ``[heap]``,
    or '' for anonymous memory."""
    address = tensor.untyped_storage().data_ptr()
    for line in Path("/proc/self/maps").read_text().splitlines():
        span, *rest = line.split(maxsplit=5)
        low, high = (int(x, 16) for x in span.split("-"))
        if low <= address < high:
            return rest[4].strip() if len(rest) == 5 else ""
    return ""


def test_a_resume_maps_the_model_states_it_staged_and_reads_any_other_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A resume's files lie in the engine's own staging (tmpfs): mapping its model states spares a
    copy of every byte into fresh memory. Optimizer states are read: the optimizer keeps the loaded
    moments and training writes them, page by page copy-on-write if they were mapped. A folder
    that load_checkpoint loads as it is may be cut short by someone else, so it is read too."""
    monkeypatch.setenv("TAILOR_STAGING", str(tmp_path / "staging"))
    with Store.init(tmp_path / "store") as store:
        engine = start_engine(store)
        tag = engine.folder.root / "restore-000000" / "global_step2"
        model_states = tag / "mp_rank_00_model_states.pt"
        optim_states = tag / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"
        elsewhere = tmp_path / "save" / "global_step2" / "mp_rank_00_model_states.pt"
        for path in (model_states, optim_states, elsewhere):
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.save({"w": torch.arange(4096, dtype=torch.float32)}, path)
        mapped = engine.load(str(model_states))["w"]
        moments = engine.load(str(optim_states))["w"]
        read = engine.load(str(elsewhere))["w"]
        assert mapped_file(mapped) == str(model_states.resolve())
        assert not mapped_file(moments).startswith("/"), "optimizer states are read into memory of their own"
        assert not mapped_file(read).startswith("/"), "read into memory of its own"
        assert torch.equal(mapped, read) and torch.equal(moments, read)
        mapped += 1  # the mapping is private: training's changes never reach the file
        assert torch.equal(load_torch_file(model_states, mmap=False)[0]["w"], read)
        model_states.chmod(0o666)  # a mode the store recorded: anyone could cut the file short
        assert not mapped_file(engine.load(str(model_states))["w"]).startswith("/"), "read, never mapped"
        engine.flush()


def test_load_checkpoint_without_attach_loads_what_it_staged_through_the_allowlist(tmp_path: Path) -> None:
    """DeepSpeed's own checkpoint engine unpickles with weights_only=False; the files a resume stages
    come from the store, which anyone with write access to its bucket can fill."""
    from types import SimpleNamespace

    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    from tailorstore.core.errors import UnsafePickleError
    from tailorstore.integrations.deepspeed import staged_loads
    from tests.system.test_bad_input import Evil

    engine = SimpleNamespace(checkpoint_engine=TorchCheckpointEngine())
    root = tmp_path / "tailor-restore-1"
    folder = root / "step" / "global_step2"
    hostile, plain = folder / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt", folder / "mp_rank_00_model_states.pt"
    elsewhere = tmp_path / "mp_rank_00_model_states.pt"
    marker = tmp_path / "pwned"
    plain.parent.mkdir(parents=True)
    torch.save({"evil": Evil(marker)}, hostile)
    for path in (plain, elsewhere):
        torch.save({"w": torch.arange(4096, dtype=torch.float32)}, path)
    with staged_loads(engine, root):
        with pytest.raises(UnsafePickleError):
            engine.checkpoint_engine.load(str(hostile), map_location="cpu")
        assert not marker.exists(), "the pickle's code ran"
        staged_w = engine.checkpoint_engine.load(str(plain), map_location="cpu")["w"]
        own_w = engine.checkpoint_engine.load(str(elsewhere), map_location="cpu")["w"]
    assert mapped_file(staged_w) == str(plain.resolve()), "the staged model states are mapped, not copied"
    assert not mapped_file(own_w).startswith("/"), "any other file is DeepSpeed's own load"
    assert "load" not in vars(engine.checkpoint_engine), "the engine's own load is back"
    engine.checkpoint_engine.load(str(hostile), map_location="cpu")  # DeepSpeed's own, after: it runs the code
    assert marker.exists()
