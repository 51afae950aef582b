"""``tailor merge``: compose a checkpoint from layers of different steps, as a manifest only.

The spec is a YAML file in the spirit of mergekit's ``slices`` and LLMTailor's examples::

    base: {step: 300}        # step counter, scheduler, RNG, files and every layer left unnamed
                             # (any source may be {step: N}, {tag: NAME} or {id: N})
    slices:
      - sources: [{step: 300, layer_range: [0, 16]}]    # blocks 0..15, end exclusive
      - sources: [{step: 200, layer_range: [16, 32]}]
    embed: {step: 300}
    norm: {step: 200}
    lm_head: {step: 300}

A block may be named at most once; blocks no slice names come from the base. Because the
atoms of every committed step are already in the store, a merge writes no blob: it copies
the base manifest's rows and points each layer's atoms at the blobs of its source step. Its
cost grows with the number of parameters and ranks, not with their bytes.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import yaml

from .errors import StepExistsError, TailorError
from .layers import EMBEDDING, FINAL_NORM, LM_HEAD, STATE, block_index, block_label, sort_key
from .refs import check_tag
from .store import manifest_objects
from .store.index import Index
from .store.manifest_objects import RUN_NAME
from .store.records import MAIN_RUN, MERGE, AtomKey, AtomRecord, LayerRecord
from .store.repo import Repository

_AUX_KEYS = {"embed": EMBEDDING, "norm": FINAL_NORM, "lm_head": LM_HEAD}


class MergeSpecError(TailorError):
    """The merge spec is malformed or names what the store does not hold."""


@dataclass(frozen=True)
class MergeResult:
    manifest: int
    tag: str
    step: int
    sources: dict[str, int]  # layer -> the step whose blobs it uses (as `tailor show` prints)
    named: dict[str, str]  # layer -> the source the spec named, for the layers the spec names
    seconds: float


def _ref_of(entry: Any, where: str) -> str:
    """A spec source as a selector: {step: N}, {tag: NAME} or {id: N}, exactly one of them;
    a step may name its run ({run: pretrain, step: 300})."""
    keys = [k for k in ("step", "tag", "id") if isinstance(entry, dict) and k in entry]
    if len(keys) != 1:
        raise MergeSpecError(f"{where}: needs one of step, tag or id, e.g. {{step: 300}} or {{tag: warm}}")
    value = entry[keys[0]]
    run = entry.get("run")
    if run is not None and (keys[0] != "step" or not isinstance(run, str) or not RUN_NAME.fullmatch(run)):
        raise MergeSpecError(f"{where}: run {run!r} is not allowed here; write {{run: NAME, step: N}}")
    if keys[0] == "tag" and isinstance(value, str) and value:
        return f"tag={value}"
    if keys[0] != "tag" and isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return f"{run}:step={value}" if run else f"{keys[0]}={value}"
    raise MergeSpecError(f"{where}: {keys[0]} {value!r} is not a valid {keys[0]}")


def parse_spec(spec: Any, blocks: list[int], origin: str) -> tuple[str, dict[str, str]]:
    """Pure: (base selector, {layer label: selector}) for the blocks and auxiliary groups the spec names.

    Blocks no slice names are left out: they come from the base.
    """
    if not isinstance(spec, dict):
        raise MergeSpecError(f"{origin}: the spec must be a mapping with 'base' and 'slices'")
    unknown = set(spec) - {"base", "slices", *_AUX_KEYS}
    if unknown:
        raise MergeSpecError(f"{origin}: unknown keys {sorted(unknown)}; allowed: base, slices, embed, norm, lm_head")
    base = _ref_of(spec.get("base"), f"{origin}: base")
    chosen: dict[str, str] = {}
    slices = spec.get("slices")
    if not isinstance(slices, list) or not slices:
        raise MergeSpecError(f"{origin}: 'slices' must be a non-empty list")
    for i, item in enumerate(slices):
        where = f"{origin}: slices[{i}]"
        sources = item.get("sources") if isinstance(item, dict) else None
        if not isinstance(sources, list) or len(sources) != 1:
            raise MergeSpecError(f"{where}: needs exactly one source; tailorstore composes layers, it does not average")
        source = sources[0]
        ref = _ref_of(source, where)
        span = source.get("layer_range")
        if not (
            isinstance(span, list)
            and len(span) == 2
            and all(isinstance(x, int) for x in span)
            and 0 <= span[0] < span[1]
        ):
            raise MergeSpecError(f"{where}: layer_range must be [start, end) with 0 <= start < end")
        for index in range(span[0], span[1]):
            label = block_label(index)
            if index not in blocks:
                raise MergeSpecError(f"{where}: block {index} does not exist; the model has blocks 0..{max(blocks)}")
            if label in chosen:
                raise MergeSpecError(f"{where}: block {index} is already taken by an earlier slice (ranges overlap)")
            chosen[label] = ref
    for key, label in _AUX_KEYS.items():
        if key in spec:
            chosen[label] = _ref_of(spec[key], f"{origin}: {key}")
    return base, chosen


def merge(store: Repository, spec_path: Path, tag: str, run: str = MAIN_RUN) -> MergeResult:
    """Record a composite of layers from several steps; ``step=N`` references in the spec are
    read in ``run`` (or the run they name, ``RUN:step=N``), and the merge belongs to its base's run."""
    began = time.perf_counter()
    check_tag(tag)
    try:
        spec = yaml.safe_load(Path(spec_path).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise MergeSpecError(f"{spec_path}: cannot read the spec ({exc})") from None
    base = store.resolve(_ref_of(spec.get("base") if isinstance(spec, dict) else None, f"{spec_path}: base"), run)
    base_record = store.manifest(base)
    layers = {x.layer for x in store.index.layers(base)}
    blocks = sorted(i for name in layers if (i := block_index(name)) is not None)
    if not blocks:
        raise MergeSpecError(f"step {base_record.step} has no transformer blocks to slice")
    _, chosen = parse_spec(spec, blocks, str(spec_path))
    manifests = {ref: store.resolve(ref, run) for ref in set(chosen.values())}
    sources = {layer: manifests[chosen[layer]] if layer in chosen else base for layer in layers}
    record = replace(
        base_record,
        origin=MERGE,
        tag=tag,
        created_at=time.time(),
        policy=json.dumps({"name": "merge", "spec": spec}),
        exact=False,
        new_bytes=0,
        source=str(Path(spec_path).resolve()),
        pinned=False,
        object_key=None,
    )
    with store.transaction() as index:
        if index.tagged(tag):
            raise StepExistsError(f"tag {tag!r} already names a manifest; choose another tag")
        new = index.insert_manifest(record)
        index.insert_files(new, index.files(base))
        index.insert_atoms(new, _composed_atoms(index, base, sources))
        composed = _composed_layers(index, base, sources)
        index.insert_layers(new, composed)
        manifest_objects.publish(store.backend, index, new)
    ordered = dict(sorted(((x.layer, x.source_step) for x in composed), key=lambda kv: sort_key(kv[0])))
    return MergeResult(new, tag, base_record.step, ordered, chosen, time.perf_counter() - began)


def _composed_atoms(index: Index, base: int, sources: dict[str, int]) -> list[AtomRecord]:
    """The base's atoms, each pointed at the blob of the same piece in its layer's source."""
    cache: dict[int, dict[AtomKey, AtomRecord]] = {}
    out = []
    for a in index.atoms(base):
        source = sources.get(a.layer, base) if a.layer != STATE else base
        if source != base:
            if source not in cache:
                cache[source] = index.atoms_by_key(source)
            match = cache[source].get(a.key())
            if match is None or match.dtype != a.dtype:
                raise MergeSpecError(
                    f"layer {a.layer}: the source step has no matching piece for {a.param} ({a.kind}, rank "
                    f"{a.rank}); the steps differ in layout or world size and cannot be merged"
                )
            a = replace(a, blob=match.blob, derived=match.derived)
        out.append(a)
    return out


def _composed_layers(index: Index, base: int, sources: dict[str, int]) -> list[LayerRecord]:
    """Each layer names where its atoms really come from: the source's own source when that
    layer was inherited there too."""
    out = []
    for x in index.layers(base):
        source = sources.get(x.layer, base) if x.layer != STATE else base
        src = index.layer(source, x.layer)
        if src is None:
            raise MergeSpecError(f"layer {x.layer}: the source step does not have it")
        out.append(replace(x, source=src.source, source_step=src.source_step, stored=False, change=None))
    return out
