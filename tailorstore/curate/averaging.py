"""Averaging merges: a checkpoint whose FP32 masters are a weighted average of several steps.

The pre-training model-merging study averages the weights of checkpoints taken along a
constant-learning-rate run; the average predicts annealing and is a better start for more
training. A spec with ``method`` asks for that::

    method: ema                       # sma | ema | wma
    steps: [9, 12, 15, 18]            # or {from: 9, to: 18, every: 3}; oldest first
    alpha: 0.5                        # ema: the weight of the newest step
    weights: [1, 2, 3, 4]             # wma: one per step (default 1, 2, ..., n)
    base: {step: 18}                  # moments, step counters, files, unnamed layers (default: newest step)
    layers: [{layer_range: [0, 4]}, embed, norm, lm_head]   # default: every layer
    kinds: [master]                   # master (the weights follow), exp_avg, exp_avg_sq

Every method is one weighted sum with coefficients c_i that add up to 1 (``coefficients``):
SMA c_i = 1/n; WMA c_i = w_i / sum(w); EMA c_0 = (1-a)^(n-1), c_i = a (1-a)^(n-1-i), the
closed form of ema = a x_i + (1-a) ema. Each element is summed in float64, oldest step first,
``acc += c_i * float64(x_i)``, and rounded once to float32 at the end. float64 because the
masters differ from step to step in their lowest bits (that is where they differ from the bf16
weights), and a float32 running sum would round them away at every step; the cost is 16 bytes
an element of one atom at a time, never of the model. The low-precision weights are the
averaged master rounded as DeepSpeed rounds it, recorded as derived weights, so the result
loads as a consistent mixed-precision checkpoint.

Nothing else changes: the moments, step counters and every file come from the base, which
is what lets the result resume under DeepSpeed, as the study initialises further training
from merged weights. The new masters are blobs like any commit's, written under the shared
lock; the manifest is recorded last, so a failed merge leaves the store as it was.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, replace
from itertools import pairwise
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from tailorstore.access.atom_reader import decode_atom, decode_atom_into
from tailorstore.access.contents import Contents
from tailorstore.access.model_tensors import tiling
from tailorstore.core.atom_types import EXP_AVG, EXP_AVG_SQ, MASTER, WEIGHT
from tailorstore.core.errors import LOCK_TIMEOUT, Call, CorruptStoreError, MergeSpecError, StepExistsError
from tailorstore.core.failpoints import operation
from tailorstore.core.layers import AUX_GROUPS, STATE, block_index, sort_key
from tailorstore.core.progress import Silent
from tailorstore.core.records import THIN_ARCHIVE, THIN_WEIGHTS, AtomKey, AtomRecord, LayerRecord, ManifestRecord
from tailorstore.core.rounding import ROUND_FROM_MASTER, ROUNDED_DTYPES, rounded, widened
from tailorstore.curate.merge_result import MergeResult
from tailorstore.curate.merge_spec import AUX_KEYS, layer_range, merge_record, ref_of
from tailorstore.store.failed_writes import cleaned_up_on_failure, remove_unindexed
from tailorstore.store.packs.writer import BlobWriter
from tailorstore.store.publish import THIS_MANIFEST, ManifestRows, record_manifest
from tailorstore.store.repo import MAX_STEP, Repository, StepReader


class AveragingView(Contents, Protocol):
    """The read path's view, and whether the tag is free before any average is written."""

    def tagged(self, tag: str) -> ManifestRecord | None: ...


METHODS = ("sma", "ema", "wma")
AVERAGED_KINDS = (MASTER, EXP_AVG, EXP_AVG_SQ)
_KEYS = {"method", "steps", "alpha", "weights", "base", "layers", "kinds"}


@dataclass(frozen=True)
class AverageSpec:
    method: str
    steps: tuple[int, ...]  # oldest first
    coefficients: tuple[float, ...]  # one per step, adding up to 1
    base: str | None  # selector of the base; None: the newest step
    layers: tuple[Any, ...] | None  # the spec's layer entries, checked against the model later; None: all
    kinds: tuple[str, ...]


@dataclass(frozen=True, kw_only=True)
class AverageResult(MergeResult):
    """A merge that averaged: what it averaged and what it wrote."""

    method: str
    coefficients: dict[int, float]  # step -> its coefficient in the sum
    layers: list[str]  # the layers averaged
    kinds: list[str]
    new_blobs: int
    new_bytes: int


