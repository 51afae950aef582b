"""A manifest seen as a model: each parameter's full shape and the atoms that hold its values.

DeepSpeed scatters a parameter's FP32 master over the ranks' flat partitions; the index
records each piece's parameter and element range, and the model-states file's own pickle
(kept as the file's skeleton) records the full shapes (``param_shapes``), the buffers and the
tied parameters. Together they say, for every tensor of the model's state dict, which atoms
tile it, without reading a byte of tensor data. Export reads tensors through
:func:`read_float32`, one at a time (memory at the largest tensor); the universal and
resharded writers stream them (:func:`stream_elements`), so their memory stays at a chunk.

Values come from the FP32 master where there is one (what ``zero_to_fp32`` returns), else from
the module's own weight (ZeRO 0 in fp32, frozen parameters), widened exactly to float32.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import PurePosixPath
from typing import Any

import numpy as np

from tailorstore.access.atom_reader import blob_of, decode_atom_into, decode_stored_atom, stream_atom
from tailorstore.access.contents import Contents
from tailorstore.access.dcp_folders import dcp_folders, folder_metadata
from tailorstore.core.atom_types import BUFFER, EXP_AVG, EXP_AVG_SQ, MASTER, STEP, WEIGHT, TensorSlot
from tailorstore.core.errors import Call, CorruptStoreError, StoreError
from tailorstore.core.layers import STATE
from tailorstore.core.records import AtomRecord, BlobRecord, FileRecord, ManifestRecord
from tailorstore.core.rounding import widened
from tailorstore.core.tensor_ref import DTYPES, numel_of
from tailorstore.formats import dcp
from tailorstore.formats import deepspeed as ds
from tailorstore.formats.kinds import DCP, TORCH
from tailorstore.formats.layout import MEGATRON
from tailorstore.formats.skeleton import fill_tensors, slots_of, split_tensors
from tailorstore.formats.torch_pickle import load_pickle_tree
from tailorstore.formats.torch_save_writer import TensorOut
from tailorstore.store.repo import BlobReader, StepReader


@dataclass(frozen=True)
class ModelTensor:
    """One tensor of the state dict: its shape, the dtype its atoms hold, and the atoms in order."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # of the atoms: float32 for masters
    atoms: tuple[AtomRecord, ...]  # tile elements [0, numel) in order
    kind: str  # master, weight or buffer

    @property
    def numel(self) -> int:
        return numel_of(self.shape)

    @property
    def floating(self) -> bool:
        return DTYPES[self.dtype].is_float


@dataclass
class ModelView:
    manifest: int
    step: int
    tensors: list[ModelTensor]
    aliases: dict[str, str] = field(default_factory=dict)  # tied name -> the name it shares storage with
    rows: dict[str, BlobRecord] = field(default_factory=dict)  # the blob rows of every stored atom, looked up once
    zero_stage: int | None = None
    world_size: int | None = None
    pieces: dict[tuple[str, str], list[AtomRecord]] = field(default_factory=dict)  # (param, kind) -> atoms
    groups: dict[str, int] = field(default_factory=dict)  # trainable parameter -> its param group
    module_names: list[str] = field(default_factory=list)  # the module's state-dict keys, in order
    states_file: FileRecord | None = None  # rank 0's model-states file

    def state(self, name: str, kind: str, shape: tuple[int, ...]) -> ModelTensor:
        """A parameter's optimizer state of ``kind`` (exp_avg, exp_avg_sq) as one tensor of ``shape``."""
        return _tensor(name, shape, self.pieces, (kind,), f"step {self.step}")

    def moments(self, name: str) -> list[str]:
        """The Adam moments the step holds for a parameter: both, or none for a save made before
        the first optimizer step (AdamW creates them at its first step)."""
        return [kind for kind in (EXP_AVG, EXP_AVG_SQ) if self.pieces.get((name, kind))]


_VIEWED = (MASTER, WEIGHT, BUFFER, EXP_AVG, EXP_AVG_SQ, STEP)


