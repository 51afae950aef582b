"""I5 (docs/FORMAT.md section 8): nothing read from an input or from the store changes how later
reads in the same process behave. A hostile pickle gets its own allowlist for its own load, so
``BUILD`` or slot state on an allowlisted object cannot reach the next file (finding 2 of the fourth
round of attacks: one extra ``.pt`` in a save recorded every later master as int32)."""

from __future__ import annotations

import io
import pickle
import zipfile
from pathlib import Path

import pytest
import torch

from tailorstore import BadCheckpointError
from tailorstore.formats.dcp import read_metadata
from tailorstore.formats.source import InputFile
from tailorstore.formats.torch_pickle import read_torch_zip
from tailorstore.store.index.catalogue import Catalogue


def _zip(path: Path, data_pkl: bytes) -> Path:
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED) as z:
        z.writestr("archive/data.pkl", data_pkl)
        z.writestr("archive/byteorder", "little")
    return path


def _dtypes(path: Path) -> list[str]:
    with InputFile(path) as src:
        found = read_torch_zip(src, str(path))
    assert found is not None
    tree = found[0]
    return [tree[k].dtype for k in sorted(tree)]


# GLOBAL torch.<name>, then BUILD with a dict state ({key: value}), then STOP
def _build(module: str, name: str, key: str, value: bytes) -> bytes:
    k = key.encode()
    return b"\x80\x02c" + f"{module}\n{name}\n".encode() + b"}X" + len(k).to_bytes(4, "little") + k + value + b"sb."


def _slot_build(module: str, name: str, attr: str, value: bytes) -> bytes:
    """BUILD with (None, {attr: value}): the slot state the C unpickler applies with setattr."""
    a = attr.encode()
    return (
        b"\x80\x02c" + f"{module}\n{name}\n".encode() + b"N}X" + len(a).to_bytes(4, "little") + a + value + b"s\x86b."
    )


def _string(text: str) -> bytes:
    return b"X" + len(text).to_bytes(4, "little") + text.encode()


def test_a_pickle_that_rebuilds_a_storage_type_changes_no_later_read(tmp_path: Path) -> None:
    good = tmp_path / "good.pt"
    torch.save({"master": torch.ones(4, dtype=torch.float32), "moment": torch.zeros(3)}, good)
    assert _dtypes(good) == ["float32", "float32"]

    for i, hostile in enumerate(
        [
            _build("torch", "FloatStorage", "dtype", _string("int32")),
            _build("torch", "float32", "name", _string("int32")),
            _slot_build("torch", "FloatStorage", "dtype", _string("int32")),
            _slot_build("torch", "Size", "__defaults__", b"(K\x07t" + b"\x85"),  # ((7,),) via a tuple
        ]
    ):
        evil = _zip(tmp_path / f"evil{i}.pt", hostile)
        with InputFile(evil) as src:
            try:
                read_torch_zip(src, str(evil))
            except BadCheckpointError:
                pass  # refused is fine; changing the next read is not
        assert _dtypes(good) == ["float32", "float32"], hostile


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_dcp_metadata_that_rebuilds_a_dtype_changes_no_later_read(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.save({"w": torch.ones(2, 3)}, checkpoint_id=str(tmp_path / "ckpt"))
    meta_bytes = (tmp_path / "ckpt" / ".metadata").read_bytes()
    sizes = {p.name: p.stat().st_size for p in (tmp_path / "ckpt").iterdir()}
    before = read_metadata(meta_bytes, "good", sizes)
    for hostile in (
        _build("torch", "float32", "name", _string("int32")),
        _slot_build("torch", "Size", "__defaults__", b"(K\x07t\x85"),
    ):
        try:
            read_metadata(hostile, "evil", sizes)
        except BadCheckpointError:
            pass
        after = read_metadata(meta_bytes, "good", sizes)
        assert after.tensors["w"].dtype == before.tensors["w"].dtype == "float32"
        assert after == before


def test_a_hostile_file_in_a_save_does_not_change_the_masters_of_a_later_commit(tmp_path: Path) -> None:
    """Through the store, in one process (a training job's Store): a save with one extra ``.pt``
    whose pickle rebuilds ``torch.FloatStorage`` as int32 and then holds no tensor, followed by a
    commit whose masters must be recorded as float32."""
    from tailorstore import Store

    save = tmp_path / "save"
    save.mkdir()
    torch.save({"w": torch.ones(8, dtype=torch.float32)}, save / "ckpt.pt")
    evil = tmp_path / "evil"
    evil.mkdir()
    torch.save({"w": torch.ones(8, dtype=torch.float32)}, evil / "ckpt.pt")
    # GLOBAL torch.FloatStorage, BUILD {"dtype": "int32"}, POP, then an empty dict: a file of no tensor
    hostile = _build("torch", "FloatStorage", "dtype", _string("int32"))[:-1] + b"0}."
    _zip(evil / "extra.pt", hostile)
    with Store.init(tmp_path / "store") as store:
        try:
            store.commit(evil, step=1)
        except BadCheckpointError:
            pass  # refused is fine; recording the next commit's masters as int32 is not
        store.commit(save, step=2)
        atoms = store.repo.view(Catalogue).atoms(store.repo.resolve("step=2"))
        assert {a.dtype for a in atoms} == {"float32"}, atoms
    pickle.loads(pickle.dumps(io.BytesIO))  # the test process's own pickle machinery still works
