"""Typed records of what the index holds: a manifest, its files, atoms and layers, and blobs.

Everything above ``store/`` handles these records, never SQL rows or positional tuples,
so a column added to the schema is a field added here and in :mod:`.index`, nowhere else.
The same records are the rows of a manifest object (``manifest_objects``), so what the
index caches and what the backend keeps cannot drift apart.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, fields
from typing import Any

from .backend import blob_key, pack_key

COMMIT = "commit"
MERGE = "merge"
MAIN_RUN = "main"  # the run a store starts with, and every command's default
THIN_MASTER = "master"  # retention tiers (gc --thin): the FP32 master only
THIN_WEIGHTS = "weights"  # the model's own weights only
TIERS = (THIN_MASTER, THIN_WEIGHTS)  # thinner last


@dataclass(frozen=True, slots=True)
class ManifestRecord:
    """One manifest: a committed step or a merge. ``id`` is local to this index; the object
    key names it across hosts."""

    step: int
    origin: str  # commit | merge
    created_at: float
    layout: str  # deepspeed | deepspeed-tag | hf-trainer
    ds_tag: str | None
    zero_stage: int | None
    world_size: int | None
    policy: str  # JSON: the policy (or merge spec) that chose the layers
    exact: bool  # every layer comes from this manifest's own step
    raw_bytes: int
    new_bytes: int
    source: str  # the directory committed, or the merge spec file
    tag: str | None = None
    pinned: bool = False
    object_key: str | None = None
    id: int = 0
    run: str = MAIN_RUN  # steps are numbered per run
    tier: str | None = None  # None: whole; THIN_MASTER or THIN_WEIGHTS once gc thinned it


# The columns a manifest object carries; tag, pin and id are not part of it (refs and the index hold them).
MANIFEST_DOC_FIELDS = (
    "step", "origin", "created_at", "layout", "ds_tag", "zero_stage", "world_size", "policy", "exact",
    "raw_bytes", "new_bytes", "source", "run", "tier",
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class RunRecord:
    """A run: a line of steps with its own numbering. A run branched from a step of another run
    names that manifest (by object key, the same on every host) as its base: the run inherits
    layers from it and gc keeps it."""

    name: str
    created_at: float
    base: str | None = None  # object key of the branch point, or None for a run started afresh


@dataclass(frozen=True, slots=True)
class FileRecord:
    """One file of a manifest: a whole-file blob (raw), or a skeleton or header plus atoms."""

    path: str  # relative, '/'-separated
    file_key: str  # path with the tag folder written as {tag}
    kind: str  # raw | torch | safetensors
    rank: int | None
    blob: str  # content, skeleton or header
    raw_size: int
    mode: int
    trusted: bool  # its skeleton needs --trust-pickles to load
    container: str | None  # the file's bytes outside its atoms; None: re-pickle the skeleton


FILE_COLUMNS = ("path", "file_key", "kind", "rank", "blob", "raw_size", "mode", "trusted", "container")

AtomKey = tuple[str, str, str, int, int, int]  # file_key, param, kind, rank, start, numel


@dataclass(frozen=True, slots=True)
class AtomRecord:
    """One piece of one tensor: what it is (param, kind, rank, element range) and where its bytes are."""

    path: str
    slot: int  # tensor slot in the file's skeleton
    offset: int  # first element within that tensor
    numel: int
    dtype: str
    shape: str  # JSON list
    param: str
    kind: str
    rank: int
    start: int  # first element within the parameter
    nbytes: int
    layer: str
    blob: str  # xxh3-128 of the raw bytes
    derived: str | None  # None, or how checkout rebuilds the bytes (round-from-master)
    file_offset: int | None  # where the bytes sit in the file; None when the file has no container
    file_key: str = ""  # the file's key (filled when read from the index)

    def key(self) -> AtomKey:
        """The same piece in another manifest has the same key (inheritance, merges)."""
        return (self.file_key, self.param, self.kind, self.rank, self.start, self.numel)


ATOM_COLUMNS = tuple(f.name for f in fields(AtomRecord) if f.name != "file_key")


@dataclass(frozen=True, slots=True)
class LayerRecord:
    """Where one layer of a manifest comes from: itself (stored) or an earlier manifest."""

    layer: str
    source: int  # the manifest whose atoms this layer uses (local id)
    source_step: int
    raw_bytes: int
    stored: bool
    change: float | None  # relative change of the FP32 master since its last stored version
    manifest: int = 0


@dataclass(frozen=True, slots=True)
class BlobRecord:
    """A blob: content-addressed bytes, loose as its own object or inside a pack."""

    hash: str
    raw_size: int
    stored_size: int
    codec: str  # JSON codec descriptor
    pack: str | None = None
    pack_offset: int | None = None
    created_at: float = 0.0

    def key(self) -> str:
        """The object that holds the blob's stored bytes."""
        return blob_key(self.hash) if self.pack is None else pack_key(self.pack)


# Blob columns in the order manifest objects and parts write them (docs/FORMAT.md 3.3).
DOC_BLOB_COLUMNS = ("hash", "raw_size", "stored_size", "codec", "created_at", "pack", "pack_offset")


def values(record: object, names: tuple[str, ...]) -> tuple:
    """The record's values in the order of ``names`` (for SQL and manifest objects)."""
    return tuple(getattr(record, n) for n in names)


def to_table(records: Iterable[object], columns: tuple[str, ...]) -> dict[str, Any]:
    """Records as a JSON table of named columns; flags are 0/1, as in SQL."""
    rows = [[int(v) if isinstance(v, bool) else v for v in values(r, columns)] for r in records]
    return {"columns": columns, "rows": rows}


def from_table(table: dict[str, Any], cls: type) -> list[Any]:
    """A JSON table back as records, by column name: a reader of a newer object ignores
    columns it does not know, and 0/1 flags become bools again."""
    known = {f.name: f.type in ("bool", bool) for f in fields(cls)}
    columns = list(table["columns"])
    out = []
    for row in table["rows"]:
        named = {c: (bool(v) if known[c] else v) for c, v in zip(columns, row, strict=False) if c in known}
        out.append(cls(**named))
    return out