# Far more steps than any average wants (each is a checkpoint read in full); the bound keeps a
# range such as {from: 0, to: 10**12, every: 1} from being built as a list before it is refused.
MAX_AVERAGED_STEPS = 10_000


def is_averaging(spec: Any) -> bool:
    return isinstance(spec, dict) and "method" in spec


def coefficients(
    method: str, n: int, *, alpha: float | None = None, weights: list[float] | None = None
) -> tuple[float, ...]:
    """The coefficient of each of ``n`` steps, oldest first (pure; the docstring of this module
    says why these are the three methods' coefficients)."""
    if method == "sma":
        return tuple(1.0 / n for _ in range(n))
    if method == "wma":
        w = [float(i + 1) for i in range(n)] if weights is None else [float(x) for x in weights]
        total = sum(w)
        return tuple(x / total for x in w)
    if method == "ema":
        assert alpha is not None
        return tuple((1.0 - alpha) ** (n - 1) if i == 0 else alpha * (1.0 - alpha) ** (n - 1 - i) for i in range(n))
    raise MergeSpecError(f"method {method!r} is not one of {', '.join(METHODS)}")


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and np.isfinite(value)


def _steps(value: Any, where: str) -> tuple[int, ...]:
    if isinstance(value, dict):
        keys = {"from", "to", "every"}
        if set(value) != keys or not all(isinstance(value[k], int) and not isinstance(value[k], bool) for k in keys):
            raise MergeSpecError(f"{where}: a range of steps is {{from: N, to: M, every: K}}, all three integers")
        if value["every"] <= 0 or value["from"] < 0 or value["to"] < value["from"]:
            raise MergeSpecError(f"{where}: the range needs 0 <= from <= to and every > 0")
        if value["to"] > MAX_STEP:
            raise MergeSpecError(f"{where}: 'to' is {value['to']}, past the largest step, {MAX_STEP}")
        value = range(value["from"], value["to"] + 1, value["every"])
    # counted before it is a list; a range's len() cannot pass sys.maxsize, so it is computed
    count = (value.stop - value.start + value.step - 1) // value.step if isinstance(value, range) else None
    if isinstance(value, list):
        count = len(value)
    if count is not None and count > MAX_AVERAGED_STEPS:
        limit = f"an average takes at most {MAX_AVERAGED_STEPS:,}"
        raise MergeSpecError(f"{where}: the spec names {count:,} steps; {limit}")
    value = list(value) if isinstance(value, range) else value
    if not isinstance(value, list) or not all(
        isinstance(s, int) and not isinstance(s, bool) and 0 <= s <= MAX_STEP for s in value
    ):
        raise MergeSpecError(f"{where}: steps is a list of step numbers, e.g. [100, 200, 300], or {{from, to, every}}")
    if len(value) < 2:
        raise MergeSpecError(f"{where}: an average needs at least two steps")
    if any(b <= a for a, b in pairwise(value)):
        raise MergeSpecError(f"{where}: list the steps oldest first, each once")
    return tuple(value)


