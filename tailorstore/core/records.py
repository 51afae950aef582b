"""Typed records of what the index holds: a manifest, its files, atoms and layers, and blobs.

The domain's vocabulary, in core because every layer speaks it: everything above ``store/``
handles these records, never SQL rows or positional tuples, so a column added to the schema is
a field added here and in store/index/_index.py, nowhere else.
The same records are the rows of a manifest object (``store/manifests/document.py``), so what the
index caches and what the backend keeps cannot drift apart.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable
from dataclasses import MISSING, dataclass, fields
from typing import Any, NamedTuple

import xxhash

from tailorstore.core.errors import RecordError, UnsafePathError
from tailorstore.core.object_keys import HASH_NAME, blob_key, pack_key
from tailorstore.core.paths import check_relative

COMMIT = "commit"
MERGE = "merge"
MAIN_RUN = "main"  # the run a store starts with, and every command's default
THIN_MASTER = "master"  # retention tiers (gc --thin): the FP32 master only
THIN_WEIGHTS = "weights"  # the model's own weights only
THIN_ARCHIVE = "archive"  # the model's weights, quantized against the previous archived step (archive_codec.py)
TIERS = (THIN_MASTER, THIN_WEIGHTS, THIN_ARCHIVE)  # thinner last


@dataclass(frozen=True, slots=True)
class ManifestRecord:
    """One manifest: a committed step or a merge. ``id`` is local to this index; the object
    key names it across hosts."""

    step: int
    origin: str  # commit | merge
    created_at: float
    layout: str  # deepspeed | deepspeed-tag | hf-trainer | accelerate | dcp | megatron | plain | plain-file
    ds_tag: str | None
    zero_stage: int | None
    world_size: int | None
    policy: str  # JSON: the policy (or merge spec) that chose the layers
    exact: bool  # every layer comes from this manifest's own step
    raw_bytes: int
    new_bytes: int
    source: str  # the directory committed, or the merge spec file
    tags: tuple[str, ...] = ()  # sorted; a step holds any number, a tag names one manifest
    pinned: bool = False
    object_key: str | None = None
    id: int = 0
    run: str = MAIN_RUN  # steps are numbered per run
    tier: str | None = None  # None: whole; one of TIERS once gc thinned it
    metrics: str | None = None  # JSON object of the step's metrics (core/metric_values.py), or None

    @property
    def name(self) -> str:
        """The manifest's id as users see it, the same on every host (:func:`stable_id`)."""
        return stable_id(self.object_key)


ID_DIGITS = 10  # hex digits of a stable id that are printed; a selector may give any 4 or more


def stable_id(object_key: str | None) -> str:
    """A short name for a manifest derived from its object key, so every host gives it the same one
    (the index's row ids differ from host to host). A commit's version suffix is left out: the
    name stays when gc thins the step (a new version of its object) and names the step's current
    version after ``force``. ``-`` for a manifest whose object is not written yet."""
    if object_key is None:
        return "-"
    stem = re.sub(r"-v\d+(\.json\.zst)$", r"\1", object_key)
    return xxhash.xxh3_64_hexdigest(stem.encode())[:ID_DIGITS]


class FileContent(NamedTuple):
    """A file row as a content digest reads it (store/digest.py)."""

    path: str
    kind: str
    raw_size: int
    blob: str
    container: str | None


class AtomContent(NamedTuple):
    """An atom row as a content digest reads it (store/digest.py)."""

    path: str
    slot: int
    offset: int
    nbytes: int
    blob: str


class StoredLayer(NamedTuple):
    """A layer as a committed step stored or inherited it (for inheritance: newest first)."""

    step: int
    layer: LayerRecord


class BlobUse(NamedTuple):
    """Where a blob is used, in words, for verify's messages."""

    blob: str
    where: str


class LayerTotals(NamedTuple):
    """A layer of one manifest: its kinds of state and its bytes."""

    layer: str
    kinds: list[str]
    raw_bytes: int
    derived_bytes: int  # rebuilt from the FP32 master rather than stored


class KindTotals(NamedTuple):
    """One kind of state over the whole store."""

    kind: str
    raw_bytes: int
    derived_bytes: int
    stored_bytes: int  # of the distinct blobs behind it


class IndexCounts(NamedTuple):
    manifests: int
    blobs: int


