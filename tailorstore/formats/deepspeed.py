"""Cutting DeepSpeed's checkpoint files into atoms.

``split_tensors`` gives every tensor of a file; this module decides how each one is cut
and labelled: module weights per parameter, flat ZeRO partitions per parameter piece
(see :mod:`.zero_partitions`), ZeRO 0 optimizer state per parameter index. A tensor it
does not recognise becomes one atom of its own, labelled ``state``: still stored and
restored bit-exact, only never inherited by layer.
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tailorstore.core import atom_types as A
from tailorstore.core.errors import BadCheckpointError, LayoutError
from tailorstore.core.layers import STATE, layer_of
from tailorstore.core.local_files import Beneath
from tailorstore.formats.small_text import NAME_LIMIT, read_small_text
from tailorstore.formats.zero_partitions import Piece, check_slice_mappings, zero3_pieces, zero12_pieces

MODEL_STATES = re.compile(r"^(?:zero_pp_rank_(\d+)_)?mp_rank_(\d+)_model_states\.pt$")
OPTIM_STATES = re.compile(r"^(?:(bf16|fp16)_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
_OPTIMIZER_STATE_KINDS = (A.EXP_AVG, A.EXP_AVG_SQ, A.STEP)


@dataclass
class ModelInfo:
    """What a model-states file tells about the parameters, needed to cut optimizer files."""

    param_shapes: list[list[tuple[str, int]]] = field(default_factory=list)
    buffer_names: set[str] = field(default_factory=set)

    @property
    def all_params(self) -> list[str]:
        return [name for group in self.param_shapes for name, _ in group]


def file_rank(name: str) -> int:
    """The data-parallel rank that owns a file, from DeepSpeed's file naming."""
    for pattern in (OPTIM_STATES, MODEL_STATES):
        match = pattern.match(name)
        if match:
            groups = [g for g in match.groups() if g and g.isdigit()]
            return int(groups[0]) if len(groups) == 2 else 0
    match = re.search(r"rank_(\d+)", name)
    return int(match.group(1)) if match else 0


def is_model_states(name: str) -> bool:
    return MODEL_STATES.match(name) is not None


def is_optim_states(name: str) -> bool:
    return OPTIM_STATES.match(name) is not None


def has_latest(folder: Path) -> bool:
    """Whether ``folder`` holds DeepSpeed's ``latest`` file. One that is there but no file (a folder,
    a named pipe, a socket, a device, a link to nothing or to a folder) is refused, naming it: passed
    over as absent, it made a commit say the save "holds checkpoint folders of its own" and a resume
    load the store's newest step instead of the one the folder names."""
    latest = folder / "latest"
    try:
        mode = os.lstat(latest).st_mode
    except FileNotFoundError:
        return False
    except OSError as exc:
        raise BadCheckpointError(f"{latest}: cannot be read ({exc.strerror}).") from None
    if stat.S_ISREG(mode) or (stat.S_ISLNK(mode) and latest.is_file()):  # a link: read_latest decides
        return True
    raise BadCheckpointError(
        f"{latest}: DeepSpeed's `latest` is not a file here, so it names no tag folder. Replace it with "
        "a file holding the tag's name, or remove it."
    )


def read_latest(folder: Path) -> str:
    """The tag DeepSpeed's ``latest`` file in ``folder`` names (one line; read at a bound)."""
    return read_small_text(Beneath(folder, "latest"), "DeepSpeed's `latest` (a tag name)", NAME_LIMIT).strip()


def model_info(obj: Any) -> ModelInfo:
    info = ModelInfo()
    shapes = obj.get("param_shapes") if isinstance(obj, dict) else None
    if isinstance(shapes, dict):
        shapes = [shapes]
    for group in shapes or []:
        info.param_shapes.append([(name, _numel(shape)) for name, shape in group.items()])
    info.buffer_names = set(obj.get("buffer_names") or []) if isinstance(obj, dict) else set()
    return info


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def whole(entry: A.TensorEntry, param: str, kind: str, rank: int, layer: str | None = None) -> None:
    n = entry.tensor.numel()
    entry.segments = [A.Segment(0, n, param, kind, rank, 0, layer or layer_of(param))] if n else []


def generic(entry: A.TensorEntry, rank: int) -> None:
    """One atom for a tensor we do not recognise; its path in the file is its name."""
    leaf = entry.path.rsplit("/", 1)[-1]
    kind = leaf if leaf in _OPTIMIZER_STATE_KINDS else A.TENSOR
    whole(entry, entry.path, kind, rank, STATE)


