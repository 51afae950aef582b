"""Reading a checkpoint directory into skeletons and atoms, one file at a time.

Files stream through one by one. Each is read through one :class:`InputFile` descriptor and
checked not to change while it is read; tensors are described (dtype, shape, file offset) by
*meta* tensors that hold no data, and their bytes are copied out of the file, piece by piece,
only when a commit stores them (see ``source``). Each file becomes one of three kinds:

* ``torch``: a DeepSpeed or torch pickle, cut into atoms. A plain ``torch.save`` zip is read
  without torch (``torch_pickle``: a restricted unpickler turns tensors into descriptors);
  its skeleton is the file's own pickle record. Other files go through torch
  (``torch_fallback``), and their skeleton is the object tree with tensors replaced by
  slots, saved with ``torch.save``. Either way the container is every byte of the file
  outside the tensors (see ``torch_zip``);
* ``safetensors``: the header bytes as skeleton and container, one atom per tensor;
* ``dcp``: a DCP ``.distcp`` file, cut with its folder's ``.metadata`` (``formats/dcp``): one
  atom per tensor item, the rest of the file its container;
* ``raw``: any other file, kept whole as one blob (configs, RNG states, scripts, the
  pickled TrainingArguments, which we never unpickle).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from tailorstore.core import atom_types as A
from tailorstore.core.atom_types import TensorEntry
from tailorstore.core.errors import BadCheckpointError, UnsafePickleError
from tailorstore.core.local_files import Beneath, Where, stat_input
from tailorstore.formats import dcp, plain_torch
from tailorstore.formats import deepspeed as ds
from tailorstore.formats.kinds import DCP, RAW, SAFETENSORS, TORCH
from tailorstore.formats.layout import MEGATRON, CheckpointLayout
from tailorstore.formats.safetensors_file import read_safetensors
from tailorstore.formats.skeleton import split_tensors
from tailorstore.formats.source import Identity, InputFile
from tailorstore.formats.torch_pickle import read_torch_zip
from tailorstore.formats.torch_zip import gaps

# Generic torch files that hold model or optimizer tensors worth cutting into atoms.
_TORCH_NAMES = ("optimizer.pt", "pytorch_model.bin")
# Other names torch.save files go by: cut into atoms when the torch-free reader takes them and
# they hold tensors, else kept whole (``training_args.bin`` pickles a class we never load).
_MAYBE_TORCH = (".pt", ".pth", ".bin", ".ckpt", ".tar")
MAYBE_TORCH = "torch?"


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
    trusted: bool = False  # loading it needed --trust-pickles (a .distcp file: an object item beyond the allowlist)
    meta: dict[str, int] = field(default_factory=dict)  # step, ZeRO stage, world size, when the file says
    located: bool = False  # every tensor's file offset is known: tensors are meta, bytes come from the file
    tree: object = None  # the skeleton before pickling (torch files)
    identity: Identity | None = None  # the file as first opened; it must not change until the commit records it
    place: Where | None = None  # how it is opened again (beneath the folder committed); None: ``source`` itself

    def skeleton_blob(self) -> bytes:
        if self.skeleton is None:  # a file torch loaded: its tree is pickled only when a commit stores it
            from tailorstore.formats.torch_fallback import skeleton_bytes  # torch is imported already for such a file

            self.skeleton = skeleton_bytes(self.tree)
        return self.skeleton

    def release(self) -> None:
        """Drop the tensors (and so the file's memory map, once nothing else holds them)."""
        self.entries, self.tree = [], None

    def open(self) -> InputFile:
        """The file again, refused if it is no longer the file the first pass read."""
        return InputFile(self.where, self.identity)

    @property
    def where(self) -> Where:
        return self.source if self.place is None else self.place

    def container(self, src: InputFile) -> bytes | None:
        """The file's bytes outside its tensors (zip headers, pickle, safetensors header), in order.

        Checkout writes these around the tensors' bytes and gets the very same file back.
        """
        if not self.located:
            return None
        ranges = [(e.file_offset or 0, e.tensor.numel() * e.tensor.element_size()) for e in self.entries]
        return b"".join(bytes(src.read(offset, length)) for offset, length in gaps(self.size, ranges))

    def piece(self, src: InputFile, entry: TensorEntry, seg: A.Segment) -> memoryview:
        """A segment's bytes, in private memory: read from the file, or from a tensor loaded into memory."""
        size = entry.tensor.element_size()
        if self.located:
            return src.read((entry.file_offset or 0) + seg.offset * size, seg.numel * size)
        from tailorstore.formats.torch_fallback import tensor_bytes  # only a file torch loaded into memory gets here

        return tensor_bytes(entry.tensor)[seg.offset * size : (seg.offset + seg.numel) * size]


def classify(rel: str) -> str:
    name = PurePosixPath(rel).name
    if ds.is_model_states(name) or ds.is_optim_states(name) or name in _TORCH_NAMES:
        return TORCH
    if name.endswith(_MAYBE_TORCH):
        return MAYBE_TORCH
    if name.startswith("pytorch_model-") and name.endswith(".bin"):
        return TORCH
    if name.endswith(".safetensors"):
        return SAFETENSORS
    if dcp.is_distcp(name):
        return DCP
    return RAW


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
    dcp_metas: dict[str, dcp.DcpMetadata] = {}  # by folder
    for rel in layout.files if files is None else files:
        source, place = layout.source(rel), layout.place(rel)
        name = PurePosixPath(rel).name
        kind = classify(rel)
        rank = ds.file_rank(name) if kind == TORCH else dcp.file_rank(name) if kind == DCP else None
        with InputFile(place) as src:
            out = ReadFile(
                rel, layout.file_key(rel), kind, rank, src.size, src.mode, source, identity=src.identity, place=place
            )
            if kind == MAYBE_TORCH:
                out.kind = TORCH if _read_plain(out, src) else RAW
            elif kind == TORCH:
                _read_torch(out, src, trust_pickles, infos)
            elif kind == DCP:
                folder = source.parent
                if layout.dcp_metadata is not None:  # the DCP writer's: from the save plan
                    meta = layout.dcp_metadata
                else:
                    if str(folder) not in dcp_metas:
                        dcp_metas[str(folder)] = _dcp_metadata(folder, place, megatron=layout.kind == MEGATRON)
                    meta = dcp_metas[str(folder)]
                out.skeleton, out.entries, out.trusted = dcp.read_distcp(src, rel, meta, layout.where(rel))
                out.located, out.meta = True, {"world_size": meta.world_size}
            elif kind == SAFETENSORS:
                parsed = read_safetensors(src, str(source))
                if parsed is None:
                    out.kind = RAW
                else:
                    out.skeleton, out.entries = parsed
                    out.located = True
            src.check()
        yield out


def _read_plain(out: ReadFile, src: InputFile) -> bool:
    """A file that may be a plain torch.save: cut into atoms when the torch-free reader takes it
    and it holds tensors; False (keep it whole) for anything else, which is then never unpickled."""
    try:
        parsed = read_torch_zip(src, str(out.source))
    except (UnsafePickleError, BadCheckpointError):
        return False
    if parsed is None:
        return False
    obj, pickle_record = parsed
    entries = _located_entries(obj, str(out.source), out.size)
    if not any(e.tensor.numel() for e in entries):
        return False
    _segment_plain_or_generic(obj, entries)
    out.skeleton, out.located, out.entries = pickle_record, True, entries
    return True


def _located_entries(obj: object, where: str, size: int) -> list[TensorEntry]:
    """The tensors of a tree the torch-free reader loaded, each at its offset in the file."""
    _, entries = split_tensors(obj, where=where, file_size=size)
    for entry in entries:  # an empty tensor has no bytes, so no offset (as the torch fallback says)
        entry.file_offset = entry.tensor.file_offset if entry.tensor.numel() else None
    return entries


def _segment_plain_or_generic(obj: object, entries: list[TensorEntry]) -> None:
    """A torch file that is not DeepSpeed's: named by parameter where it is a model or training
    state (``plain_torch``), else one atom per tensor named by its path."""
    if not plain_torch.segment_plain(obj, entries):
        for entry in entries:
            ds.generic(entry, 0)


def _dcp_metadata(folder: Path, beside: Where, *, megatron: bool = False) -> dcp.DcpMetadata:
    """A DCP folder's ``.metadata``, checked against the sizes of its ``.distcp`` files; each opened
    by the rules of the ``.distcp`` file ``beside`` it (beneath the folder committed). ``megatron``:
    a Megatron save's, read with the planner classes it adds (``dcp.read_metadata``)."""
    path = folder / dcp.METADATA
    meta = beside.sibling(dcp.METADATA) if isinstance(beside, Beneath) else path
    if not path.is_file():
        raise BadCheckpointError(f"{folder}: .distcp files without the .metadata that says what they hold")
    sizes = {}
    for name in sorted(p.name for p in folder.iterdir() if dcp.is_distcp(p.name)):
        try:
            sizes[name] = stat_input(beside.sibling(name) if isinstance(beside, Beneath) else folder / name).st_size
        except OSError:
            continue  # no file of the step: refused when the commit opens it, if it commits it
    with InputFile(meta) as src:
        if src.size > dcp.MAX_METADATA:
            raise BadCheckpointError(f"{path}: {src.size} bytes, more than DCP metadata ever needs")
        data = bytes(src.read(0, src.size))
        src.check()
    return dcp.read_metadata(data, str(path), sizes, megatron=megatron)


def _read_torch(out: ReadFile, src: InputFile, trust_pickles: bool, infos: dict[str, ds.ModelInfo]) -> None:
    """Describe every tensor and cut it into segments: without torch for a plain torch.save zip,
    else through torch (see ``torch_fallback``)."""
    name = PurePosixPath(out.path).name
    where = str(out.source)
    parsed = None
    try:
        parsed = read_torch_zip(src, where)
    except UnsafePickleError:
        if not trust_pickles:
            raise
    if parsed is not None:
        obj, pickle_record = parsed
        entries = _located_entries(obj, where, out.size)
        out.skeleton, out.located = pickle_record, True
    else:
        # Importing torch costs about two seconds; only a file the torch-free reader cannot take pays it.
        from tailorstore.formats.torch_fallback import load_with_torch

        obj, out.tree, entries, out.located, out.trusted = load_with_torch(src, where, out.size, trust_pickles)
    folder = str(PurePosixPath(out.path).parent)
    if ds.is_model_states(name):
        info = ds.model_info(obj)
        out.meta = ds.run_facts(obj)
        infos.setdefault(folder, info)
        ds.segment_model_states(obj, entries, out.rank or 0, info)
    elif ds.is_optim_states(name):
        info = infos.get(folder, ds.ModelInfo())
        ds.segment_optim_states(obj, entries, out.rank or 0, info, where)
    else:
        _segment_plain_or_generic(obj, entries)
    out.entries = entries
