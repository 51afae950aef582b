"""Layout detection (formats/layout.py): the paths a commit takes, and Accelerate's ``save_state``
folder under FSDP as detection sees it (no training: the DCP folders are written by ``dcp.save`` in
this process, under the names Accelerate gives them)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from tailorstore.core.errors import BadCheckpointError, InputChangedError
from tailorstore.formats.layout import ACCELERATE, check_files, detect


def accelerate_folder(root: Path) -> Path:
    """``checkpoint_7/`` with ``pytorch_model_fsdp_0/``, ``optimizer_0/`` and a rank's random states."""
    folder = root / "checkpoint_7"
    state = {"w": torch.arange(16, dtype=torch.float32)}
    dcp.save({"model": state}, storage_writer=dcp.FileSystemWriter(str(folder / "pytorch_model_fsdp_0")))
    dcp.save({"optimizer": {"state": state}}, storage_writer=dcp.FileSystemWriter(str(folder / "optimizer_0")))
    torch.save({"step": 7}, folder / "random_states_0.pkl")
    return folder


@pytest.mark.filterwarnings("ignore::UserWarning")  # dcp.save without a process group says so
def test_the_folder_is_one_step_named_by_accelerate(tmp_path: Path) -> None:
    layout = detect(accelerate_folder(tmp_path))
    assert layout.kind == ACCELERATE and layout.step == 7
    assert sorted(layout.files) == [
        "optimizer_0/.metadata",
        "optimizer_0/__0_0.distcp",
        "pytorch_model_fsdp_0/.metadata",
        "pytorch_model_fsdp_0/__0_0.distcp",
        "random_states_0.pkl",
    ]


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_folder_holding_another_checkpoint_beside_them_is_told_so(tmp_path: Path) -> None:
    """Not one step: its checkpoints are named (it said "not a checkpoint" before)."""
    folder = accelerate_folder(tmp_path)
    (folder / "checkpoint-5").mkdir()
    (folder / "checkpoint-5" / "trainer_state.json").write_text('{"global_step": 5}')
    with pytest.raises(
        BadCheckpointError, match=r"holds 3 checkpoint folder\(s\) of its own \(checkpoint-5, optimizer_0"
    ):
        detect(folder)


def test_commit_path_rules(tmp_path: Path) -> None:
    (tmp_path / "ok.json").write_text("{}")
    check_files(tmp_path, ["ok.json"])
    for bad in ("a\\b", "x/../y", "/abs", "bad\udcffname"):
        with pytest.raises(BadCheckpointError, match="cannot be stored"):
            check_files(tmp_path, [bad])
    (tmp_path / "out").symlink_to("/etc/hostname")
    with pytest.raises(BadCheckpointError, match="outside the checkpoint"):
        check_files(tmp_path, ["out"])


def test_a_file_gone_between_the_listing_and_its_check_is_said_to_have_changed(tmp_path: Path) -> None:
    """A file listed and then removed or renamed before it was checked is a save still being
    written (the input changed under the commit), not "a link to a missing file" (an attack round's finding);
    a link to nothing is still refused as one."""
    with pytest.raises(InputChangedError, match=r"gone\.pt: changed while it was being committed \(it was removed"):
        check_files(tmp_path, ["gone.pt"])
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    with pytest.raises(BadCheckpointError, match="names nothing") as caught:
        check_files(tmp_path, ["dangling"])
    assert not isinstance(caught.value, InputChangedError)


@pytest.mark.parametrize("kind", ["folder", "fifo", "dangling link", "link to a folder"])
@pytest.mark.parametrize("beside", ["deepspeed", "hf"])
def test_a_latest_that_is_no_file_is_refused_by_name(tmp_path: Path, kind: str, beside: str) -> None:
    """DeepSpeed's ``latest`` that is there but no file was passed over as absent: a DeepSpeed save
    was then refused as "holding checkpoint folders of its own", an HF folder committed without a
    DeepSpeed tag, and a resume loaded the store's newest step (an attack round's finding)."""
    save = tmp_path / "save"
    (save / "global_step3").mkdir(parents=True)
    torch.save({}, save / "global_step3" / "mp_rank_00_model_states.pt")
    if beside == "hf":
        (save / "trainer_state.json").write_text('{"global_step": 3}')
    latest = save / "latest"
    if kind == "folder":
        latest.mkdir()
    elif kind == "fifo":
        import os

        os.mkfifo(latest)
    elif kind == "dangling link":
        latest.symlink_to(tmp_path / "nowhere")
    else:
        latest.symlink_to(save / "global_step3")
    with pytest.raises(BadCheckpointError, match=r"latest: DeepSpeed's `latest` is not a file here"):
        detect(save)
    latest.unlink() if kind != "folder" else latest.rmdir()
    latest.write_text("global_step3")
    assert detect(save).ds_tag == "global_step3"