def model_states_file(files: list[FileRecord], step: int) -> FileRecord:
    """Rank 0's model-states file (every rank's holds the same shapes and names)."""
    found = [f for f in files if f.kind == TORCH and ds.is_model_states(PurePosixPath(f.path).name)]
    if not found:
        raise StoreError(
            f"step {step} holds no DeepSpeed model-states file (*model_states.pt); export and the universal layout "
            "read DeepSpeed checkpoints. A plain HF checkpoint already holds model.safetensors."
        )
    folders = {str(PurePosixPath(f.path).parent) for f in found}
    if len(folders) != 1:
        raise StoreError(
            f"step {step} holds model-states files in {len(folders)} folders ({', '.join(sorted(folders))}); "
            "commit one tag folder per step to export it."
        )
    return min(found, key=lambda f: (f.rank or 0, f.path))


def rank0_optimizer_file(files: list[FileRecord], folder: str) -> FileRecord | None:
    """Rank 0's DeepSpeed optimizer-states file in the tag folder ``folder``, if the step holds one."""
    for f in files:
        name = PurePosixPath(f.path)
        if f.kind == TORCH and ds.is_optim_states(name.name) and str(name.parent) == folder and not f.rank:
            return f
    return None


def skeleton_tree(repo: BlobReader, row: FileRecord, where: str) -> Any:
    """The object tree a committed torch file's skeleton describes, tensors as shapes only."""
    data = repo.read_blob(row.blob, where)
    if data[:2] != b"PK":  # the file's own data.pkl (committed without torch)
        return load_pickle_tree(data, where)
    # A skeleton torch.save wrote (a file that needed torch to commit): torch reads it back.
    from tailorstore.formats.safe_load import load_skeleton  # imports torch, which only such a file needs

    return load_skeleton(data, where, trusted=row.trusted, trust_pickles=False)


def _shapes(tree: dict, key: str) -> dict[str, tuple[int, ...]]:
    groups = tree.get(key) or []
    out: dict[str, tuple[int, ...]] = {}
    for group in groups if isinstance(groups, list) else [groups]:
        if isinstance(group, dict):
            out.update({str(name): tuple(int(d) for d in shape) for name, shape in group.items()})
    return out


def tiling(pieces: list[AtomRecord], numel: int) -> tuple[AtomRecord, ...] | None:
    """The pieces that cover [0, numel) end to end, or None when they do not."""
    unique = {(p.start, p.numel): p for p in pieces if p.numel}
    chosen, cursor = [], 0
    for (start, n), piece in sorted(unique.items()):
        if start < cursor:
            continue  # the same range again (another file's copy)
        if start != cursor:
            return None
        chosen.append(piece)
        cursor += n
    return tuple(chosen) if cursor == numel else None


