"""Layer labels (core/layers.py): a tensor's name gives its layer, and layers sort in model order."""

from __future__ import annotations

import pytest

from tailorstore.core.layers import layer_of, sort_key


@pytest.mark.parametrize(
    ("name", "label"),
    [
        ("model.layers.7.mlp.up_proj.weight", "block.7"),
        ("transformer.h.12.attn.c_attn.weight", "block.12"),
        ("layers.3.attention.wq.weight", "block.3"),
        ("model.embed_tokens.weight", "embedding"),
        ("transformer.wte.weight", "embedding"),
        ("model.norm.weight", "final_norm"),
        ("transformer.ln_f.bias", "final_norm"),
        ("lm_head.weight", "lm_head"),
        ("output.weight", "lm_head"),
        ("rotary.inv_freq", "other"),
    ],
)
def test_layer_labels(name: str, label: str) -> None:
    assert layer_of(name) == label


def test_layer_order() -> None:
    labels = ["lm_head", "block.10", "state", "embedding", "block.2", "final_norm"]
    assert sorted(labels, key=sort_key) == ["embedding", "block.2", "block.10", "final_norm", "lm_head", "state"]
