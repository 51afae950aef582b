"""Megatron-Core's ``torch_dist`` checkpoints: what a save folder holds, and what each chunk is.

``dist_checkpointing.save`` writes, in one ``iter_NNNNNNN/`` folder: rank 0's ``common.pt``
first (``torch.save`` of the non-sharded state), then DCP's ``__R_K.distcp`` files and
``.metadata`` (through Megatron's own planner, whose local plans the metadata also pickles),
then ``metadata.json`` (``{"sharded_backend": "torch_dist", ...}``), which Megatron reads as
"this checkpoint is complete"; Megatron-LM may add ``integrity.json`` after everything. A run
folder holds such folders and ``latest_checkpointed_iteration.txt``, which names the newest.

The tensors are DCP items keyed by their ``ShardedTensor`` key, not by module path: a
transformer block's tensors are stacked along a first axis, one entry per layer
(``decoder.layers.mlp.linear_fc1.weight`` of shape ``(layers, 256, 64)``), and the chunk's
offset on that axis is its layer. So a chunk is named ``decoder.layers.N.<rest>`` and labelled
``block.N``; its offsets within the layer keep chunks of one tensor apart (tensor parallel
shards), each a whole atom, so that a bf16 chunk and the FP32 main-parameter chunk of the same
shard pair up for derivation. Optimizer states are keyed as Megatron names them:
``optimizer.state.<kind>.<model key>`` (its regular and model-space distributed optimizers),
``optimizer.distributed.dp_group_idx_G....bucket_idx_K.<kind>`` (flat buffers that span layers).

This module reads nothing itself and imports no torch: layout detection and the DCP reader use it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from tailorstore.core import atom_types as A
from tailorstore.core.errors import BadCheckpointError
from tailorstore.core.layers import STATE, layer_of
from tailorstore.core.local_files import Beneath
from tailorstore.formats.small_text import NAME_LIMIT, read_small_text

COMMON = "common.pt"
CONFIG = "metadata.json"  # written last: Megatron's mark of a complete save
INTEGRITY = "integrity.json"  # Megatron-LM's SHA-256 of every file, rank 0, after everything
TRACKER = "latest_checkpointed_iteration.txt"
WRITTEN_LAST = (CONFIG, INTEGRITY)  # in this order, after every other file (checkout)
BACKEND = "torch_dist"
_LAYERS = "decoder.layers."
_ITER = re.compile(r"iter_(\d{1,12})")
_BUCKET = re.compile(r"optimizer\.distributed\.dp_group_idx_\d+\..*\.bucket_idx_\d+")
_KINDS = {"fp32_param": A.MASTER, "param": A.MASTER, "exp_avg": A.EXP_AVG, "exp_avg_sq": A.EXP_AVG_SQ}


def iteration_folder(iteration: int) -> str:
    """The folder Megatron-LM saves iteration ``iteration`` in (``iter_0000100``)."""
    return f"iter_{iteration:07d}"


def step_of(name: str) -> int | None:
    """The iteration an ``iter_NNNNNNN`` folder's name carries, or None."""
    match = _ITER.fullmatch(name)
    return int(match.group(1)) if match else None


def read_tracker(run: Path) -> tuple[str, int | None]:
    """(the folder, the step) that a run folder's ``latest_checkpointed_iteration.txt`` names: an
    iteration number, or ``release`` (a converted checkpoint of no iteration)."""
    text = read_small_text(Beneath(run, TRACKER), f"Megatron's {TRACKER} (an iteration number)", NAME_LIMIT).strip()
    if text == "release":
        return "release", None
    if not text.isdigit() or len(text) > 12:
        raise BadCheckpointError(
            f"{run / TRACKER}: holds {text[:40]!r}, not an iteration number; Megatron writes the number of the "
            "newest iteration saved (or 'release'). Point at the iter_NNNNNNN folder itself, or fix the file."
        )
    return iteration_folder(int(text)), int(text)


def is_megatron_folder(path: Path) -> bool:
    """A folder Megatron's ``dist_checkpointing.save`` wrote, finished or not: its ``metadata.json``
    or its ``common.pt`` beside DCP's files (the caller has seen ``.metadata`` and ``.distcp``)."""
    return (path / CONFIG).is_file() or (path / COMMON).is_file()


def check_complete(path: Path) -> None:
    """Refuse a Megatron folder without ``metadata.json`` (a save that did not finish: Megatron
    writes it last and refuses to load a folder without it), or of a backend not ``torch_dist``."""
    if not (path / CONFIG).is_file():
        raise BadCheckpointError(
            f"{path}: a Megatron save without {CONFIG}, which Megatron writes last, so the save did not finish "
            "(and Megatron will not load it); nothing was committed. Commit a save that finished."
        )
    text = read_small_text(Beneath(path, CONFIG), f"Megatron's {CONFIG}", NAME_LIMIT)
    try:
        backend = json.loads(text).get("sharded_backend")
    except (ValueError, AttributeError):
        backend = None
    if backend != BACKEND:
        raise BadCheckpointError(
            f"{path / CONFIG}: says sharded_backend {str(backend)[:40]!r}; tailorstore reads Megatron's "
            f"{BACKEND!r} saves only (the default of dist_checkpointing.save). Nothing was committed."
        )


def chunk_name(fqn: str, offsets: tuple[int, ...], sizes: tuple[int, ...], dtype: str) -> tuple[str, str, str]:
    """(atom name, kind, layer label) of one chunk of the ``ShardedTensor`` keyed ``fqn``.

    The name is the parameter, with a block's layer axis turned into its index, and ``@`` plus
    the chunk's offsets within it when the chunk is not the first (a tensor-parallel shard)."""
    kind, key = A.WEIGHT, fqn
    if fqn.startswith("optimizer.state.") and fqn.count(".") >= 3:
        state, key = fqn[len("optimizer.state.") :].split(".", 1)
        kind = _KINDS.get(state, state)
    elif _BUCKET.match(fqn) and "." in fqn:
        bucket, state = fqn.rsplit(".", 1)
        return bucket + _suffix(offsets), _KINDS.get(state, state), STATE
    elif not _model_key(fqn):
        return fqn + _suffix(offsets), A.TENSOR, STATE
    if key.startswith(_LAYERS) and len(offsets) > 1 and sizes[0] == 1 and not key[len(_LAYERS)].isdigit():
        key = f"{_LAYERS}{offsets[0]}.{key[len(_LAYERS) :]}"
        offsets = offsets[1:]
    return key + _suffix(offsets), kind, layer_of(key)


def _model_key(fqn: str) -> bool:
    """Whether a key is a model's tensor (GPTModel's, or a chunk of a virtual pipeline's ``model1``)."""
    top = fqn.split(".", 1)[0]
    return top in ("embedding", "decoder", "output_layer", "encoder", "mtp", "vision_model") or fqn.startswith(
        "language_model."
    )


def _suffix(offsets: tuple[int, ...]) -> str:
    return "@" + ",".join(map(str, offsets)) if any(offsets) else ""
