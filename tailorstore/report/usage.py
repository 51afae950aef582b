"""Usage: where the store's bytes go, from the index (no blob is read).

A blob shared by several manifests or kinds is counted once, under the first kind that uses
it. "Held alone" is what dropping that manifest (and running gc) would free; "gc frees now"
is what `tailor gc` without retention rules would delete today.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from tailorstore.core import atom_types as A
from tailorstore.core.records import AtomContent, FileContent, KindTotals, ManifestRecord
from tailorstore.report.inspect import held_bytes
from tailorstore.store.repo import Repository


class UsageView(Protocol):
    """The index as du counts where the bytes go."""

    def manifests(self, run: str | None = None) -> list[ManifestRecord]: ...

    def content_rows(self, manifest: int) -> tuple[list[FileContent], list[AtomContent]]: ...

    def kind_totals(self) -> list[KindTotals]: ...

    def blob_object_bytes(self) -> int: ...

    def non_atom_blob_bytes(self) -> int: ...

    def bytes_alone(self) -> dict[int, int]: ...


_KIND_GROUPS = {A.WEIGHT: "weights", A.MASTER: "masters", A.EXP_AVG: "moments", A.EXP_AVG_SQ: "moments"}


@dataclass
class KindUsage:
    raw_bytes: int = 0  # what the manifests' atoms of this kind stand for, counting every manifest
    stored_bytes: int = 0  # compressed bytes of the distinct blobs first used by this kind
    derived_bytes: int = 0  # raw bytes rebuilt from the master instead of stored


@dataclass
class StepUsage:
    manifest: int
    step: int
    tag: str | None  # its tags, comma-separated
    raw_bytes: int
    held_alone: int  # stored bytes of blobs no other manifest uses
    id: str = "-"  # the manifest's name on every host


@dataclass
class Usage:
    manifests: int
    stored_bytes: int  # blobs as stored, plus the index
    index_bytes: int
    raw_bytes: int  # the checkpoints the manifests check out to (a thinned step: what it keeps)
    ratio: float  # saved_bytes / stored_bytes: how much smaller the store is than the saves it holds
    saved_bytes: int = 0  # the saves as training wrote them, thinned steps too (what they were committed as)
    kinds: dict[str, KindUsage] = field(default_factory=dict)  # weights, masters, moments, other state, files
    atom_kinds: dict[str, KindUsage] = field(default_factory=dict)  # the same, by each atom kind alone
    steps: list[StepUsage] = field(default_factory=list)
    gc_frees: int = 0


def usage(repo: Repository, *, gc_frees: int = 0) -> Usage:
    """Where the bytes go. ``gc_frees``: what a gc with each run's own retention would free, which
    the caller learns from curate's plan (report does not import curate)."""
    index = repo.view(UsageView)
    blob_bytes = index.blob_object_bytes()  # loose blob objects, and whole packs (trailers and dead bytes too)
    index_bytes = sum(p.stat().st_size for p in repo.where.index_path.parent.glob("index.sqlite*") if p.is_file())
    manifests = index.manifests()
    # A thinned step keeps only some of its tensors: its raw bytes are theirs, not the whole save's it
    # was committed as (which counted its dropped optimizer states as "files", many times too much).
    raw_of = {m.id: held_bytes(m, *index.content_rows(m.id)) if m.tier else m.raw_bytes for m in manifests}
    raw_total = sum(raw_of.values())
    saved = sum(m.raw_bytes for m in manifests)  # the ratio is against the saves, not what thinning kept of them
    stored = blob_bytes + index_bytes
    out = Usage(len(manifests), stored, index_bytes, raw_total, saved / stored if stored else 0.0, saved)
    for kind, raw, derived, stored_bytes in index.kind_totals():
        out.atom_kinds[kind] = KindUsage(raw, stored_bytes, derived)
        group = out.kinds.setdefault(_KIND_GROUPS.get(kind, "other state"), KindUsage())
        group.raw_bytes += raw
        group.derived_bytes += derived
        group.stored_bytes += stored_bytes
    other_files = out.kinds.setdefault("files", KindUsage())  # skeletons, containers, whole files
    other_files.stored_bytes += index.non_atom_blob_bytes()
    other_files.raw_bytes = max(0, out.raw_bytes - sum(k.raw_bytes for name, k in out.kinds.items() if name != "files"))
    alone = index.bytes_alone()
    out.steps = [
        StepUsage(m.id, m.step, ", ".join(m.tags) or None, raw_of[m.id], alone.get(m.id, 0), m.name) for m in manifests
    ]
    out.gc_frees = gc_frees
    return out