def parse_average(spec: dict[str, Any], origin: str) -> AverageSpec:
    """Pure: the averaging spec, checked as far as it can be without the store."""
    unknown = set(spec) - _KEYS
    if unknown:
        raise MergeSpecError(
            f"{origin}: unknown keys {sorted(unknown)}; an averaging spec takes {', '.join(sorted(_KEYS))}"
        )
    method = spec["method"]
    if method not in METHODS:
        raise MergeSpecError(f"{origin}: method {method!r} is not one of {', '.join(METHODS)}")
    steps = _steps(spec.get("steps"), f"{origin}: steps")
    alpha = spec.get("alpha")
    weights = spec.get("weights")
    if method != "ema" and alpha is not None:
        raise MergeSpecError(f"{origin}: alpha belongs to method ema, not {method}")
    if method != "wma" and weights is not None:
        raise MergeSpecError(f"{origin}: weights belong to method wma, not {method}")
    if method == "ema" and not (_number(alpha) and 0 < alpha <= 1):
        raise MergeSpecError(f"{origin}: ema needs alpha with 0 < alpha <= 1 (the weight of the newest step)")
    if weights is not None and not (
        isinstance(weights, list)
        and len(weights) == len(steps)
        and all(_number(w) and w >= 0 for w in weights)
        and sum(weights) > 0
    ):
        raise MergeSpecError(f"{origin}: weights must be {len(steps)} numbers >= 0 (one per step) with a sum above 0")
    kinds = spec.get("kinds", [MASTER])
    if (
        not isinstance(kinds, list)
        or not kinds
        or not all(isinstance(k, str) for k in kinds)  # [[master]] is no kind, and no set member
        or not set(kinds) <= set(AVERAGED_KINDS)
        or len(set(kinds)) != len(kinds)
    ):
        raise MergeSpecError(f"{origin}: kinds is a list from {', '.join(AVERAGED_KINDS)}, each once")
    layers = spec.get("layers")
    if layers is not None and (not isinstance(layers, list) or not layers):
        raise MergeSpecError(
            f"{origin}: layers is a non-empty list of {{layer_range: [start, end)}}, embed, norm, lm_head"
        )
    base = ref_of(spec["base"], f"{origin}: base") if "base" in spec else None
    return AverageSpec(
        method,
        steps,
        coefficients(method, len(steps), alpha=alpha, weights=weights),
        base,
        None if layers is None else tuple(layers),
        tuple(kinds),
    )


def chosen_layers(entries: tuple[Any, ...] | None, model_layers: Iterable[str], origin: str) -> set[str]:
    """Pure: the layers to average (every parameter layer when the spec names none)."""
    present = set(model_layers) - {STATE}
    if entries is None:
        return present
    blocks = sorted(i for name in present if (i := block_index(name)) is not None)
    out: set[str] = set()
    for i, entry in enumerate(entries):
        where = f"{origin}: layers[{i}]"
        if isinstance(entry, str):
            label = AUX_KEYS.get(entry, entry if entry in AUX_GROUPS else None)
            if label is None or label not in present:
                names = sorted({k for k, v in AUX_KEYS.items() if v in present} | (present & set(AUX_GROUPS)))
                raise MergeSpecError(f"{where}: {entry!r} is not a layer of this model; name one of {names}")
            out.add(label)
        elif not blocks:
            raise MergeSpecError(f"{where}: the model has no transformer blocks to name by layer_range")
        else:
            out.update(layer_range(entry, blocks, where))
    return out


def average(
    repo: Repository, spec: dict[str, Any], spec_path: Path, tag: str, run: str, *, lock_timeout: float = LOCK_TIMEOUT
) -> AverageResult:
    """Write the averaged atoms as new blobs and record them as a merge manifest under ``tag``."""
    began = time.perf_counter()
    parsed = parse_average(spec, str(spec_path))
    with operation("average"), repo.lock(exclusive=False, timeout=lock_timeout) as lock:
        repo.refresh(lock)  # another host's gc may have dropped a step since the store was opened
        manifests = [repo.resolve(f"step={s}", run) for s in parsed.steps]
        base = repo.resolve(parsed.base, run) if parsed.base else manifests[-1]
        read_from = [repo.manifest(m) for m in sorted({base, *manifests})]  # as they are now
        if repo.view(AveragingView).tagged(tag):
            raise StepExistsError(f"tag {tag!r} already names a manifest; choose another tag")
        base_record = repo.manifest(base)
        if base_record.tier is not None:
            raise MergeSpecError(
                f"the base, step {base_record.step}, was thinned to {base_record.tier}: the average takes its "
                "moments and files from the base, so name a whole step as base ({step: N})"
            )
        layers = chosen_layers(parsed.layers, {x.layer for x in repo.view(AveragingView).layers(base)}, str(spec_path))
        writer = BlobWriter(repo)
        with cleaned_up_on_failure(repo, writer, lock, Silent()):
            replaced = _write_averages(repo, base, manifests, parsed, layers, writer)
            new_blobs = writer.finish()
        record = merge_record(base_record, tag, {"name": "average", "spec": spec}, spec_path, new_blobs)

        rows = ManifestRows(
            record,
            repo.view(AveragingView).files(base),
            [replaced.get(a.key(), a) for a in repo.view(AveragingView).atoms(base)],
            _layers(repo.view(AveragingView).layers(base), layers, base_record.step),
            blobs=new_blobs,
            packs=writer.new_packs(),
            derived_from=read_from,
        )
        try:
            [new] = record_manifest(repo, rows, fence=lock)
        except BaseException:
            if lock.try_exclusive():
                remove_unindexed(repo, writer, lock)
            raise
    return AverageResult(
        id=repo.manifest(new).name,
        manifest=new,
        tag=tag,
        step=base_record.step,
        method=parsed.method,
        coefficients=dict(zip(parsed.steps, parsed.coefficients, strict=True)),
        layers=sorted(layers, key=sort_key),
        kinds=list(parsed.kinds),
        new_blobs=len(new_blobs),
        new_bytes=record.new_bytes,
        seconds=time.perf_counter() - began,
    )


