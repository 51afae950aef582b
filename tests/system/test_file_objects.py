"""A resume with nothing staged. ``Store.step_objects`` builds each torch file of a DeepSpeed
step as the object ``torch.load`` returns for it, straight from the store: at the save's own world
size equal to DeepSpeed's own files, at another equal to the resharded checkout's; every tensor
hash-checked, no file written."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tailorstore import Store
from tailorstore.core.errors import CorruptStoreError
from tailorstore.integrations.common import StoreSession
from tailorstore.store.index.catalogue import Catalogue
from tests.conftest import Runs, as_of_step, blob_object

STEP = 6


def assert_same(ours: Any, theirs: Any, where: str = "$") -> None:
    """Equal as objects, tensors byte for byte. DeepSpeed's ``param_shapes`` hold ``torch.Size``,
    which the store's re-pickled trees give back as tuples (the shapes the same)."""
    if isinstance(theirs, torch.Tensor):
        assert isinstance(ours, torch.Tensor) and (ours.dtype, ours.shape) == (theirs.dtype, theirs.shape), where
        a, b = ours.contiguous().reshape(-1), theirs.contiguous().reshape(-1)
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)) if a.numel() else True, where
        return
    if isinstance(theirs, torch.Size):
        assert tuple(ours) == tuple(theirs), where
        return
    assert type(ours) is type(theirs), (where, type(ours), type(theirs))
    if isinstance(theirs, dict):
        assert list(ours) == list(theirs), where
        for key in theirs:
            assert_same(ours[key], theirs[key], f"{where}.{key}")
    elif isinstance(theirs, list | tuple):
        assert len(ours) == len(theirs), where
        for i, (x, y) in enumerate(zip(ours, theirs, strict=True)):
            assert_same(x, y, f"{where}[{i}]")
    elif hasattr(theirs, "__dict__") and not isinstance(theirs, type):
        assert_same(vars(ours), vars(theirs), f"{where}/vars")
    else:
        assert ours == theirs, (where, ours, theirs)


def _load(path: Path) -> Any:
    return torch.load(path, map_location="cpu", weights_only=False)


def test_a_steps_files_built_from_the_store_are_what_torch_load_returns(runs: Runs, tmp_path: Path) -> None:
    save = as_of_step(runs.get("zero2-bf16").save_dir, STEP, tmp_path / "at")
    with Store.init(tmp_path / "store") as store:
        store.commit(save)
        objects = StoreSession(store).step_objects(f"step={STEP}")
        assert objects.tag == f"global_step{STEP}"
        assert objects.names == sorted(p.name for p in (save / objects.tag).glob("*.pt"))
        for name in objects.names:
            assert_same(objects.load(name), _load(save / objects.tag / name), name)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["at", "store"], "nothing was written beside them"


@pytest.mark.parametrize("world", [1, 3])
def test_at_another_world_size_they_are_the_resharded_files(runs: Runs, tmp_path: Path, world: int) -> None:
    with Store.init(tmp_path / "store") as store:
        store.commit(as_of_step(runs.get("zero2-bf16").save_dir, STEP, tmp_path / "at"))
        objects = StoreSession(store).step_objects(f"step={STEP}", world_size=world)
        result = store.checkout(f"step={STEP}", tmp_path / "out", world_size=world)
        files = sorted(p.name for p in (tmp_path / "out" / result.tag).glob("*.pt"))
        assert objects.names == files and len(files) == world + 1
        for name in objects.names:
            assert_same(objects.load(name), _load(tmp_path / "out" / result.tag / name), name)


def test_a_damaged_blob_is_an_error_never_a_tensor(runs: Runs, tmp_path: Path) -> None:
    with Store.init(tmp_path / "store") as store:
        store.commit(as_of_step(runs.get("zero2-bf16").save_dir, STEP, tmp_path / "at"))
        objects = StoreSession(store).step_objects(f"step={STEP}")
        name = next(n for n in objects.names if "optim_states" in n)
        manifest = store.repo.resolve(f"step={STEP}")
        atom = max(
            (a for a in store.repo.view(Catalogue).atoms(manifest) if a.path.endswith(name) and a.derived is None),
            key=lambda a: a.nbytes,
        )
        path, start, size = blob_object(store.repo, atom.blob)
        data = bytearray(path.read_bytes())
        data[start + size // 2] ^= 0xFF  # one byte inside the blob's stored bytes
        path.chmod(0o644)
        path.write_bytes(bytes(data))
        with pytest.raises(CorruptStoreError):
            objects.load(name)


def test_serving_a_resume_leaves_deepspeed_as_it_was_even_when_the_load_fails(runs: Runs, tmp_path: Path) -> None:
    """integrations/deepspeed/serving.py changes DeepSpeed's loader, the engine's glob and its checkpoint
    engine's load only while its block runs; a load that fails inside it leaves none of them."""
    from types import SimpleNamespace

    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine
    from deepspeed.runtime.state_dict_factory import SDLoaderFactory

    from tailorstore.integrations.deepspeed import serving

    own_loader = SDLoaderFactory.__dict__["get_sd_loader"]
    with Store.init(tmp_path / "store") as store:
        store.commit(as_of_step(runs.get("zero2-bf16").save_dir, STEP, tmp_path / "at"))
        objects = StoreSession(store).step_objects(f"step={STEP}")
        engine = SimpleNamespace(
            checkpoint_engine=TorchCheckpointEngine(),
            _get_ckpt_name=lambda path, tag, mp_placeholder=None: (
                f"{path}/{tag}/mp_rank_{mp_placeholder}_model_states.pt"
            ),
        )
        root = tmp_path / "never-made"
        with pytest.raises(RuntimeError, match="DeepSpeed failed"), serving.served(engine, root, objects, {}):
            names = engine._get_all_ckpt_names(str(root), objects.tag)
            assert names == [str(root / objects.tag / "mp_rank_00_model_states.pt")]
            loader = SDLoaderFactory.get_sd_loader(names, engine.checkpoint_engine)
            path, state, _ = loader.load(1, 0)
            assert path == names[0] and "module" in state  # built from the store, no file read
            raise RuntimeError("DeepSpeed failed")
    assert SDLoaderFactory.__dict__["get_sd_loader"] is own_loader
    assert "_get_all_ckpt_names" not in vars(engine) and "load" not in vars(engine.checkpoint_engine)
    assert not root.exists()
