"""A step's torch files as the objects ``torch.load`` would return, built straight from the store.

A resume that checked a step out into files (a staging folder in memory) and had DeepSpeed read
them back would write every byte once and read it once more. Here a file's object tree (the skeleton
with each tensor streamed from its atoms, as a checkout writes it) is pickled as a checkout would
pickle it, and unpickled at once by torch's own weights-only unpickler under this store's allowlist
(the same globals a checkout's ``torch.load`` allows): each storage is a fresh buffer that its
atoms are decoded into, hash-checked, once, and the loaded object keeps it. No file is written.

At the save's own world size and ZeRO stage the files are the step's own; at another, they are the
resharded files (``restore/reshard.resharded_trees``), built the same way.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any

import torch
import torch._weights_only_unpickler as weights_only  # torch.load's own unpickler, used as torch.load uses it

from tailorstore.access.contents import Contents
from tailorstore.access.model_tensors import committed_tree
from tailorstore.core.errors import BadCheckpointError, StoreError
from tailorstore.core.step_rules import refuse_thinned
from tailorstore.formats.kinds import TORCH
from tailorstore.formats.safe_load import allowed_globals, untrusted
from tailorstore.formats.skeleton import TensorSlot
from tailorstore.formats.tensors import dtype_from_name
from tailorstore.formats.torch_save_writer import TensorOut, dumps
from tailorstore.restore.reshard import resharded_trees
from tailorstore.store.repo import Repository


def load_tree(tree: Any, where: str) -> Any:
    """The object ``torch.load`` would return for a file written from ``tree``, built in memory:
    each tensor's bytes decoded once into the storage the object keeps."""
    pickled, storages = dumps(tree)

    def persistent_load(saved_id: Any) -> Any:
        if not (isinstance(saved_id, tuple) and len(saved_id) == 5 and saved_id[0] == "storage"):
            raise BadCheckpointError(f"{where}: a storage reference of an unknown form")
        tensor = storages[int(saved_id[2])]
        return torch.storage.TypedStorage(
            wrap_storage=_filled(tensor, where), dtype=dtype_from_name(tensor.dtype), _internal=True
        )

    with torch.serialization.safe_globals([*allowed_globals(), TensorSlot]):
        unpickler = weights_only.Unpickler(io.BytesIO(pickled), encoding="utf-8")
        unpickler.persistent_load = persistent_load  # type: ignore[attr-defined]
        try:
            return unpickler.load()
        except weights_only.UnpicklingError as exc:  # a global outside the allowlist: trust was needed
            raise untrusted(where) from exc


def _filled(tensor: TensorOut, where: str) -> torch.UntypedStorage:
    """A new storage holding ``tensor``'s bytes (each chunk hash-checked by the stream it comes from)."""
    buffer = torch.empty(tensor.nbytes, dtype=torch.uint8)
    view = memoryview(buffer.numpy()).cast("B")
    if tensor.fill is not None:  # decoded straight into the storage the object keeps
        tensor.fill(view)
        return buffer.untyped_storage()
    cursor = 0
    for chunk in tensor.chunks():
        size = chunk.nbytes if isinstance(chunk, memoryview) else len(chunk)
        if cursor + size > len(view):
            raise BadCheckpointError(f"{where}: a tensor's bytes run past its shape")
        view[cursor : cursor + size] = chunk
        cursor += size
    return buffer.untyped_storage()


@dataclass(frozen=True)
class StepObjects:
    """The torch files of one DeepSpeed tag folder, each built on demand by :meth:`load`."""

    step: int
    tag: str
    builders: dict[str, Callable[[], Any]]  # file name in the tag folder -> the function building its tree

    @property
    def names(self) -> list[str]:
        return sorted(self.builders)

    def load(self, name: str) -> Any:
        """The object of the file ``name`` (in the tag folder), as ``torch.load`` would return it."""
        try:
            build = self.builders[name]
        except KeyError:
            raise StoreError(f"step {self.step} holds no file {self.tag}/{name}") from None
        return load_tree(build(), f"step {self.step}, file {self.tag}/{name}")


def step_objects(
    repo: Repository, selector: str, *, world_size: int | None = None, zero_stage: int | None = None
) -> StepObjects:
    """The files DeepSpeed's ``load_checkpoint`` reads of the step ``selector`` names, for
    ``world_size`` ranks under ZeRO ``zero_stage`` (default: the save's own), without writing any.
    Only DeepSpeed saves of one tag folder; the caller keeps the rest on its other path."""
    manifest = repo.resolve(selector)
    facts = repo.manifest(manifest)
    refuse_thinned(facts.step, facts.tier, "a resume")
    if not facts.ds_tag:
        raise StoreError(f"step {facts.step} is not a DeepSpeed save; only DeepSpeed files load without staging")
    same = (world_size is None or world_size == facts.world_size) and (
        zero_stage is None or zero_stage == facts.zero_stage
    )
    if not facts.zero_stage or same:  # the files as saved (ZeRO 0 loads at any world size as it is)
        builders: dict[str, Callable[[], Any]] = {}
        for row in repo.view(Contents).files(manifest):
            path = PurePosixPath(row.path)
            if row.kind == TORCH and path.parent.name == facts.ds_tag:
                where = f"step {facts.step}, file {row.path}"
                builders[path.name] = lambda row=row, where=where: committed_tree(repo, manifest, row, where)
        return StepObjects(facts.step, facts.ds_tag, builders)
    tag, trees = resharded_trees(repo, selector, world_size=world_size or 1, zero_stage=zero_stage)
    return StepObjects(facts.step, tag, trees)
