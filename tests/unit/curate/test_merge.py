"""Merge specs (curate/merge.py): what a spec names is what is parsed, and what it may not say."""

from __future__ import annotations

import pytest

from tailorstore.core.errors import MergeSpecError
from tailorstore.curate.merge import parse_spec


def spec(**over: object) -> dict:
    return {"base": {"step": 18}, "slices": [{"sources": [{"step": 6, "layer_range": [0, 2]}]}], **over}


def test_parse_spec_names_only_what_the_spec_names() -> None:
    base, chosen = parse_spec(spec(norm={"tag": "warm"}, lm_head={"id": 3}), list(range(6)), "s")
    assert base == "step=18"
    assert chosen == {"block.0": "step=6", "block.1": "step=6", "final_norm": "tag=warm", "lm_head": "id=3"}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {
                "slices": [
                    {"sources": [{"step": 6, "layer_range": [0, 4]}]},
                    {"sources": [{"step": 12, "layer_range": [3, 6]}]},
                ]
            },
            "overlap",
        ),
        ({"slices": [{"sources": [{"step": 6, "layer_range": [0, 9]}]}]}, "block 6 does not exist"),
        ({"slices": [{"sources": [{"step": 6}]}]}, "layer_range must be"),
        ({"slices": [{"sources": [{"step": 6, "layer_range": [3, 1]}]}]}, "layer_range must be"),
        ({"slices": [{"sources": [{"step": 6, "tag": "x", "layer_range": [0, 1]}]}]}, "one of step, tag or id"),
        ({"slices": [{"sources": [{"a": 1}, {"b": 2}]}]}, "exactly one source"),
        ({"slices": []}, "non-empty list"),
        ({"base": {"step": -1}}, "not a valid step"),
        ({"base": {"tag": ""}}, "not a valid tag"),
        ({"weights": 1}, "unknown keys"),
    ],
)
def test_parse_spec_refusals(change: dict, message: str) -> None:
    with pytest.raises(MergeSpecError, match=message):
        parse_spec(spec(**change), list(range(6)), "s")


def test_parse_spec_on_a_model_without_numbered_blocks() -> None:
    """A model whose names hold no layers.N (any DeepSpeed model commits) has no blocks to slice:
    a message saying so, not max() of an empty list."""
    with pytest.raises(MergeSpecError, match="block 0 does not exist; the model has no numbered blocks"):
        parse_spec(spec(), [], "s")