def _layers(base_layers: list[LayerRecord], averaged: set[str], step: int) -> list[LayerRecord]:
    """Averaged layers are the new manifest's own; the others say where the base got them."""
    return [
        replace(x, source=THIS_MANIFEST, source_step=step, stored=True, change=None)
        if x.layer in averaged
        else replace(x, stored=False, change=None)
        for x in base_layers
    ]


def _write_averages(
    repo: StepReader,
    base: int,
    manifests: list[int],
    spec: AverageSpec,
    layers: set[str],
    writer: BlobWriter,
) -> dict[AtomKey, AtomRecord]:
    """The base's atoms that change, by key: one parameter at a time, so memory holds one
    parameter's FP32 master (for its weight) and one atom's sums, whatever the model's size."""
    by_param: dict[str, list[AtomRecord]] = defaultdict(list)
    index = repo.view(AveragingView)
    for atom in index.atoms(base):
        if atom.layer in layers and (atom.kind in spec.kinds or atom.kind == WEIGHT):
            by_param[atom.param].append(atom)
    sources = [index.atoms_by_key(m) for m in manifests]
    by_weights = (THIN_WEIGHTS, THIN_ARCHIVE)  # tiers whose weights stand in for their masters
    weights = [_weights_by_param(index, m) if repo.manifest(m).tier in by_weights else {} for m in manifests]
    averager = _Averager(repo, manifests, spec, sources, weights, writer)
    out: dict[AtomKey, AtomRecord] = {}
    for param in sorted(by_param):
        out.update(averager.param(param, by_param[param]))
    if not out:
        raise MergeSpecError(f"nothing to average: the layers named hold no {', '.join(spec.kinds)} state")
    return out


def _weights_by_param(index: AveragingView, manifest: int) -> dict[str, list[AtomRecord]]:
    """A step thinned to weights (or archived): its weight atoms by parameter (they stand in for its masters)."""
    out: dict[str, list[AtomRecord]] = defaultdict(list)
    for atom in index.atoms(manifest, kind=WEIGHT):
        out[atom.param].append(atom)
    return out


