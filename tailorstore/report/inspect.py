"""Listing steps and showing one: what the store holds, from the index alone.

Both read only SQLite rows (no blob is opened), so they stay fast however large the
checkpoints are; ``benchmarks/`` times them on a store of 1,000 steps.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Protocol

from tailorstore.core.layers import sort_key
from tailorstore.core.metric_values import decode as decode_metrics
from tailorstore.core.records import (
    AtomContent,
    FileContent,
    FileRecord,
    LayerRecord,
    LayerTotals,
    ManifestRecord,
)
from tailorstore.formats.kinds import RAW
from tailorstore.store.digest import ContentRows, digest_of
from tailorstore.store.repo import Repository


class InspectView(Protocol):
    """The index as log and show describe steps."""

    def manifests(self, run: str | None = None) -> list[ManifestRecord]: ...

    def layers(self, manifest: int) -> list[LayerRecord]: ...

    def layer_totals(self, manifest: int) -> list[LayerTotals]: ...

    def layer_stored_bytes(self, manifest: int) -> dict[str, int]: ...

    def files(self, manifest: int) -> list[FileRecord]: ...


@dataclass
class StepSummary:
    step: int
    manifest: int
    origin: str
    created_at: float
    tag: str | None  # the first of ``tags``: what a reader from before a step held several reads
    raw_bytes: int
    new_bytes: int
    exact: bool
    pinned: bool
    policy: dict
    run: str = "main"
    id: str = "-"  # the manifest's name on every host (``id=`` selects it); ``manifest`` is this index's row
    # (host-local: another host's index numbers the same manifest otherwise)
    tier: str | None = None  # thinned by gc to this tier (weights, master): exports and averages, no resume
    world_size: int | None = None  # the data-parallel ranks that saved it (a DeepSpeed save)
    zero_stage: int | None = None  # its ZeRO stage (a DeepSpeed save)
    metrics: dict[str, float | None] = field(default_factory=dict)  # recorded with the step (None: NaN)
    digest: str = "-"  # the hash of what the step holds (store/digest.py; ``digest=`` selects it)
    held_bytes: int | None = None  # the files it holds now: raw_bytes, less what thinning dropped
    tags: list[str] = field(default_factory=list)  # every tag naming the step, sorted
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


@dataclass
class FileSummary:
    """One file of a step as ``tailor ls`` lists it."""

    path: str  # relative to the checkout's folder, '/'-separated
    size: int  # bytes as committed (what a checkout writes)
    kind: str  # raw, torch, safetensors or dcp (docs/FORMAT.md section 3.1)
    mode: int  # permission bits a checkout gives it
    held: int  # bytes the step holds of it now: its size, less the tensors thinning dropped


@dataclass
class StepFiles:
    summary: StepSummary
    files: list[FileSummary] = field(default_factory=list)


def summary(r: ManifestRecord, content: ContentRows | None = None, digest: str | None = None) -> StepSummary:
    """A manifest as ``log`` lists it; with the index's content rows, its digest (unless given) and
    the bytes it holds (which only a thinned step's rows say)."""
    needed = content is not None and (digest is None or r.tier is not None)
    files, atoms = content.content_rows(r.id) if needed else ([], [])  # type: ignore[union-attr]
    if digest is None and content is not None:
        digest = digest_of(files, atoms)
    return StepSummary(
        step=r.step,
        manifest=r.id,
        origin=r.origin,
        created_at=r.created_at,
        tag=r.tags[0] if r.tags else None,
        tags=list(r.tags),
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
        digest=digest or "-",
        held_bytes=None if content is None else held_bytes(r, files, atoms),
        source=r.source,
    )


def held_bytes(r: ManifestRecord, files: list[FileContent], atoms: list[AtomContent]) -> int:
    """The bytes a step holds now: the checkpoint it checks out to, or for a thinned step (whose
    files may keep their rows with most of their tensors dropped: an HF ``optimizer.pt`` keeps its
    step counters) the tensors it kept and its whole files."""
    if r.tier is None:
        return r.raw_bytes
    return sum(a.nbytes for a in atoms) + sum(f.raw_size for f in files if f.kind == RAW)


def log(repo: Repository, run: str | None = None) -> list[StepSummary]:
    """Every manifest, or those of one run, by step."""
    rows = repo.view(ContentRows)
    manifests = repo.view(InspectView).manifests(run)
    digests = repo.content_digests(manifests)
    return [summary(r, rows, digests[r.id]) for r in manifests]


def list_files(repo: Repository, selector: str) -> StepFiles:
    """A step's files, sizes and kinds, from the index alone: what a checkout would write."""
    manifest = repo.resolve(selector)
    record = repo.manifest(manifest)
    content = repo.view(ContentRows)
    _, atoms = content.content_rows(manifest)
    kept: dict[str, int] = {}
    for a in atoms:
        kept[a.path] = kept.get(a.path, 0) + a.nbytes
    whole = record.tier is None
    files = [
        FileSummary(f.path, f.raw_size, f.kind, f.mode, f.raw_size if whole or f.kind == RAW else kept.get(f.path, 0))
        for f in repo.view(InspectView).files(manifest)
    ]
    return StepFiles(summary(record, content), files)


def show(repo: Repository, selector: str) -> StepDetail:
    manifest = repo.resolve(selector)
    head = summary(repo.manifest(manifest), repo.view(ContentRows))
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
