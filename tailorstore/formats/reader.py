"""Reading a checkpoint directory into skeletons and atoms, one file at a time.

Files stream through one by one, so memory holds at most one file's tensors (and those
memory-mapped). Each file becomes one of three kinds:

* ``torch``: a DeepSpeed or torch pickle, cut into atoms; its skeleton is the object
  tree with tensors replaced by slots, itself saved with ``torch.save``, and its container
  is every byte of the file outside the tensors (see ``torch_zip``);
* ``safetensors``: the header bytes as skeleton and container, one atom per tensor;
* ``raw``: any other file, kept whole as one blob (configs, RNG states, scripts, the
  pickled TrainingArguments, which we never unpickle).
"""

from __future__ import annotations

import io
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

import torch

from ..atoms import TensorEntry
from ..safe_load import load_torch_file
from . import deepspeed as ds
from .layout import CheckpointLayout
from .safetensors_file import read_safetensors
from .skeleton import split_tensors
from .torch_zip import gaps, locate_tensors

RAW = "raw"
TORCH = "torch"
SAFETENSORS = "safetensors"

# Generic torch files that hold model or optimizer tensors worth cutting into atoms.
_TORCH_NAMES = ("optimizer.pt", "pytorch_model.bin")


@dataclass
class ReadFile:
    path: str
    file_key: str
    kind: str
    rank: int | None
    size: int
    mode: int
    source: Path
    skeleton: bytes | None = None
    entries: list[TensorEntry] = field(default_factory=list)
    trusted: bool = False  # loading it needed --trust-pickles
    meta: dict[str, int] = field(default_factory=dict)  # step, ZeRO stage, world size, when the file says
    located: bool = False  # every tensor's file offset is known, so the file has a container
    tree: object = None  # the skeleton before pickling (torch files)

    def skeleton_blob(self) -> bytes:
        if self.skeleton is None:
            self.skeleton = skeleton_bytes(self.tree)
        return self.skeleton

    def release(self) -> None:
        """Drop the tensors (and so the file's memory map, once nothing else holds them)."""
        self.entries, self.tree = [], None

    def container(self) -> bytes | None:
        """The file's bytes outside its tensors (zip headers, pickle, safetensors header), in order.

        Checkout writes these around the tensors' bytes and gets the very same file back.
        """
        if not self.located:
            return None
        ranges = [(e.file_offset or 0, e.tensor.numel() * e.tensor.element_size()) for e in self.entries]
        fd = os.open(self.source, os.O_RDONLY)
        try:
            return b"".join(os.pread(fd, length, offset) for offset, length in gaps(self.size, ranges))
        finally:
            os.close(fd)


def classify(rel: str) -> str:
    name = PurePosixPath(rel).name
    if ds.is_model_states(name) or ds.is_optim_states(name) or name in _TORCH_NAMES:
        return TORCH
    if name.startswith("pytorch_model-") and name.endswith(".bin"):
        return TORCH
    if name.endswith(".safetensors"):
        return SAFETENSORS
    return RAW


def skeleton_bytes(skeleton: object) -> bytes:
    buf = io.BytesIO()
    torch.save(skeleton, buf)
    return buf.getvalue()


def write_order(layout: CheckpointLayout) -> list[str]:
    """Optimizer files first, then model states, then the rest.

    Reading the FP32 masters before the low-precision weights lets a commit decide whether
    a weight is derivable from its master while holding only one file in memory.
    """
    names = layout.files

    def rank(rel: str) -> int:
        name = PurePosixPath(rel).name
        return 0 if ds.is_optim_states(name) else 1 if ds.is_model_states(name) else 2

    return sorted(names, key=lambda rel: (rank(rel), names.index(rel)))


def read_checkpoint(
    layout: CheckpointLayout,
    *,
    trust_pickles: bool = False,
    files: list[str] | None = None,
    infos: dict[str, ds.ModelInfo] | None = None,
) -> Iterator[ReadFile]:
    """Yield the files one at a time, in ``files`` order (default: the layout's).

    Optimizer files are cut with the param_shapes of their folder's model-states file, so
    either the model-states file comes first, or ``infos`` holds what an earlier pass found.
    """
    infos = {} if infos is None else infos  # by the model-states file's folder
    for rel in layout.files if files is None else files:
        source = layout.root / rel
        st = source.stat()
        name = PurePosixPath(rel).name
        kind = classify(rel)
        rank = ds.file_rank(name) if kind == TORCH else None
        out = ReadFile(rel, layout.file_key(rel), kind, rank, st.st_size, st.st_mode & 0o777, source)
        if kind == TORCH:
            obj, out.trusted = load_torch_file(source, trust_pickles=trust_pickles)
            skeleton, entries = split_tensors(obj)
            folder = str(PurePosixPath(rel).parent)
            if ds.is_model_states(name):
                info = ds.model_info(obj)
                out.meta = ds.run_facts(obj)
                infos.setdefault(folder, info)
                ds.segment_model_states(obj, entries, rank or 0, info)
            elif ds.is_optim_states(name):
                info = infos.get(folder, ds.ModelInfo())
                ds.segment_optim_states(obj, entries, rank or 0, info, str(source))
            else:
                for entry in entries:
                    ds.generic(entry, 0)
            out.tree = skeleton  # pickled only when a commit stores it (skeleton_blob)
            out.entries = entries
            out.located = locate_tensors(source, entries)
        elif kind == SAFETENSORS:
            parsed = read_safetensors(source, str(source))
            if parsed is None:
                out.kind = RAW
            else:
                out.skeleton, out.entries = parsed
                out.located = True
        yield out
