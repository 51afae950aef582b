"""Averaging merges' rules (curate/averaging.py), without a training: the three methods'
coefficients, ranges of steps, chosen layers, and what a spec may not say. The merges of real
DeepSpeed runs are in tests/system/test_averaging.py."""

from __future__ import annotations

import math

import pytest

from tailorstore.core import atom_types as A
from tailorstore.core.errors import MergeSpecError
from tailorstore.curate.averaging import chosen_layers, coefficients, parse_average


def test_coefficients_of_the_three_methods() -> None:
    assert coefficients("sma", 4) == (0.25, 0.25, 0.25, 0.25)
    assert coefficients("wma", 3) == (1 / 6, 2 / 6, 3 / 6)
    assert coefficients("wma", 2, weights=[3, 1]) == (0.75, 0.25)
    # EMA's closed form equals the recursion ema = a*x + (1-a)*ema started at the oldest step
    alpha, xs = 0.3, [1.0, 10.0, 100.0, 1000.0]
    ema = xs[0]
    for x in xs[1:]:
        ema = alpha * x + (1 - alpha) * ema
    c = coefficients("ema", 4, alpha=alpha)
    assert math.isclose(sum(ci * x for ci, x in zip(c, xs, strict=True)), ema, rel_tol=1e-12)
    assert math.isclose(sum(c), 1.0, rel_tol=1e-12)
    assert coefficients("ema", 3, alpha=1.0) == (0.0, 0.0, 1.0)


def spec(**change: object) -> dict:
    return {"method": "sma", "steps": [9, 12], **change}


def test_a_range_of_steps() -> None:
    parsed = parse_average(spec(steps={"from": 6, "to": 18, "every": 4}, base={"tag": "warm"}), "s")
    assert parsed.steps == (6, 10, 14, 18)
    assert parsed.base == "tag=warm"
    assert parsed.kinds == (A.MASTER,)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"method": "median"}, "not one of sma, ema, wma"),
        ({"steps": [9]}, "at least two steps"),
        ({"steps": [12, 9]}, "oldest first"),
        ({"steps": [9, 9]}, "oldest first"),
        ({"steps": [9, -3]}, "list of step numbers"),
        ({"steps": {"from": 9, "to": 3, "every": 3}}, "0 <= from <= to"),
        ({"steps": {"from": 9, "to": 18}}, "from: N, to: M, every: K"),
        ({"steps": {"from": 0, "to": 10**12, "every": 1}}, "names 1,000,000,000,001 steps; an average takes at most"),
        ({"steps": list(range(10_001))}, "10,001 steps; an average takes at most 10,000"),
        ({"method": "ema"}, "0 < alpha <= 1"),
        ({"method": "ema", "alpha": 1.5}, "0 < alpha <= 1"),
        ({"alpha": 0.5}, "alpha belongs to method ema"),
        ({"method": "wma", "weights": [1]}, "2 numbers >= 0"),
        ({"method": "wma", "weights": [0, 0]}, "sum above 0"),
        ({"weights": [1, 2]}, "weights belong to method wma"),
        ({"kinds": ["weight"]}, "kinds is a list from master, exp_avg, exp_avg_sq"),
        ({"kinds": []}, "kinds is a list"),
        ({"layers": []}, "non-empty list"),
        ({"slices": []}, "unknown keys"),
        ({"base": {"step": -1}}, "not a valid step"),
    ],
)
def test_parse_average_refusals(change: dict, message: str) -> None:
    with pytest.raises(MergeSpecError, match=message):
        parse_average(spec(**change), "s")


def test_chosen_layers() -> None:
    model = ["block.0", "block.1", "block.2", "embedding", "final_norm", "lm_head", "state"]
    assert chosen_layers(None, model, "s") == set(model) - {"state"}
    assert chosen_layers(({"layer_range": [1, 3]}, "norm"), model, "s") == {"block.1", "block.2", "final_norm"}
    with pytest.raises(MergeSpecError, match="block 3 does not exist"):
        chosen_layers(({"layer_range": [2, 4]},), model, "s")
    with pytest.raises(MergeSpecError, match="not a layer of this model"):
        chosen_layers(("decoder",), model, "s")