# The columns a manifest object carries; tag, pin and id are not part of it (refs and the index hold them).
MANIFEST_DOC_FIELDS = (
    "step", "origin", "created_at", "layout", "ds_tag", "zero_stage", "world_size", "policy", "exact",
    "raw_bytes", "new_bytes", "source", "run", "tier", "metrics",
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


_SCALARS: dict[str, type] = {"int": int, "str": str, "float": float, "bool": bool}


@functools.cache
def _field_types(cls: type) -> dict[str, tuple[type, bool, bool]]:
    """Each scalar field of a record class: (its scalar type, whether it may be None, whether it is
    required). A field of another type (a manifest's tags) is no column of an outside record: it
    keeps its default there, as the refs, not the manifest object, say it."""
    out = {}
    for f in fields(cls):
        names = [n.strip() for n in str(f.type).split("|")]
        (scalar,) = [n for n in names if n != "None"]
        if scalar not in _SCALARS and f.default is not MISSING:
            continue
        out[f.name] = (_SCALARS[scalar], "None" in names, f.default is MISSING and f.default_factory is MISSING)
    return out


def _typed(cls: type, name: str, value: Any) -> Any:
    scalar, nullable, _ = _field_types(cls)[name]
    if value is None:
        ok = nullable
    elif isinstance(value, bool):
        ok = scalar is bool
    elif scalar is bool:  # flags are 0/1, as in SQL
        ok = isinstance(value, int) and value in (0, 1)
        value = bool(value) if ok else value
    elif scalar is float:  # JSON writes a whole-number float as an int
        ok = isinstance(value, int | float)
        value = float(value) if ok else value
    else:
        ok = isinstance(value, scalar)
    if not ok:
        article = "an" if scalar is int else "a"
        raise RecordError(f"{cls.__name__}.{name} is {value!r:.80}, not {article} {scalar.__name__}")
    return value


def record(cls: type, named: dict[str, Any]) -> Any:
    """A record from named values, each checked against the type its field declares. Manifest
    objects and parts come from the backend, written by other hosts (or damaged): a step that is
    a string or a missing column must stop here, naming the object, not reach the index and fail
    later as a traceback. Names the record does not have are ignored (a newer writer's columns)."""
    types = _field_types(cls)
    missing = [name for name, (_, _, required) in types.items() if required and name not in named]
    if missing:
        raise RecordError(f"a {cls.__name__} has no {', '.join(missing)}")
    values = {}
    for name, value in named.items():
        declared = types.get(name)
        if declared is None:
            continue
        values[name] = value if type(value) is declared[0] else _typed(cls, name, value)  # most are exact
    return cls(**values)


def from_table(table: dict[str, Any], cls: type) -> list[Any]:
    """A JSON table back as records, by column name (:func:`record` checks every value): a reader
    of a newer object ignores columns it does not know, and 0/1 flags become bools again."""
    columns = table.get("columns") if isinstance(table, dict) else None
    rows = table.get("rows") if isinstance(table, dict) else None
    named_columns = isinstance(columns, list | tuple) and all(isinstance(c, str) for c in columns)
    if not named_columns or not isinstance(rows, list):
        raise RecordError(f"a table of {cls.__name__} rows is not {{columns: [names], rows: [rows]}}")
    out = []
    for row in rows:
        if not isinstance(row, list) or len(row) != len(columns):
            raise RecordError(f"a {cls.__name__} row has {_count(row)} values for {len(columns)} columns")
        out.append(record(cls, dict(zip(columns, row, strict=True))))
    return out


def _count(row: Any) -> str:
    return str(len(row)) if isinstance(row, list) else "no list of"


def check_rows(files: Iterable[FileRecord], atoms: Iterable[AtomRecord], blobs: Iterable[BlobRecord]) -> None:
    """What the types cannot say about a manifest's rows: paths stay inside the checkpoint, blob and
    pack names are hashes, sizes and element ranges are not negative. Checkout refuses such a path
    anyway; here it is found when the object is read, as damage to the store, naming the object."""
    paths: set[str] = set()  # a file's atoms repeat its path: each is checked once
    try:
        for f in files:
            _inside(f.path, paths)
            _hex(f.blob, f.path)
            if f.container is not None:
                _hex(f.container, f.path)
            _not_negative(f.path, raw_size=f.raw_size)
            if not 0 <= f.mode <= 0o777:  # checkout must never apply setuid, setgid or sticky bits
                raise RecordError(f"{f.path}: mode {f.mode:#o} is outside 0o777")
        for a in atoms:
            _inside(a.path, paths)
            _hex(a.blob, a.path)
            _not_negative(a.path, numel=a.numel, nbytes=a.nbytes, start=a.start, offset=a.offset)
        for b in blobs:
            _hex(b.hash, "a blob row")
            if b.pack is not None:
                _hex(b.pack, f"blob {b.hash}")
            _not_negative(f"blob {b.hash}", raw_size=b.raw_size, stored_size=b.stored_size, offset=b.pack_offset)
    except UnsafePathError as exc:
        raise RecordError(str(exc)) from None


def _inside(path: str, checked: set[str]) -> None:
    if path not in checked:
        check_relative(path)
        checked.add(path)


def _hex(name: str, where: str) -> None:
    if not HASH_NAME.fullmatch(name):
        raise RecordError(f"{where}: {name!r:.80} is not a 32-digit hex hash")


def _not_negative(where: str, **numbers: int | None) -> None:
    """Sizes and offsets: 0 or more, and small enough for SQLite and for any file (2**62)."""
    for name, value in numbers.items():
        if value is not None and not 0 <= value < 1 << 62:
            raise RecordError(f"{where}: {name} is {value}")