def model_view(repo: StepReader, manifest: int) -> ModelView:
    """Every tensor of the model's state dict at ``manifest``, in DeepSpeed's parameter order
    (for a DCP step, in the order its ``.metadata`` lists them)."""
    facts = repo.manifest(manifest)
    files = repo.view(Contents).files(manifest)
    if facts.layout == MEGATRON:
        raise StoreError(
            f"step {facts.step} is a Megatron-Core save, which tailorstore does not read as one model yet (its "
            "tensor-parallel shards joined, its fused QKV and MLP weights split into their modules' names); check "
            "it out (", Call("checkout", f"step={facts.step}", out="DIR"), ") and load it with dist_checkpointing.load."
        )
    if any(f.kind == DCP for f in files) and not any(f.kind == TORCH for f in files):
        return _dcp_view(repo, facts, files)
    if not any(f.kind == TORCH and ds.is_model_states(PurePosixPath(f.path).name) for f in files):
        return _plain_view(repo, facts)
    states = model_states_file(files, facts.step)
    where = f"step {facts.step}, file {states.path}"
    tree = skeleton_tree(repo, states, where)
    if not isinstance(tree, dict):
        raise CorruptStoreError(f"{where}: the model-states pickle is not a dict")
    shapes = _shapes(tree, "param_shapes")
    frozen = _shapes(tree, "frozen_param_shapes")
    buffer_names = [str(n) for n in tree.get("buffer_names") or []]
    shared = {str(k): str(v) for k, v in (tree.get("shared_params") or {}).items()}
    module = tree.get("module") if isinstance(tree.get("module"), dict) else {}
    if not shapes:  # ZeRO 0 records no param_shapes: the module's own tensors are full size
        shapes = {str(k): tuple(v.shape) for k, v in module.items() if k not in buffer_names and hasattr(v, "shape")}

    by_param = _pieces(repo.view(Contents), manifest)
    tensors: list[ModelTensor] = []
    for name in buffer_names:
        ref = module.get(name)
        if ref is None or not hasattr(ref, "shape"):
            continue  # a non-persistent buffer: not in the state dict
        tensors.append(_tensor(name, tuple(ref.shape), by_param, (BUFFER, WEIGHT), where))
    for name, shape in frozen.items():
        tensors.append(_tensor(name, shape, by_param, (WEIGHT,), where, frozen=True))
    for name, shape in shapes.items():
        tensors.append(_tensor(name, shape, by_param, (MASTER, WEIGHT), where))
    stored = {a.blob for t in tensors for a in t.atoms if a.derived is None}
    rows = {digest: blob_of(repo, digest, where) for digest in stored}
    groups = {}
    raw_groups = tree.get("param_shapes") or []
    for g, group in enumerate(raw_groups if isinstance(raw_groups, list) else [raw_groups]):
        groups.update({str(name): g for name in group} if isinstance(group, dict) else {})
    return ModelView(
        manifest,
        facts.step,
        tensors,
        shared,
        rows,
        facts.zero_stage,
        facts.world_size,
        dict(by_param),
        groups,
        [str(k) for k in module],
        states,
    )


def _pieces(contents: Contents, manifest: int) -> dict[tuple[str, str], list[AtomRecord]]:
    """The manifest's atoms of the kinds a model view reads, by (parameter, kind)."""
    by_param: dict[tuple[str, str], list[AtomRecord]] = defaultdict(list)
    for atom in contents.atoms(manifest):
        if atom.kind in _VIEWED:
            by_param[(atom.param, atom.kind)].append(atom)
    return by_param


def _dcp_view(repo: StepReader, facts: ManifestRecord, files: list[FileRecord]) -> ModelView:
    """A DCP step as a model: each model parameter's full shape from its folder's ``.metadata``
    (kept whole, and read again as hostile input), tiled by its chunks' atoms."""
    step = facts.step
    by_param = _pieces(repo.view(Contents), facts.id)
    tensors: list[ModelTensor] = []
    for folder in dcp_folders(files):
        meta, _ = folder_metadata(repo, step, files, folder)
        where = f"step {step}, file {folder + '/' if folder else ''}{dcp.METADATA}"
        for fqn, info in meta.tensors.items():
            param, kind, is_model = dcp.name_and_kind(fqn, meta.paths.get(fqn), info.dtype)
            if is_model and kind in (MASTER, WEIGHT):
                tensors.append(_tensor(param, info.size, by_param, (kind,), where))
    if not tensors:
        raise StoreError(f"step {step} holds no model parameters in its DCP folders (keys model.<name>)")
    return _view(repo, facts, tensors, by_param)


