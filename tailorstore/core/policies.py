"""Policies: pure functions that decide which layers a commit stores.

A layer that is not stored is inherited from the newest earlier step that has it; the
commit machinery does that. A policy only answers "which layers now?", from facts handed
to it, so it is trivial to test and to add: write a function, register it in POLICIES.

Whatever a policy says, a commit stores ``state`` (step counters, padding, unknown
tensors) and every layer that no earlier step can supply, and the first commit of a store
stores everything.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from tailorstore.core.errors import Call, PolicyError
from tailorstore.core.layers import STATE, block_index, sort_key


@dataclass(frozen=True)
class PolicySpec:
    name: str = "full"
    params: Mapping[str, float] = field(default_factory=dict)

    def as_json(self) -> dict:
        return {"name": self.name, **dict(self.params)}


@dataclass(frozen=True)
class CommitFacts:
    layers: frozenset[str]  # every layer label in the checkpoint being committed
    commit_index: int  # how many commits the store already holds (0 for the first)
    inheritable: frozenset[str]  # layers an earlier step can supply
    changes: Mapping[str, float] | None = None  # relative change of each inheritable layer, when measured
    sizes: Mapping[str, int] = field(default_factory=dict)  # raw bytes of each layer in this checkpoint
    ages: Mapping[str, int] = field(default_factory=dict)  # commits since an inheritable layer was stored


def _blocks(facts: CommitFacts) -> list[tuple[int, str]]:
    return sorted((i, name) for name in facts.layers if (i := block_index(name)) is not None)


def _aux(facts: CommitFacts) -> set[str]:
    return {name for name in facts.layers if block_index(name) is None}


def _moved(facts: CommitFacts, name: str) -> float:
    """A layer's measured change, or infinity where there is no number: not measured, or NaN
    (a master gone NaN or infinite). Such a layer counts as having moved most and is stored: a
    NaN compares false with any threshold, and a diverged layer inherited would make the step's
    checkout hold the older, healthy weights instead of what training held."""
    change = facts.changes.get(name) if facts.changes is not None else None
    return math.inf if change is None or math.isnan(change) else change


def full(facts: CommitFacts, params: Mapping[str, float]) -> set[str]:
    return set(facts.layers)


def parity_halves(facts: CommitFacts) -> tuple[set[str], set[str]]:
    """The model in two halves of about equal bytes: the even blocks and the odd blocks, each
    auxiliary group (largest first) joining the lighter half.

    Why the auxiliary groups alternate too: with a large vocabulary the embedding and head hold
    most of a small model's bytes (56% of the 58M benchmark model), so storing them every time
    made a parity commit write 0.55 (headline model) to 0.75 (58M model) of a full one's bytes.
    They also move least between saves (the headline benchmark measured the embedding moving 40
    times less than a block), so one save's inheritance costs them least. The split depends only
    on the layer sizes, which a run cannot change (a commit of another model is refused), so
    every group is stored every other commit."""
    halves: tuple[set[str], set[str]] = (set(), set())
    for i, name in _blocks(facts):
        halves[i % 2].add(name)
    weight = [sum(facts.sizes.get(name, 0) for name in half) for half in halves]
    aux = sorted(_aux(facts) - {STATE}, key=lambda name: (-facts.sizes.get(name, 0), sort_key(name)))
    for name in aux:
        lighter = min((0, 1), key=lambda h: (weight[h], len(halves[h]), h))
        halves[lighter].add(name)
        weight[lighter] += facts.sizes.get(name, 0)
    return halves


def parity(facts: CommitFacts, params: Mapping[str, float]) -> set[str]:
    """Half the model a commit, the other half the next (parity_halves); a group is never
    more than one commit old."""
    return parity_halves(facts)[facts.commit_index % 2]


def filter_policy(facts: CommitFacts, params: Mapping[str, float]) -> set[str]:
    """The first K and last M blocks and the auxiliary groups always; the rest every E-th commit."""
    first, last, every = int(params.get("keep_first", 0)), int(params.get("keep_last", 0)), int(params.get("every", 1))
    if every < 1 or first < 0 or last < 0:
        raise PolicyError(
            "filter needs ",
            Call(keep_first="K"),
            " >= 0, ",
            Call(keep_last="K"),
            " >= 0 and ",
            Call(every="E"),
            " >= 1",
        )
    blocks = _blocks(facts)
    edge = {name for pos, (_, name) in enumerate(blocks) if pos < first or pos >= len(blocks) - last}
    middle = {name for _, name in blocks} if facts.commit_index % every == 0 else set()
    return _aux(facts) | edge | middle


def adaptive(facts: CommitFacts, params: Mapping[str, float]) -> set[str]:
    """A block is stored when its FP32 master moved by at least the threshold since it was last stored."""
    threshold = float(params.get("threshold", 0.0))
    if not 0 <= threshold < math.inf:  # NaN too: no change is ever >= NaN, so no block would be stored again
        raise PolicyError("adaptive needs ", Call(threshold="T"), ", a finite number >= 0")
    if facts.changes is None:
        return set(facts.layers)
    return _aux(facts) | {name for _, name in _blocks(facts) if _moved(facts, name) >= threshold}


def budget(facts: CommitFacts, params: Mapping[str, float]) -> set[str]:
    """At most a share of the checkpoint's bytes a commit: the layers that moved most since they
    were last stored, until the budget is spent; the rest are inherited.

    The threshold of ``adaptive`` cannot say how much a commit costs: under a constant learning
    rate every block moves about as much as every other, so a threshold stores all of them or none.
    A byte budget fixes the cost and lets the measured change order the layers. A layer's change is
    measured against its last stored version, so it grows while the layer is inherited and every
    layer's turn comes; ``max_age`` bounds the wait outright (a layer unstored for that many commits
    is stored whatever the budget). Unlike filter and adaptive, the embedding, norms and head compete
    for the budget too: the headline benchmark measured the embedding moving 40 times less than a
    block between saves, and storing it every time held the store above a sixth of the raw bytes.
    A layer whose change could not be measured is treated as having moved most.
    """
    fraction, max_age = float(params.get("fraction", 0.25)), int(params.get("max_age", 8))
    if not 0 < fraction <= 1 or max_age < 1:
        raise PolicyError("budget needs ", Call(fraction="F"), " with 0 < F <= 1 and ", Call(max_age="N"), " >= 1")
    if facts.changes is None:
        return set(facts.layers)
    candidates = sorted(facts.layers - {STATE}, key=sort_key)
    chosen = {name for name in candidates if facts.ages.get(name, max_age) >= max_age}
    allowance = fraction * sum(facts.sizes.get(name, 0) for name in facts.layers)
    spent = sum(facts.sizes.get(name, 0) for name in chosen | ({STATE} & facts.layers))
    by_change = sorted(
        (name for name in candidates if name not in chosen),
        key=lambda name: -_moved(facts, name),  # stable: layer order breaks ties
    )
    for name in by_change:
        size = facts.sizes.get(name, 0)
        if spent + size <= allowance:
            chosen.add(name)
            spent += size
    return chosen


POLICIES: dict[str, Callable[[CommitFacts, Mapping[str, float]], set[str]]] = {
    "full": full,
    "parity": parity,
    "filter": filter_policy,
    "adaptive": adaptive,
    "budget": budget,
}


# What each policy reads from its parameters (the defaults are in the functions).
PARAMETERS: dict[str, tuple[str, ...]] = {
    "full": (),
    "parity": (),
    "filter": ("keep_first", "keep_last", "every"),
    "adaptive": ("threshold",),
    "budget": ("fraction", "max_age"),
}


# Typed policies, for code that names one: ``store.commit(path, policy=Budget(fraction=0.2))``.
# Each is a PolicySpec with its parameters as fields, the defaults of the functions above.


@dataclass(frozen=True)
class Full:
    """Store every layer (the default)."""


@dataclass(frozen=True)
class Parity:
    """Half the model per commit: even blocks, then odd ones (aux layers split by bytes)."""


@dataclass(frozen=True)
class Filter:
    """The first and last ``keep_*`` blocks every commit, the others every ``every`` commits."""

    keep_first: int = 0
    keep_last: int = 0
    every: int = 1


@dataclass(frozen=True)
class Adaptive:
    """A block whose FP32 master moved by ``threshold`` (relative) or more since it was stored."""

    threshold: float = 0.0


@dataclass(frozen=True)
class Budget:
    """At most ``fraction`` of the save's bytes, the blocks that moved most; none older than ``max_age``."""

    fraction: float = 0.25
    max_age: int = 8


