"""The DCP writer's memory file leaves each tensor's bytes in the tensor (formats/memory_folder.py)
and the commit copies them from there, checked against their hash as ``torch.save`` wrote them:
the file holds only the zip around them, a tensor changed before the commit's copy refuses the
save, and a save with torch's CRC-32 switched off still stores the very bytes ``FileSystemWriter``
writes."""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.utils.serialization import config as serialization_config

from tailorstore import Store
from tailorstore.core.errors import InputChangedError, StoreError
from tailorstore.formats.memory_folder import MemoryFile
from tailorstore.formats.source import InputFile
from tailorstore.integrations.common import StoreSession
from tailorstore.integrations.dcp.writer import TailorStorageWriter

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

MB = 1 << 20


def _saved(tensor: torch.Tensor) -> tuple[MemoryFile, bytes]:
    """``tensor`` saved through a lending writer, and what torch.save writes for it elsewhere."""
    plain = io.BytesIO()
    torch.save(tensor, plain)
    memory = MemoryFile("t")
    with memory.writer() as stream:
        stream.lend(tensor)
        torch.save(tensor, stream)
    return memory, plain.getvalue()


def test_the_memory_file_holds_the_zip_and_reads_back_as_torch_save_wrote_it() -> None:
    tensor = torch.randn(4 * MB // 4)
    memory, plain = _saved(tensor)
    try:
        st = os.fstat(memory.fd)
        assert st.st_size == len(plain)
        assert st.st_blocks * 512 < 64 << 10  # the zip's headers, not the tensor's 4 MiB
        with InputFile(memory.path) as src:
            assert bytes(src.read(0, src.size)) == plain
    finally:
        memory.close()


def test_a_tensor_changed_before_the_copy_is_refused_and_a_lent_range_is_read_whole() -> None:
    tensor = torch.randn(MB // 4)
    memory, _ = _saved(tensor)
    try:
        (lent,) = memory.lent
        with InputFile(memory.path) as src:
            with pytest.raises(StoreError, match="read in part"):
                src.read(lent.offset + 8, 64)
            tensor[7] += 1
            with pytest.raises(InputChangedError, match="a tensor saved into it changed"):
                src.read(lent.offset, len(lent.data))
    finally:
        memory.close()


@pytest.mark.parametrize("after", [b"tail", b""], ids=["other-bytes-next", "last-write"])
def test_a_tensors_bytes_with_no_zip_descriptor_after_them_are_written_into_the_file(after: bytes) -> None:
    """Only a write followed by a zip data descriptor is lent; any other is the file's own bytes."""
    tensor = torch.arange(1024, dtype=torch.float32)
    memory = MemoryFile("t")
    try:
        with memory.writer() as stream:
            stream.write(b"head")
            stream.lend(tensor)
            stream.write(memoryview(tensor.numpy()).cast("B"))
            if after:
                stream.write(after)  # else the stream is closed right after the tensor's bytes
        assert memory.lent == []
        with InputFile(memory.path) as src:
            assert bytes(src.read(0, src.size)) == b"head" + tensor.numpy().tobytes() + after
    finally:
        memory.close()


def test_a_state_changed_between_serializing_and_committing_records_no_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The part's commit first changes one saved tensor: the moment between the writer's
    ``torch.save`` and the commit's copy of the bytes."""
    weight = torch.randn(256, 256)
    commit_memory = StoreSession.commit_memory

    def changes_the_state_first(self: StoreSession, *args: Any, **kwargs: Any) -> Any:
        weight.add_(1.0)
        return commit_memory(self, *args, **kwargs)

    monkeypatch.setattr(StoreSession, "commit_memory", changes_the_state_first)
    with Store.init(tmp_path / "store") as store:
        writer = TailorStorageWriter(store, step=1)
        with pytest.raises(CheckpointException, match="a tensor saved into it changed"):
            dcp.save({"model": {"weight": weight}}, storage_writer=writer)
        assert store.log() == []


def test_with_torchs_crc_off_a_save_checks_out_as_filesystemwriter_writes_it(tmp_path: Path) -> None:
    # torch's own patch, not monkeypatch: pytest 9 undoes a setattr by deleting the attribute, which
    # on a torch config module hides the entry from every later torch.save in the process
    state = {"model": {"weight": torch.randn(128, 64), "bias": torch.randn(64)}}
    with serialization_config.patch({"save.compute_crc32": False}), Store.init(tmp_path / "store") as store:
        assert serialization_config.save.compute_crc32 is False
        dcp.save(state, storage_writer=TailorStorageWriter(store, step=2))
        dcp.save(state, checkpoint_id=str(tmp_path / "raw"))
        store.checkout("step=2", tmp_path / "out")
    assert serialization_config.save.compute_crc32 is True
    assert (tmp_path / "out" / "__0_0.distcp").read_bytes() == (tmp_path / "raw" / "__0_0.distcp").read_bytes()