def _plain_view(repo: StepReader, facts: ManifestRecord) -> ModelView:
    """A step without DeepSpeed's or DCP's bookkeeping (an HF Trainer's ``model.safetensors`` or
    ``pytorch_model.bin``, a plain ``torch.save`` or safetensors folder) as a model: its tensors
    are the atoms of the model's kinds outside layer ``state`` (section 4.3 of docs/FORMAT.md names
    them: master, weight, buffer), each parameter's pieces tiling it, in the order the files hold
    them. A parameter held by two files with different values is refused: which one is the model
    cannot be told."""
    step = facts.step
    by_param = _pieces(repo.view(Contents), facts.id)
    found: dict[str, list[AtomRecord]] = defaultdict(list)
    for (param, kind), pieces in by_param.items():
        if kind in (MASTER, WEIGHT, BUFFER):
            found[param].extend(p for p in pieces if p.layer != STATE)
    order = sorted((p for p in found if found[p]), key=lambda p: min((a.path, a.slot, a.offset) for a in found[p]))
    tensors: list[ModelTensor] = []
    for param in order:
        pieces = found[param]
        for kind in (MASTER, WEIGHT, BUFFER):  # the FP32 master where a file holds one
            held = [a for a in pieces if a.kind == kind]
            if held:
                break
        ranges: dict[tuple[int, int], set[str]] = defaultdict(set)
        for a in held:
            ranges[(a.start, a.numel)].add(a.blob)
        if any(len(blobs) > 1 for blobs in ranges.values()):
            paths = sorted({a.path for a in held})
            raise StoreError(
                f"step {step}: {param} is held by {', '.join(paths)} with different values; export one model: "
                "commit a folder that holds one copy of each parameter"
            )
        tensors.append(_tensor(param, _whole_shape(held, step), by_param, (kind,), f"step {step}"))
    if not tensors:
        raise StoreError(
            f"step {step} holds no model parameters (no DeepSpeed model states, DCP folder, safetensors or torch "
            "file of weights) to export"
        )
    return _view(repo, facts, tensors, by_param)


def _view(
    repo: BlobReader, facts: ManifestRecord, tensors: list[ModelTensor], by_param: dict
) -> ModelView:
    """The model of ``tensors`` (a tied weight once, under the name it keeps), with the blob rows
    of the pieces it reads."""
    names = [t.name for t in tensors]
    aliases = tied_embeddings(tensors)
    tensors = [t for t in tensors if t.name not in aliases]
    stored = {a.blob for t in tensors for a in t.atoms if a.derived is None}
    rows = {digest: blob_of(repo, digest, f"step {facts.step}") for digest in stored}
    return ModelView(
        facts.id, facts.step, tensors, aliases, rows, facts.zero_stage, facts.world_size, dict(by_param), {}, names
    )


def _whole_shape(pieces: list[AtomRecord], step: int) -> tuple[int, ...]:
    """A parameter's full shape from its pieces' own: one piece covering it whole is it; pieces of
    whole rows (equal trailing dimensions) stack along the first."""
    unique = sorted({(a.start, a.numel): tuple(json.loads(a.shape)) for a in pieces}.items())
    shapes = [shape for _, shape in unique]
    if len(shapes) == 1 and unique[0][0][0] == 0:
        return shapes[0]
    if shapes and all(len(x) >= 1 and x[1:] == shapes[0][1:] for x in shapes):
        return (sum(x[0] for x in shapes), *shapes[0][1:])
    raise StoreError(f"step {step}: the pieces of {pieces[0].param} do not tell its shape; it cannot be exported")


# The names Hugging Face ties when a config says tie_word_embeddings: the output projection to the
# input embedding. save_pretrained writes the input embedding once and from_pretrained ties it back.
_OUTPUT_EMBEDDING = re.compile(r"(^|\.)(lm_head|output|embed_out)\.weight$")
_INPUT_EMBEDDING = re.compile(r"(^|\.)(embed_tokens|tok_embeddings|wte|word_embeddings|embed_in)\.weight$")


def tied_embeddings(tensors: list[ModelTensor]) -> dict[str, str]:
    """Pure: output embeddings that are their input embedding (alias -> the name kept).

    DCP writes a tied tensor once under each name, so a DCP step cannot say what shares storage,
    as DeepSpeed's ``shared_params`` does. A tie is taken where an output embedding's pieces are
    the input embedding's, blob for blob: two separately trained (or separately initialised)
    matrices never are. Equal tensors of other names (two norms still at ones) are both kept."""
    inputs = {_pieces_key(t): t.name for t in tensors if _INPUT_EMBEDDING.search(t.name)}
    aliases = {}
    for tensor in tensors:
        kept = inputs.get(_pieces_key(tensor)) if _OUTPUT_EMBEDDING.search(tensor.name) else None
        if kept is not None:
            aliases[tensor.name] = kept
    return aliases