Policy = Full | Parity | Filter | Adaptive | Budget
_NAMES: dict[type, str] = {Full: "full", Parity: "parity", Filter: "filter", Adaptive: "adaptive", Budget: "budget"}


def policy_spec(policy: str | Policy | PolicySpec, params: Mapping[str, float] | None = None) -> PolicySpec:
    """A policy by name (with its parameters), as a typed policy, or a spec, checked before anything is
    read: an unknown name, or a parameter the policy does not take, is refused. It would be ignored
    otherwise, and recorded in the manifest as if it had counted (``every=3`` given to ``full``, or a
    misspelt keyword of ``Store.commit``, which collects the policy's parameters)."""
    params = dict(params or {})
    if isinstance(policy, PolicySpec):
        policy, params = policy.name, {**policy.params, **params}
    elif type(policy) in _NAMES:
        if params:
            raise PolicyError(
                f"policy {_NAMES[type(policy)]} was given as a typed policy: set {', '.join(params)} on it"
            )
        params = {k: v for k, v in vars(policy).items()}
        policy = _NAMES[type(policy)]
    if not isinstance(policy, str) or policy not in POLICIES:
        raise PolicyError(f"unknown policy {policy!r}; choose one of {', '.join(POLICIES)}")
    name = policy
    stray = sorted(set(params) - set(PARAMETERS[name]))
    if stray:
        takes: list[str | Call] = ["no parameters"] if not PARAMETERS[name] else []
        for k in PARAMETERS[name]:
            takes += [", "] * bool(takes) + [Call(**{k: "N"})]
        given: list[str | Call] = []
        for k in stray:
            given += [", "] * bool(given) + [Call(**{k: params[k]})]
        raise PolicyError(
            f"policy {name} takes ", *takes, ", not ", *given,
            "; give it to the policy it belongs to, or check its spelling.",
        )  # fmt: skip
    return PolicySpec(name, params)


def decide(spec: PolicySpec, facts: CommitFacts) -> frozenset[str]:
    try:
        policy = POLICIES[spec.name]
    except KeyError:
        raise PolicyError(f"unknown policy {spec.name!r}; choose one of {', '.join(POLICIES)}") from None
    chosen = policy(facts, spec.params)
    if facts.commit_index == 0:
        chosen = set(facts.layers)
    chosen |= {STATE} & facts.layers
    chosen |= facts.layers - facts.inheritable
    return frozenset(chosen & facts.layers)


def needs_changes(spec: PolicySpec) -> bool:
    return spec.name in ("adaptive", "budget")
