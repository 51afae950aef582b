"""The tailoring policies (core/policies.py): which layers a commit stores and which it
inherits, decided from the commit's facts alone (no store, no training)."""

from __future__ import annotations

import math

import pytest

from tailorstore.core.errors import PolicyError
from tailorstore.core.policies import PARAMETERS, POLICIES, CommitFacts, PolicySpec, decide, policy_spec

BLOCKS = [f"block.{i}" for i in range(6)]
LAYERS = frozenset([*BLOCKS, "embedding", "final_norm", "lm_head", "state"])
AUX = {"embedding", "final_norm", "lm_head", "state"}


def facts(index: int, changes: dict[str, float] | None = None, inheritable: frozenset[str] = LAYERS) -> CommitFacts:
    return CommitFacts(LAYERS, index, inheritable - {"state"}, changes)


def test_first_commit_stores_everything_whatever_the_policy() -> None:
    for name in ("full", "parity", "filter", "adaptive", "budget"):
        assert decide(PolicySpec(name, {"threshold": 1e9, "fraction": 0.01}), facts(0)) == LAYERS


def test_parity_alternates_blocks_and_the_aux_groups_join_the_lighter_half() -> None:
    # no sizes known: the aux groups alternate by count, in layer order
    assert decide(PolicySpec("parity"), facts(1)) == {"state", "final_norm", "block.1", "block.3", "block.5"}
    assert decide(PolicySpec("parity"), facts(2)) == {"state", "embedding", "lm_head", "block.0", "block.2", "block.4"}
    # a large vocabulary: embedding and head outweigh a half of the blocks and split between the halves
    sizes = {**dict.fromkeys(BLOCKS, 100), "embedding": 500, "lm_head": 500, "final_norm": 1, "state": 50}
    odd, even = (decide(PolicySpec("parity"), CommitFacts(LAYERS, i, LAYERS - {"state"}, None, sizes)) for i in (1, 2))
    big = {"embedding", "lm_head"}
    assert (odd & big, even & big) in (({"embedding"}, {"lm_head"}), ({"lm_head"}, {"embedding"}))
    assert odd & even == {"state"} and odd | even == LAYERS  # every group every other commit
    weights = [sum(sizes[name] for name in half - {"state"}) for half in (odd, even)]
    assert abs(weights[0] - weights[1]) <= 1, weights


def test_filter_keeps_edges_and_the_middle_every_e_th_commit() -> None:
    spec = PolicySpec("filter", {"keep_first": 1, "keep_last": 2, "every": 3})
    assert decide(spec, facts(1)) == AUX | {"block.0", "block.4", "block.5"}
    assert decide(spec, facts(3)) == LAYERS
    with pytest.raises(PolicyError):
        decide(PolicySpec("filter", {"every": 0}), facts(1))


def test_adaptive_stores_exactly_the_blocks_that_moved_enough() -> None:
    changes = {"block.0": 0.5, "block.1": 1e-4, "block.2": 2e-3, "block.3": 1e-3, "block.4": 0.0}
    chosen = decide(PolicySpec("adaptive", {"threshold": 1e-3}), facts(4, changes))
    # block.5 has no measured change (nothing to compare with): stored, to be safe.
    assert chosen == AUX | {"block.0", "block.2", "block.3", "block.5"}
    for bad in (-1, float("nan"), float("inf")):  # nan and inf would never store a block again
        with pytest.raises(PolicyError, match="a finite number"):
            decide(PolicySpec("adaptive", {"threshold": bad}), facts(1, changes))


def test_a_layer_whose_change_is_nan_is_stored() -> None:
    """A master gone NaN makes its change NaN, which is below no threshold and sorts nowhere:
    inherited, the step's checkout would hold the older, healthy weights instead of what training
    held. adaptive and budget store it, as they store a layer whose change was not measured."""
    changes = {"block.0": math.nan, "block.1": 1e-4, "block.2": 1e-4, "block.3": 1e-4, "block.4": 1e-4}
    changes |= {"block.5": 1e-4}
    chosen = decide(PolicySpec("adaptive", {"threshold": 1e-3}), facts(4, changes))
    assert chosen == AUX | {"block.0"}
    changes |= {"embedding": 0.001, "final_norm": 0.002, "lm_head": 0.45}
    young = dict.fromkeys(LAYERS - {"state"}, 1)
    chosen = decide(PolicySpec("budget", {"fraction": 0.5, "max_age": 4}), budget_facts(changes, young))
    # state 280 of 500; block.0 first (100), then by change the head and norms (40 each); no other block fits
    assert chosen == {"state", "block.0", "lm_head", "final_norm", "embedding"}