def cut(entry: A.TensorEntry, pieces: list[Piece], kind: str, rank: int, group: int) -> None:
    entry.segments = [
        A.Segment(
            offset=p.offset,
            numel=p.numel,
            param=p.param if p.param is not None else f"group.{group}.padding",
            kind=kind if p.param is not None else f"{kind}.padding",
            rank=rank,
            start=p.start,
            layer=layer_of(p.param) if p.param is not None else STATE,
        )
        for p in pieces
    ]


def _zero0_param_names(obj: dict, info: ModelInfo, opt_sd: object) -> list[str]:
    """Parameter names in optimizer order for ZeRO 0, whose model-states file has no param_shapes.

    Only safe with one param group: then the optimizer holds the parameters in module order,
    which is the order of ``module`` without its buffers.
    """
    groups = opt_sd.get("param_groups") if isinstance(opt_sd, dict) else None
    module = obj.get("module")
    if info.all_params or not isinstance(groups, list) or len(groups) != 1 or not isinstance(module, dict):
        return info.all_params
    names = [name for name in module if name not in info.buffer_names]
    if len(names) == len(groups[0].get("params", [])):
        info.param_shapes = [[(name, int(module[name].numel())) for name in names]]
    return info.all_params


def segment_model_states(obj: dict, entries: list[A.TensorEntry], rank: int, info: ModelInfo) -> None:
    optimizer = obj.get("optimizer")
    # ZeRO 0 keeps the torch optimizer inside the model-states file, indexed by parameter order.
    opt_sd = optimizer.get("optimizer_state_dict", optimizer) if isinstance(optimizer, dict) else None
    names = _zero0_param_names(obj, info, opt_sd)
    index_to_name: dict[str, str] = {}
    if isinstance(opt_sd, dict) and isinstance(opt_sd.get("param_groups"), list):
        indices = [str(i) for g in opt_sd["param_groups"] for i in g.get("params", [])]
        if len(indices) == len(names):
            index_to_name = dict(zip(indices, names, strict=True))
    state_prefix = (
        "optimizer/optimizer_state_dict/state/" if "optimizer_state_dict" in (optimizer or {}) else ("optimizer/state/")
    )
    for entry in entries:
        parts = entry.path.split("/")
        if parts[0] == "module" and len(parts) == 2:
            kind = A.BUFFER if parts[1] in info.buffer_names else A.WEIGHT
            whole(entry, parts[1], kind, rank)
        elif entry.path.startswith(state_prefix) and len(parts) == len(state_prefix.split("/")) + 1:
            index, kind = parts[-2], parts[-1]
            name = index_to_name.get(index)
            if name is None:
                generic(entry, rank)
            else:
                whole(entry, name, kind, rank, STATE if kind == A.STEP else None)
        elif parts[:2] == ["optimizer", "fp32_groups"] and len(parts) == 4:
            g, i = int(parts[2]), int(parts[3])
            if g < len(info.param_shapes) and i < len(info.param_shapes[g]):
                whole(entry, info.param_shapes[g][i][0], A.MASTER, rank)
            else:
                generic(entry, rank)
        else:
            generic(entry, rank)


def segment_optim_states(obj: dict, entries: list[A.TensorEntry], rank: int, info: ModelInfo, where: str) -> None:
    osd = obj.get("optimizer_state_dict")
    if not isinstance(osd, dict):
        raise LayoutError(f"{where}: no 'optimizer_state_dict' in a DeepSpeed optimizer-states file")
    if "fp32_flat_groups" in osd:
        _segment_zero3(osd, entries, rank, info, where)
    elif "single_partition_of_fp32_groups" in osd:
        _segment_zero12(osd, entries, rank, info, where)
    else:
        for entry in entries:
            generic(entry, rank)


def group_of_state_key(param_groups: list[dict]) -> dict[str, int]:
    """Flat optimizer state is keyed by the flat param's index; map it to its group."""
    return {str(p): g for g, group in enumerate(param_groups) for p in group.get("params", [])}