class _Averager:
    def __init__(
        self,
        repo: StepReader,
        manifests: list[int],
        spec: AverageSpec,
        sources: list[dict[AtomKey, AtomRecord]],
        weights: list[dict[str, list[AtomRecord]]],
        writer: BlobWriter,
    ) -> None:
        self.store = repo
        self.manifests = manifests
        self.spec = spec
        self.sources = sources
        self.weights = weights  # per step: weight atoms by param, for steps thinned to weights
        self.writer = writer
        self._widened: dict[tuple[int, str], np.ndarray] = {}  # (step index, param) -> its weight as float32

    def param(self, param: str, atoms: list[AtomRecord]) -> dict[AtomKey, AtomRecord]:
        self._widened.clear()  # one parameter's weights at a time
        out: dict[AtomKey, AtomRecord] = {}
        masters = [a for a in atoms if a.kind == MASTER]
        weights = [a for a in atoms if a.kind == WEIGHT]
        for kind in (k for k in self.spec.kinds if k != MASTER):
            for atom in (a for a in atoms if a.kind == kind):
                out[atom.key()] = self._stored(atom, self._sum(atom))
        if MASTER not in self.spec.kinds:
            return out
        if not masters:  # no optimizer master (e.g. ZeRO-0 in fp32): the FP32 weight is the master
            for atom in weights:
                if atom.dtype != "float32":
                    raise MergeSpecError(
                        f"{param}: its {atom.dtype} weight has no FP32 master in the optimizer state to average"
                    )
                out[atom.key()] = self._stored(atom, self._sum(atom))
            return out
        whole = np.empty(max(a.start + a.numel for a in masters), dtype=np.float32)
        if weights and tiling(masters, len(whole)) is None:
            raise MergeSpecError(f"{param}: the FP32 master does not cover its weight; it cannot be averaged")
        for atom in masters:
            averaged = self._sum(atom)
            out[atom.key()] = self._stored(atom, averaged)
            whole[atom.start : atom.start + atom.numel] = averaged
        for atom in weights:
            out[atom.key()] = self._weight(param, atom, whole)
        return out

    def _sum(self, atom: AtomRecord) -> np.ndarray:
        """sum_i c_i * float64(x_i), oldest step first, rounded once to float32."""
        if atom.dtype != "float32":
            raise MergeSpecError(f"{atom.param} ({atom.kind}): only float32 state is averaged, this is {atom.dtype}")
        acc = np.zeros(atom.numel, dtype=np.float64)
        term = np.empty(atom.numel, dtype=np.float64)
        piece = memoryview(bytearray(atom.nbytes))
        for i, coefficient in enumerate(self.spec.coefficients):
            np.copyto(term, self._values(i, atom, piece))  # exact: float32 -> float64
            term *= coefficient
            acc += term
        return acc.astype(np.float32)

    def _values(self, i: int, atom: AtomRecord, piece: memoryview) -> np.ndarray:
        """Step ``i``'s float32 values for the elements ``atom`` covers: its own piece, or, for a step
        thinned to weights, its weight widened exactly (bf16 -> float32)."""
        manifest = self.manifests[i]
        match = self.sources[i].get(atom.key())
        if match is not None and match.dtype == atom.dtype:
            decode_atom_into(self.store, manifest, match, piece, f"averaging {atom.param}")
            return np.frombuffer(piece, dtype=np.float32)
        if atom.kind == MASTER and atom.param in self.weights[i]:
            return self._widened_weight(i, atom.param)[atom.start : atom.start + atom.numel]
        record = self.store.manifest(manifest)
        if record.tier is not None:
            raise MergeSpecError(
                f"step {record.step} was thinned to {record.tier} and holds no {atom.kind} of {atom.param}; "
                "average its masters only (kinds: [master])"
            )
        raise MergeSpecError(
            f"step {record.step} has no matching piece for {atom.param} ({atom.kind}, rank {atom.rank}); the steps "
            "differ in layout or world size and cannot be averaged"
        )

    def _widened_weight(self, i: int, param: str) -> np.ndarray:
        if (i, param) not in self._widened:
            pieces = self.weights[i][param]
            numel = max(a.start + a.numel for a in pieces)
            tiled = tiling(pieces, numel)
            if tiled is None:
                raise CorruptStoreError(f"the weight pieces of {param} do not cover it; run ", Call("verify"))
            out = np.empty(numel, dtype=np.float32)
            for atom in tiled:
                raw = decode_atom(self.store, self.manifests[i], atom, f"averaging {param}")
                out[atom.start : atom.start + atom.numel] = widened(raw, atom.dtype)
            self._widened[(i, param)] = out
        return self._widened[(i, param)]

    def _stored(self, atom: AtomRecord, data: np.ndarray) -> AtomRecord:
        blob = self.writer.add(memoryview(data).cast("B"), itemsize=data.itemsize, is_float=True)
        return replace(atom, blob=blob, derived=None)

    def _weight(self, param: str, atom: AtomRecord, whole: np.ndarray) -> AtomRecord:
        """The weight is the averaged master in the weight's dtype; a whole bf16/fp16 weight is
        derived (rebuilt at checkout from the masters just written), any other is stored."""
        part = memoryview(np.ascontiguousarray(whole[atom.start : atom.start + atom.numel])).cast("B")
        if atom.dtype == "float32":
            return self._stored(atom, np.frombuffer(part, dtype=np.float32))
        if atom.dtype not in ROUNDED_DTYPES:
            raise MergeSpecError(f"{param}: a {atom.dtype} weight cannot be made from an FP32 master")
        data = rounded(part, atom.dtype)
        if atom.start == 0 and atom.numel == len(whole):
            return replace(atom, blob=self.writer.hash_only(data), derived=ROUND_FROM_MASTER)
        return replace(atom, blob=self.writer.add(data, itemsize=2, is_float=True), derived=None)