def _pieces_key(tensor: ModelTensor) -> tuple:
    return (tensor.shape, tensor.dtype, tuple((a.start, a.numel, a.blob) for a in tensor.atoms))


def _tensor(
    name: str,
    shape: tuple[int, ...],
    by_param: dict[tuple[str, str], list[AtomRecord]],
    kinds: tuple[str, ...],
    where: str,
    frozen: bool = False,
) -> ModelTensor:
    numel = numel_of(shape)
    for kind in kinds:
        pieces = by_param.get((name, kind), [])
        tiled = tiling(pieces, numel)
        if tiled and len({p.dtype for p in tiled}) == 1:
            return ModelTensor(name, shape, tiled[0].dtype, tiled, kind)
    if numel == 0:
        return ModelTensor(name, shape, "float32", (), kinds[0])
    if frozen:
        raise StoreError(
            f"{where}: the frozen parameter {name} is held only as per-rank fragments (ZeRO 3); "
            "tailorstore cannot consolidate it yet. Use DeepSpeed's zero_to_fp32 on a checkout."
        )
    raise CorruptStoreError(f"{where}: the pieces of {name} do not cover its {numel} elements; run ", Call("verify"))


def read_raw(repo: StepReader, view: ModelView, tensor: ModelTensor) -> memoryview:
    """The tensor's elements in the dtype its atoms hold, hash-checked. Stored atoms are read
    with the rows looked up by :func:`model_view`, so this runs on a reader thread too; a derived
    one (rebuilt from its master, which needs the index) only on the index's own thread."""
    size = DTYPES[tensor.dtype].itemsize
    out = memoryview(bytearray(tensor.numel * size))
    where = f"step {view.step}, {tensor.name}"
    for atom in tensor.atoms:
        dest = out[atom.start * size : (atom.start + atom.numel) * size]
        row = view.rows.get(atom.blob)
        if row is not None:
            decode_stored_atom(repo, row, dest, where)
        else:
            decode_atom_into(repo, view.manifest, atom, dest, where)
    return out


def read_float32(repo: StepReader, view: ModelView, tensor: ModelTensor) -> np.ndarray:
    """A floating tensor's values as float32 (flat): the master as stored, or a weight widened exactly."""
    raw = read_raw(repo, view, tensor)
    if tensor.dtype == "float32":
        return np.frombuffer(raw, dtype=np.float32)
    return np.ascontiguousarray(widened(raw, tensor.dtype), dtype=np.float32)


def look_up_rows(repo: BlobReader, view: ModelView, tensor: ModelTensor) -> None:
    """Add the blob rows of ``tensor``'s stored atoms to ``view.rows``, so that streaming it
    (:func:`stream_elements`) needs no SQL and can run on a writer thread."""
    where = f"step {view.step}, {tensor.name}"
    for atom in tensor.atoms:
        if atom.derived is None and atom.blob not in view.rows:
            view.rows[atom.blob] = blob_of(repo, atom.blob, where)


def stream_elements(
    repo: StepReader, view: ModelView, tensor: ModelTensor, start: int = 0, count: int | None = None
) -> Iterator[memoryview]:
    """Elements ``[start, start + count)`` of ``tensor`` as raw bytes in its atoms' dtype, in order,
    a chunk at a time (:func:`~tailorstore.access.atom_reader.stream_atom`: every atom hash-checked whole,
    each view valid until the next). Writers of whole files (universal, reshard) stream through
    this, so memory stays at a chunk, not at the largest tensor."""
    end = tensor.numel if count is None else start + count
    if not 0 <= start <= end <= tensor.numel:
        raise StoreError(f"step {view.step}: elements [{start}, {end}) lie outside {tensor.name} ({tensor.numel})")
    size = DTYPES[tensor.dtype].itemsize
    where = f"step {view.step}, {tensor.name}"
    for atom in tensor.atoms:
        lo, hi = max(start, atom.start), min(end, atom.start + atom.numel)
        if lo < hi:
            yield from stream_atom(
                repo, view.manifest, atom, (lo - atom.start) * size, (hi - atom.start) * size, where,
                view.rows.get(atom.blob),
            )  # fmt: skip