def budget_facts(changes: dict[str, float], ages: dict[str, int]) -> CommitFacts:
    """Six blocks of 100 bytes, the aux groups and state 400 (1,000 bytes in all)."""
    sizes = {**dict.fromkeys(BLOCKS, 100), "embedding": 40, "final_norm": 40, "lm_head": 40, "state": 280}
    return CommitFacts(LAYERS, 5, LAYERS - {"state"}, changes, sizes, ages)


def test_budget_stores_the_layers_that_moved_most_until_the_bytes_are_spent() -> None:
    changes = {"block.0": 0.1, "block.1": 0.5, "block.2": 0.3, "block.3": 0.2, "block.4": 0.05, "block.5": 0.4}
    changes |= {"embedding": 0.001, "final_norm": 0.002, "lm_head": 0.45}
    young = dict.fromkeys(LAYERS - {"state"}, 1)
    # state takes 280 of a 550 budget; then by change: block.1, lm_head, block.5 (520); nothing else fits
    chosen = decide(PolicySpec("budget", {"fraction": 0.55, "max_age": 4}), budget_facts(changes, young))
    assert chosen == {"state", "block.1", "lm_head", "block.5"}
    # a layer unstored for max_age commits is stored first (the embedding, which hardly moved);
    # the greedy fill then skips block.5 (it would pass 550) and takes the small final norm
    old = young | {"embedding": 4}
    chosen = decide(PolicySpec("budget", {"fraction": 0.55, "max_age": 4}), budget_facts(changes, old))
    assert chosen == {"state", "embedding", "block.1", "lm_head", "final_norm"}
    # an unmeasured change counts as the largest
    unmeasured = {k: v for k, v in changes.items() if k != "block.0"}
    chosen = decide(PolicySpec("budget", {"fraction": 0.5, "max_age": 4}), budget_facts(unmeasured, young))
    assert chosen == {"state", "block.0", "block.1"}
    # a budget smaller than state stores state only
    assert decide(PolicySpec("budget", {"fraction": 0.1}), budget_facts(changes, young)) == {"state"}
    for bad in ({"fraction": 0}, {"fraction": 1.5}, {"max_age": 0}):
        with pytest.raises(PolicyError, match="budget needs"):
            decide(PolicySpec("budget", bad), budget_facts(changes, young))


def test_a_layer_no_earlier_step_has_is_stored() -> None:
    inheritable = LAYERS - {"block.2"}
    assert "block.2" in decide(PolicySpec("parity"), facts(1, inheritable=inheritable))


def test_unknown_policy() -> None:
    with pytest.raises(PolicyError, match="unknown policy"):
        decide(PolicySpec("nope"), facts(1))
    with pytest.raises(PolicyError, match="unknown policy"):
        policy_spec("nope", {})


def test_a_parameter_the_policy_does_not_take_is_refused() -> None:
    """Ignored, it would be recorded in the manifest as if it had counted; a misspelt keyword of
    Store.commit lands among the policy's parameters too."""
    assert set(PARAMETERS) == set(POLICIES)
    assert policy_spec("filter", {"every": 3, "keep_first": 1}) == PolicySpec("filter", {"every": 3, "keep_first": 1})
    with pytest.raises(PolicyError, match="policy full takes no parameters, not `every=3`"):
        policy_spec("full", {"every": 3})
    with pytest.raises(PolicyError, match="policy adaptive takes `threshold=N`, not `delete_after_comit=True`"):
        policy_spec("adaptive", {"threshold": 0.1, "delete_after_comit": True})


def spec(**over: object) -> dict:
    return {"base": {"step": 18}, "slices": [{"sources": [{"step": 6, "layer_range": [0, 2]}]}], **over}
