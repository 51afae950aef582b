"""Listing steps and showing one: what the store holds, from the index alone.

Both read only SQLite rows (no blob is opened), so they stay fast however large the
checkpoints are; ``benchmarks/`` times them on a store of 1,000 steps.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Protocol

from tailorstore.core.layers import sort_key
from tailorstore.core.metrics import decode as decode_metrics
from tailorstore.store.index.records import LayerRecord, LayerTotals, ManifestRecord
from tailorstore.store.repo import Repository


class InspectView(Protocol):
    """The index as log and show describe steps."""

    def manifests(self, run: str | None = None) -> list[ManifestRecord]: ...

    def layers(self, manifest: int) -> list[LayerRecord]: ...

    def layer_totals(self, manifest: int) -> list[LayerTotals]: ...

    def layer_stored_bytes(self, manifest: int) -> dict[str, int]: ...


@dataclass
class StepSummary:
    step: int
    manifest: int
    origin: str
    created_at: float
    tag: str | None
    raw_bytes: int
    new_bytes: int
    exact: bool
    pinned: bool
    policy: dict
    run: str = "main"
    id: str = "-"  # the manifest's name on every host (``id=`` selects it); ``manifest`` is this index's row
    tier: str | None = None  # thinned by gc to this tier (weights, master): exports and averages, no resume
    world_size: int | None = None  # the data-parallel ranks that saved it (a DeepSpeed save)
    zero_stage: int | None = None  # its ZeRO stage (a DeepSpeed save)
    metrics: dict[str, float | None] = field(default_factory=dict)  # recorded with the step (None: NaN)
    source: str = ""  # what it was committed from (the folder, as the committing host resolved it)


@dataclass
class LayerSummary:
    layer: str
    source_step: int
    stored: bool
    kinds: list[str] = field(default_factory=list)
    raw_bytes: int = 0
    stored_bytes: int = 0  # compressed size of the distinct blobs behind this layer
    derived_bytes: int = 0  # raw bytes rebuilt from the FP32 master instead of stored
    change: float | None = None


@dataclass
class StepDetail:
    summary: StepSummary
    layers: list[LayerSummary] = field(default_factory=list)
    derived_bytes: int = 0


def summary(r: ManifestRecord) -> StepSummary:
    """A manifest as ``log`` lists it."""
    return StepSummary(
        step=r.step,
        manifest=r.id,
        origin=r.origin,
        created_at=r.created_at,
        tag=r.tag,
        raw_bytes=r.raw_bytes,
        new_bytes=r.new_bytes,
        exact=r.exact,
        pinned=r.pinned,
        policy=json.loads(r.policy),
        run=r.run,
        tier=r.tier,
        id=r.name,
        world_size=r.world_size,
        zero_stage=r.zero_stage,
        metrics=decode_metrics(r.metrics),
        source=r.source,
    )


def log(repo: Repository, run: str | None = None) -> list[StepSummary]:
    """Every manifest, or those of one run, by step."""
    return [summary(r) for r in repo.view(InspectView).manifests(run)]


def show(repo: Repository, selector: str) -> StepDetail:
    manifest = repo.resolve(selector)
    head = summary(repo.manifest(manifest))
    per_layer = {
        x.layer: LayerSummary(x.layer, x.source_step, x.stored, change=x.change)
        for x in repo.view(InspectView).layers(manifest)
    }
    for name, kinds, raw, derived in repo.view(InspectView).layer_totals(manifest):
        layer = per_layer.setdefault(name, LayerSummary(name, head.step, True))
        layer.kinds = kinds
        layer.raw_bytes, layer.derived_bytes = raw, derived
    for name, stored in repo.view(InspectView).layer_stored_bytes(manifest).items():
        per_layer[name].stored_bytes = stored
    layers = sorted(per_layer.values(), key=lambda x: sort_key(x.layer))
    return StepDetail(head, layers, sum(x.derived_bytes for x in layers))
