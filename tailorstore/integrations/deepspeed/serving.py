"""DeepSpeed's ``load_checkpoint`` served from memory: the files it asks for are objects built from
the store (``restore/file_objects.py``), and no file exists.

DeepSpeed finds a step's files on disk in two places before it reads them through its checkpoint
engine (``engine.py``, ``state_dict_factory.py``): it globs the model-states files
(``_get_all_ckpt_names``) and asserts that the one it loads exists (``SDLoaderBase.load``). While
:func:`served` is active both look at the step's names instead, under a folder that is never
created: the engine's own glob is replaced by the same pattern matched against those names, and
DeepSpeed's state-dict loader by one that loads the file this rank's model-parallel rank names,
as DeepSpeed's does when the counts match (the only case training meets). The optimizer files'
names DeepSpeed builds itself and only tries on disk for an older name, keeping its own. Every
read then reaches the checkpoint engine's ``load``, which hands over the object for the name.

Call order: ``served(engine, root, objects, built)`` around the call of DeepSpeed's own
``load_checkpoint(root, objects.tag)``; it undoes its three changes (the glob, the loader, the checkpoint
engine's ``load``) when the call returns or fails. The loader is DeepSpeed's class attribute, so the
change is process-wide while the call runs: a process loads one checkpoint at a time.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from deepspeed.runtime import state_dict_factory

from tailorstore import StepObjects
from tailorstore.core.errors import StoreError


class _ServedLoader:
    """DeepSpeed's state-dict loader for the case training meets: one file per model-parallel rank."""

    def __init__(self, ckpt_list: list[str], checkpoint_engine: Any) -> None:
        if not ckpt_list:
            raise StoreError("the step holds no model-states file for this rank")
        self.ckpt_list, self.checkpoint_engine = ckpt_list, checkpoint_engine

    def load(self, mp_world_size: int, mp_rank: int, *args: Any, **kwargs: Any) -> tuple[str, Any, tuple]:
        if len(self.ckpt_list) != mp_world_size:
            raise StoreError(
                f"the step holds {len(self.ckpt_list)} model-states files for {mp_world_size} model-parallel "
                "rank(s); a change of model-parallel size loads from staged files"
            )
        path = self.ckpt_list[mp_rank]
        return path, self.checkpoint_engine.load(path, map_location=None), (None, 1)


def servable(engine: Any) -> bool:
    """Whether this engine's resume can be served from memory: no universal checkpoint, no NVMe
    offload (DeepSpeed copies a folder for it), one model-parallel rank, no pipeline."""
    try:
        return (
            not engine.load_universal_checkpoint()
            and not engine.zero_nvme_offload_optimizer()
            and int(engine.mp_world_size) == 1
            and type(engine).__name__ != "PipelineEngine"
        )
    except AttributeError:  # a DeepSpeed this integration does not know
        return False


@contextmanager
def served(engine: Any, root: Path, objects: StepObjects, built: dict[str, Any]) -> Iterator[None]:
    """While active, DeepSpeed sees ``root/<tag>/<name>`` for each file of ``objects`` as the step's
    files, and its checkpoint engine's ``load`` of one returns its object: the one in ``built``
    (handed over once, so that DeepSpeed's is the only reference kept), else built when asked."""
    folder = root / objects.tag
    paths = {str(folder / name) for name in objects.names}
    checkpoint_engine = engine.checkpoint_engine
    had_load = "load" in vars(checkpoint_engine)
    own_load = checkpoint_engine.load

    def load(path: str, map_location: Any = None) -> Any:
        where = Path(path)
        if str(where.parent) == str(folder) and where.name in objects.builders:
            return built.pop(where.name) if where.name in built else objects.load(where.name)
        return own_load(path, map_location)

    def all_ckpt_names(checkpoints_path: str, tag: str) -> list[str]:
        pattern = engine._get_ckpt_name(checkpoints_path, tag, mp_placeholder="*")
        return sorted(fnmatch.filter(paths, pattern))

    def loader(ckpt_list: list[str], checkpoint_engine: Any, *_: Any, **__: Any) -> _ServedLoader:
        return _ServedLoader(ckpt_list, checkpoint_engine)

    factory = state_dict_factory.SDLoaderFactory
    original = factory.__dict__["get_sd_loader"]
    checkpoint_engine.load = load
    engine._get_all_ckpt_names = all_ckpt_names
    factory.get_sd_loader = staticmethod(loader)
    try:
        yield
    finally:
        factory.get_sd_loader = original
        del engine._get_all_ckpt_names
        if had_load:
            checkpoint_engine.load = own_load
        else:
            del checkpoint_engine.load