def stream_float32(
    repo: StepReader, view: ModelView, tensor: ModelTensor, start: int = 0, count: int | None = None
) -> Iterator[memoryview]:
    """:func:`stream_elements` as float32: a master as stored, a weight widened exactly chunk by chunk."""
    for piece in stream_elements(repo, view, tensor, start, count):
        yield piece if tensor.dtype == "float32" else memoryview(widened(piece, tensor.dtype)).cast("B")


def committed_tree(repo: StepReader, manifest: int, row: FileRecord, where: str) -> Any:
    """A committed torch file's object tree, each tensor a :class:`TensorOut` whose bytes stream
    from its atoms (hash-checked) only as it is written: a file is re-pickled holding a chunk at a time."""
    tree = skeleton_tree(repo, row, where)
    if slots_of(tree):  # a skeleton torch.save wrote already holds its slots
        skeleton, slots = tree, slots_of(tree)
    else:
        skeleton, entries = split_tensors(tree, where=where, file_size=row.raw_size)
        slots = [TensorSlot(e.slot, e.tensor.dtype, tuple(e.tensor.shape)) for e in entries]
    by_slot: dict[int, list[AtomRecord]] = defaultdict(list)
    for atom in repo.view(Contents).atoms(manifest, path=row.path):
        by_slot[atom.slot].append(atom)
    tensors = {
        s.slot: TensorOut(
            s.dtype,
            tuple(s.shape),
            partial(_slot_chunks, repo, manifest, s, by_slot[s.slot], where),
            fill=partial(_slot_fill, repo, manifest, s, by_slot[s.slot], where),
        )
        for s in slots
    }
    return fill_tensors(skeleton, tensors)


def _slot_fill(
    repo: StepReader, manifest: int, slot: TensorSlot, atoms: list[AtomRecord], where: str, dest: memoryview
) -> None:
    """A tensor slot's bytes decoded straight into ``dest`` (each atom hash-checked; a failed check
    raises, and the caller drops ``dest``)."""
    numel = numel_of(tuple(slot.shape))
    size = len(dest) // numel if numel else 0
    cursor = 0
    for atom in sorted(atoms, key=lambda a: a.offset):
        if atom.offset != cursor or atom.nbytes != atom.numel * size:
            raise CorruptStoreError(f"{where}: the atoms of tensor slot {slot.slot} leave a gap at element {cursor}")
        decode_atom_into(repo, manifest, atom, dest[cursor * size : (cursor + atom.numel) * size], where)
        cursor += atom.numel
    if cursor != numel:
        raise CorruptStoreError(f"{where}: the atoms of tensor slot {slot.slot} cover {cursor} of {numel} elements")


def _slot_chunks(
    repo: StepReader, manifest: int, slot: TensorSlot, atoms: list[AtomRecord], where: str
) -> Iterator[memoryview]:
    """A tensor slot's bytes streamed from its atoms in file order (a chunk in memory at a time)."""
    numel = numel_of(tuple(slot.shape))
    cursor = 0
    for atom in sorted(atoms, key=lambda a: a.offset):
        if atom.offset != cursor:
            raise CorruptStoreError(f"{where}: the atoms of tensor slot {slot.slot} leave a gap at element {cursor}")
        yield from stream_atom(repo, manifest, atom, 0, atom.nbytes, where)
        cursor += atom.numel
    if cursor != numel:
        raise CorruptStoreError(f"{where}: the atoms of tensor slot {slot.slot} cover {cursor} of {numel} elements")
