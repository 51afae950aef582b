"""Clean-up after a durable commit is a warning, never a failure (I3, docs/FORMAT.md 8.1):
a staging folder remounted read-only, and ``TAILOR_STAGING`` naming a regular file."""

from __future__ import annotations

import contextlib
import json
import logging
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tailorstore import Store
from tailorstore.core.errors import BadCheckpointError
from testbed.runs import train_tiny
from tests.conftest import Runs


@contextlib.contextmanager
def tmpfs(where: Path) -> Iterator[Path]:
    where.mkdir(parents=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=32m", "tmpfs", str(where)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def test_a_commit_whose_save_cannot_be_deleted_is_committed_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with tmpfs(tmp_path / "staging") as staging:
        save = staging / "save"
        save.mkdir()
        torch.save({"w": torch.ones(16)}, save / "ckpt.pt")
        subprocess.run(["mount", "-o", "remount,ro", str(staging)], check=True)
        with Store.init(tmp_path / "store") as store, caplog.at_level(logging.WARNING, logger="tailorstore"):
            result = store.commit(save, step=1, delete_after_commit=True)  # no exception: the step is durable
            assert [s.step for s in store.log()] == [result.step] == [1]
            assert store.verify(deep=True).ok
        assert "is committed, but its files" in caplog.text and "delete them by hand" in caplog.text
        assert (save / "ckpt.pt").is_file()


def test_staging_that_is_a_file_falls_back_to_the_save_dir(
    runs: Runs, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``TAILOR_STAGING`` naming a regular file: the first save raised NotADirectoryError inside the
    fallback itself, and training died. Each save now goes where DeepSpeed writes it and is committed."""
    reference = runs.get("zero2-bf16")
    not_a_folder = tmp_path / "staging-file"
    not_a_folder.write_text("not a folder")
    monkeypatch.setenv("TAILOR_STAGING", str(not_a_folder))
    Store.init(tmp_path / "store").close()
    options = {"commit_to": tmp_path / "store", "tailor_engine": True, **reference.options}
    losses = train_tiny(tmp_path / "save", losses_out=tmp_path / "losses.json", steps=6, save_every=3, **options)
    assert losses == reference.losses
    with Store.open(tmp_path / "store") as store:
        assert [s.step for s in store.log()] == [3, 6]
        assert store.verify(deep=True).ok
    assert not_a_folder.read_text() == "not a folder"


@pytest.mark.parametrize("shape", ["folder", "file"])
def test_delete_after_commit_deletes_a_plain_save(shape: str, tmp_path: Path) -> None:
    """A plain folder's files are recorded under the folder's name (save/ckpt.pt), and were looked
    for under save/save/: delete_after_commit deleted nothing, and the disk filled."""
    save = tmp_path / "save"
    save.mkdir()
    torch.save({"w": torch.ones(16)}, save / "ckpt.pt")
    target = save if shape == "folder" else save / "ckpt.pt"
    with Store.init(tmp_path / "store") as store:
        store.commit(target, step=1, delete_after_commit=True)
        assert not (save / "ckpt.pt").exists()
        store.checkout("latest", tmp_path / "out")
    assert torch.load(next((tmp_path / "out").rglob("ckpt.pt")))["w"].sum() == 16


def test_a_named_pipe_in_a_save_is_refused_naming_it(tmp_path: Path) -> None:
    """Regression: a FIFO in a checkpoint folder was skipped without a word, exit 0; then
    it was left out with a warning. A save with a pipe where a file should be is no save to record
    (one named __1_0.distcp left a DCP step without a rank's items): it is refused, naming it, and
    nothing is written."""
    import os

    save = tmp_path / "save"
    save.mkdir()
    torch.save({"w": torch.ones(4)}, save / "ckpt.pt")
    os.mkfifo(save / "pipe")
    with Store.init(tmp_path / "store") as store:
        with pytest.raises(BadCheckpointError, match=r"save/pipe: a named pipe, not a regular file"):
            store.commit(save, step=1)
        assert store.log() == []


def test_a_dead_runs_save_folder_of_markers_only_is_cleaned_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Regression: a killed run's staging folder holding only ``.written-*`` markers (its
    save committed, its markers not yet cleared) warned at every start and was never cleaned."""
    from tailorstore.integrations.deepspeed import staging as staged

    engine = tmp_path / "staging" / f"{staged.PREFIX}999999-abcd"
    save = engine / "save-000003"
    save.mkdir(parents=True)
    (save / f"{staged.WRITTEN}0").write_text("")
    (save / f"{staged.WRITTEN}1").write_text("")
    (save / staged.TARGET).write_text(str(tmp_path / "out" / "global_step3"))
    with caplog.at_level(logging.WARNING, logger="tailorstore"):
        assert staged.recover(tmp_path / "staging") == []
        assert not engine.exists()
        staged.recover(tmp_path / "staging")
    assert "it stays" not in caplog.text and "not ours" not in caplog.text, caplog.text


def test_a_working_folder_of_several_checkpoints_is_not_one_step(tmp_path: Path) -> None:
    """Regression: ``commit --step N`` of a training's working folder (its final weights
    beside its checkpoint folders) committed every checkpoint's files as one step."""
    from tailorstore import BadCheckpointError

    work = tmp_path / "out"
    for n in (1, 2):
        ckpt = work / f"checkpoint-{n}"
        ckpt.mkdir(parents=True)
        (ckpt / "trainer_state.json").write_text(json.dumps({"global_step": n}))
        torch.save({"w": torch.ones(4) * n}, ckpt / "pytorch_model.bin")
    torch.save({"w": torch.ones(4)}, work / "pytorch_model.bin")
    with Store.init(tmp_path / "store") as store:
        with pytest.raises(BadCheckpointError, match=r"holds 2 checkpoint folder\(s\) of its own \(checkpoint-1"):
            store.commit(work, step=9)
        assert store.log() == []
        store.commit(work / "checkpoint-2")  # each one on its own
        assert [s.step for s in store.log()] == [2]


def test_an_error_names_the_folder_committed_not_its_parent(tmp_path: Path) -> None:
    """Regression: a commit error named the parent folder instead of the one given."""
    from tailorstore import BadCheckpointError

    save = tmp_path / "weights"
    save.mkdir()
    torch.save({"w": torch.ones(4)}, save / "model.pt")
    with Store.init(tmp_path / "store") as store:
        with pytest.raises(BadCheckpointError, match=rf"^{save}: cannot tell which step") as raised:
            store.commit(save)
        assert not str(raised.value).startswith(f"{tmp_path}:")