def _segment_flat(
    entries: list[A.TensorEntry],
    rank: int,
    master_prefix: str,
    state_prefix: str,
    group_keys: dict[str, int],
    pieces_for: Callable[[int, int], list[Piece] | None],
    where: str,
) -> None:
    """Cut the flat master and optimizer-state tensors of every group at parameter boundaries.

    ``pieces_for(group, numel)`` gives the cut of a flat tensor of that length, or None when
    the length cannot be a partition of that group (then the tensor is an error or a scalar).
    """
    for entry in entries:
        parts = entry.path.split("/")
        group: int | None = None
        kind = ""
        if entry.path.startswith(master_prefix) and len(parts) == len(master_prefix.split("/")):
            group, kind = int(parts[-1]), A.MASTER
        elif entry.path.startswith(state_prefix) and len(parts) == len(state_prefix.split("/")) + 1:
            group, kind = group_keys.get(parts[-2]), parts[-1]
        if group is None:
            generic(entry, rank)
            continue
        if kind == A.STEP or entry.tensor.dim() == 0:
            whole(entry, f"group.{group}", kind, rank, STATE)
            continue
        pieces = pieces_for(group, entry.tensor.numel()) if entry.tensor.dim() == 1 else None
        if pieces is None:
            raise LayoutError(
                f"{where}: {entry.path} has {entry.tensor.numel()} elements, which does not fit group {group}'s "
                "partition; the file does not match its param_shapes"
            )
        cut(entry, pieces, kind, rank, group)


def _segment_zero12(osd: dict, entries: list[A.TensorEntry], rank: int, info: ModelInfo, where: str) -> None:
    flats = osd["single_partition_of_fp32_groups"]
    _check_group_count(len(flats), info, where)
    paddings = osd.get("param_alignment_paddings")
    mappings = osd.get("param_slice_mappings")
    group_paddings = osd.get("group_paddings") or [0] * len(flats)
    # The last rank saves its FP32 partition without the group padding, its Adam moments with it.
    partitions = [flat.numel() + int(group_paddings[g]) for g, flat in enumerate(flats)]
    for g, flat in enumerate(flats):
        if mappings:
            pieces = zero12_pieces(
                info.param_shapes[g], paddings[g] if paddings else None, rank, partitions[g], flat.numel()
            )
            try:
                check_slice_mappings(pieces, mappings[g])
            except LayoutError as exc:
                raise LayoutError(f"{where}, group {g}: {exc}") from None

    def pieces_for(group: int, numel: int) -> list[Piece] | None:
        if group >= len(partitions) or not partitions[group] - int(group_paddings[group]) <= numel <= partitions[group]:
            return None
        return zero12_pieces(
            info.param_shapes[group], paddings[group] if paddings else None, rank, partitions[group], numel
        )

    base = osd.get("base_optimizer_state", {})
    keys = group_of_state_key(base.get("param_groups", [])) if isinstance(base, dict) else {}
    _segment_flat(
        entries,
        rank,
        "optimizer_state_dict/single_partition_of_fp32_groups/",
        "optimizer_state_dict/base_optimizer_state/state/",
        keys,
        pieces_for,
        where,
    )


def _check_group_count(flat_groups: int, info: ModelInfo, where: str) -> None:
    if flat_groups != len(info.param_shapes):
        raise LayoutError(
            f"{where}: {flat_groups} flat groups, but the model-states file lists {len(info.param_shapes)} "
            "param groups; the files come from different runs"
        )


def _segment_zero3(osd: dict, entries: list[A.TensorEntry], rank: int, info: ModelInfo, where: str) -> None:
    flats = osd["fp32_flat_groups"]
    world = osd.get("partition_count")
    world = max(world) if isinstance(world, list) else int(world)
    _check_group_count(len(flats), info, where)
    sizes = [flat.numel() for flat in flats]

    def pieces_for(group: int, numel: int) -> list[Piece] | None:
        if group >= len(sizes) or numel != sizes[group]:
            return None
        return zero3_pieces(info.param_shapes[group], world, rank, numel)

    for g in range(len(flats)):
        pieces_for(g, sizes[g])  # raises LayoutError early when param_shapes do not fit
    inner = osd.get("optimizer_state_dict", {})
    keys = group_of_state_key(inner.get("param_groups", [])) if isinstance(inner, dict) else {}
    _segment_flat(
        entries,
        rank,
        "optimizer_state_dict/fp32_flat_groups/",
        "optimizer_state_dict/optimizer_state_dict/state/",
        keys,
        pieces_for,
        where,
    )


def run_facts(obj: Any) -> dict[str, int]:
    """Step, ZeRO stage and data-parallel world size, as a model-states file records them."""
    facts: dict[str, int] = {}
    if not isinstance(obj, dict):
        return facts
    if isinstance(obj.get("global_steps"), int):
        facts["global_steps"] = obj["global_steps"]
    if isinstance(obj.get("dp_world_size"), int):
        facts["world_size"] = obj["dp_world_size"]
    config = obj.get("ds_config")
    if isinstance(config, dict):
        stage = (config.get("zero_optimization") or {}).get("stage")
        facts["zero_stage"] = int(stage) if stage is not None else 0
    return facts
