"""Merging: compose a checkpoint from layers of different steps, as a manifest only.

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

import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from tailorstore.access.contents import Contents
from tailorstore.core.errors import LOCK_TIMEOUT, MergeSpecError
from tailorstore.core.failpoints import operation
from tailorstore.core.layers import STATE, block_index, sort_key
from tailorstore.core.records import MAIN_RUN, AtomKey, AtomRecord, LayerRecord
from tailorstore.core.step_rules import check_tag
from tailorstore.curate.averaging import average, is_averaging
from tailorstore.curate.merge_result import MergeResult
from tailorstore.curate.merge_spec import AUX_KEYS, layer_range, load_spec, merge_record, ref_of
from tailorstore.store.publish import ManifestRows, record_manifest
from tailorstore.store.repo import Repository

__all__ = ["MergeResult", "MergeSpecError", "merge", "parse_spec"]


def parse_spec(spec: Any, blocks: list[int], origin: str) -> tuple[str, dict[str, str]]:
    """Pure: (base selector, {layer label: selector}) for the blocks and auxiliary groups the spec names.

    Blocks no slice names are left out: they come from the base.
    """
    if not isinstance(spec, dict):
        raise MergeSpecError(f"{origin}: the spec must be a mapping with 'base' and 'slices'")
    unknown = set(spec) - {"base", "slices", *AUX_KEYS}
    if unknown:
        raise MergeSpecError(f"{origin}: unknown keys {sorted(unknown)}; allowed: base, slices, embed, norm, lm_head")
    base = ref_of(spec.get("base"), f"{origin}: base")
    chosen: dict[str, str] = {}
    slices = spec.get("slices")
    if not isinstance(slices, list) or not slices:
        raise MergeSpecError(f"{origin}: 'slices' must be a non-empty list")
    for i, item in enumerate(slices):
        where = f"{origin}: slices[{i}]"
        sources = item.get("sources") if isinstance(item, dict) else None
        if not isinstance(sources, list) or len(sources) != 1:
            raise MergeSpecError(
                f"{where}: needs exactly one source; to average steps, write a spec with `method: sma` (docs/API.md)"
            )
        source = sources[0]
        ref = ref_of(source, where)
        for label in layer_range(source, blocks, where):
            if label in chosen:
                raise MergeSpecError(f"{where}: {label} is already taken by an earlier slice (ranges overlap)")
            chosen[label] = ref
    for key, label in AUX_KEYS.items():
        if key in spec:
            chosen[label] = ref_of(spec[key], f"{origin}: {key}")
    return base, chosen


def merge(
    repo: Repository, spec_path: Path, tag: str, run: str = MAIN_RUN, *, lock_timeout: float = LOCK_TIMEOUT
) -> MergeResult:
    """Record a composite of layers from several steps, or (a spec with ``method``) an average
    of steps; ``step=N`` references in the spec are read in ``run`` (or the run they name,
    ``RUN:step=N``), and the merge belongs to its base's run."""
    began = time.perf_counter()
    check_tag(tag)
    spec = load_spec(spec_path)
    if is_averaging(spec):
        return average(repo, spec, Path(spec_path), tag, run, lock_timeout=lock_timeout)
    # Shared, as a commit: a gc must not delete the blobs the merge names before its manifest is recorded.
    with operation("merge"), repo.lock(exclusive=False, timeout=lock_timeout) as lock:
        repo.refresh(lock)
        base = repo.resolve(ref_of(spec.get("base") if isinstance(spec, dict) else None, f"{spec_path}: base"), run)
        base_record = repo.manifest(base)
        layers = {x.layer for x in repo.view(Contents).layers(base)}
        blocks = sorted(i for name in layers if (i := block_index(name)) is not None)
        if not blocks:
            raise MergeSpecError(f"step {base_record.step} has no transformer blocks to slice")
        _, chosen = parse_spec(spec, blocks, str(spec_path))
        manifests = {ref: repo.resolve(ref, run) for ref in set(chosen.values())}
        read_from = [repo.manifest(m) for m in sorted({base, *manifests.values()})]  # as they are now
        for thinned in read_from:
            if thinned.tier is not None:
                raise MergeSpecError(
                    f"step {thinned.step} was thinned to {thinned.tier}: a composite takes every kind of state of its "
                    "layers. Average it instead (method: sma) or export it."
                )
        sources = {layer: manifests[chosen[layer]] if layer in chosen else base for layer in layers}
        record = merge_record(base_record, tag, {"name": "merge", "spec": spec}, spec_path)
        composed = _composed_layers(repo.view(Contents), base, sources)
        rows = ManifestRows(
            record,
            repo.view(Contents).files(base),
            _composed_atoms(repo.view(Contents), base, sources),
            composed,
            derived_from=read_from,
        )
        [new] = record_manifest(repo, rows, fence=lock)
    ordered = dict(sorted(((x.layer, x.source_step) for x in composed), key=lambda kv: sort_key(kv[0])))
    seconds = time.perf_counter() - began
    return MergeResult(new, tag, base_record.step, ordered, chosen, seconds, repo.manifest(new).name)


def _composed_atoms(index: Contents, base: int, sources: dict[str, int]) -> list[AtomRecord]:
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


def _composed_layers(index: Contents, base: int, sources: dict[str, int]) -> list[LayerRecord]:
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
