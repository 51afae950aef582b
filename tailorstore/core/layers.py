"""Labels that say which layer of the model a parameter belongs to.

Layer-wise tailoring stores or inherits whole layers, so every atom is labelled once at
commit time. A transformer block is labelled by its index; the parts outside the blocks
fall into a few auxiliary groups. Anything that is not a model parameter at all (step
counters, padding, unknown tensors) is labelled ``state``: it always comes from the
manifest's own step and is never inherited.
"""

from __future__ import annotations

import re

EMBEDDING = "embedding"
FINAL_NORM = "final_norm"
LM_HEAD = "lm_head"
OTHER = "other"
STATE = "state"
AUX_GROUPS = (EMBEDDING, FINAL_NORM, LM_HEAD, OTHER)

_BLOCK = re.compile(r"(?:^|\.)(?:layers|layer|h|blocks|block|decoder\.layers|encoder\.layers)\.(\d+)\.")
_EMBED = re.compile(r"(embed|wte|wpe|tok_embeddings|word_embeddings|position_embeddings)")
_HEAD = re.compile(r"(^|\.)(lm_head|output|output_layer|embed_out|score)(\.|$)")  # output_layer: Megatron's
_NORM = re.compile(r"(norm|ln_f|final_layer_norm|final_layernorm)")


def block_label(index: int) -> str:
    return f"block.{index}"


def layer_of(param_name: str) -> str:
    """The layer label of a parameter name, e.g. ``model.layers.7.mlp.up_proj.weight`` -> ``block.7``."""
    match = _BLOCK.search(param_name)
    if match:
        return block_label(int(match.group(1)))
    if _HEAD.search(param_name):
        return LM_HEAD
    if _EMBED.search(param_name):
        return EMBEDDING
    if _NORM.search(param_name):
        return FINAL_NORM
    return OTHER


def block_index(label: str) -> int | None:
    """The block index of a label, or None for the auxiliary groups and ``state``."""
    if label.startswith("block."):
        return int(label.split(".", 1)[1])
    return None


def sort_key(label: str) -> tuple[int, int, str]:
    """Order labels as a model reads them: embedding, blocks, final norm, head, other, state."""
    index = block_index(label)
    if index is not None:
        return (1, index, "")
    order = {EMBEDDING: 0, FINAL_NORM: 2, LM_HEAD: 3, OTHER: 4, STATE: 5}
    return (order.get(label, 4), 0, label)
