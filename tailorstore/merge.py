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
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from .errors import StepExistsError, TailorError
from .layers import EMBEDDING, FINAL_NORM, LM_HEAD, STATE, block_index, block_label, sort_key
from .refs import check_tag
from .store import manifest_objects
from .store.atom_rows import INSERT_ATOMS, AtomKey, atom_key, atoms_by_key
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
    """A spec source as a selector: {step: N}, {tag: NAME} or {id: N}, exactly one of them."""
    keys = [k for k in ("step", "tag", "id") if isinstance(entry, dict) and k in entry]
    if len(keys) != 1:
        raise MergeSpecError(f"{where}: needs one of step, tag or id, e.g. {{step: 300}} or {{tag: warm}}")
    value = entry[keys[0]]
    if keys[0] == "tag" and isinstance(value, str) and value:
        return f"tag={value}"
    if keys[0] != "tag" and isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return f"{keys[0]}={value}"
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


def merge(store: Repository, spec_path: Path, tag: str) -> MergeResult:
    began = time.perf_counter()
    check_tag(tag)
    try:
        spec = yaml.safe_load(Path(spec_path).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise MergeSpecError(f"{spec_path}: cannot read the spec ({exc})") from None
    base = store.resolve(_ref_of(spec.get("base") if isinstance(spec, dict) else None, f"{spec_path}: base"))
    base_step = store.manifest(base)["step"]
    layers = {r["layer"] for r in store.conn.execute("SELECT layer FROM layers WHERE manifest=?", (base,))}
    blocks = sorted(i for name in layers if (i := block_index(name)) is not None)
    if not blocks:
        raise MergeSpecError(f"step {base_step} has no transformer blocks to slice")
    _, chosen = parse_spec(spec, blocks, str(spec_path))
    manifests = {ref: store.resolve(ref) for ref in set(chosen.values())}
    with store.transaction() as conn:
        if conn.execute("SELECT 1 FROM manifests WHERE tag=?", (tag,)).fetchone():
            raise StepExistsError(f"tag {tag!r} already names a manifest; choose another tag")
        new = _copy_manifest(conn, base, tag, spec_path, spec)
        sources = {layer: manifests[chosen[layer]] if layer in chosen else base for layer in layers}
        _copy_rows(conn, base, new, sources)
        used = {r["layer"]: r["source_step"] for r in conn.execute("SELECT * FROM layers WHERE manifest=?", (new,))}
        manifest_objects.publish(store.backend, conn, new)
    ordered = dict(sorted(used.items(), key=lambda kv: sort_key(kv[0])))
    return MergeResult(new, tag, base_step, ordered, chosen, time.perf_counter() - began)


def _copy_manifest(conn: sqlite3.Connection, base: int, tag: str, spec_path: Path, spec: Any) -> int:
    row = conn.execute(
        "INSERT INTO manifests(step, origin, tag, created_at, layout, ds_tag, zero_stage, world_size, policy, exact,"
        " raw_bytes, new_bytes, source) SELECT step, 'merge', ?, ?, layout, ds_tag, zero_stage, world_size, ?, 0,"
        " raw_bytes, 0, ? FROM manifests WHERE id=?",
        (tag, time.time(), json.dumps({"name": "merge", "spec": spec}), str(Path(spec_path).resolve()), base),
    )
    conn.execute(
        "INSERT INTO files(manifest, path, file_key, kind, rank, blob, raw_size, mode, trusted, container)"
        " SELECT ?, path, file_key, kind, rank, blob, raw_size, mode, trusted, container FROM files WHERE manifest=?",
        (row.lastrowid, base),
    )
    return int(row.lastrowid)


def _copy_rows(conn: sqlite3.Connection, base: int, new: int, sources: dict[str, int]) -> None:
    cache: dict[int, dict[AtomKey, sqlite3.Row]] = {}
    rows = []
    for a in atoms_by_key(conn, base).values():
        source = sources.get(a["layer"], base) if a["layer"] != STATE else base
        blob, derived = a["blob"], a["derived"]
        if source != base:
            if source not in cache:
                cache[source] = atoms_by_key(conn, source)
            match = cache[source].get(atom_key(a))
            if match is None or match["dtype"] != a["dtype"]:
                raise MergeSpecError(
                    f"layer {a['layer']}: the source step has no matching piece for {a['param']} ({a['kind']}, rank "
                    f"{a['rank']}); the steps differ in layout or world size and cannot be merged"
                )
            blob, derived = match["blob"], match["derived"]
        rows.append(
            (
                new,
                a["path"],
                a["slot"],
                a["offset"],
                a["numel"],
                a["dtype"],
                a["shape"],
                a["param"],
                a["kind"],
                a["rank"],
                a["start"],
                a["nbytes"],
                a["layer"],
                blob,
                derived,
                a["file_offset"],
            )
        )
    conn.executemany(INSERT_ATOMS, rows)
    for layer_row in conn.execute("SELECT * FROM layers WHERE manifest=?", (base,)).fetchall():
        source = sources.get(layer_row["layer"], base) if layer_row["layer"] != STATE else base
        src = conn.execute(
            "SELECT source, source_step FROM layers WHERE manifest=? AND layer=?", (source, layer_row["layer"])
        ).fetchone()
        conn.execute(
            "INSERT INTO layers(manifest, layer, source, source_step, raw_bytes, stored, change)"
            " VALUES (?,?,?,?,?,0,?)",
            (new, layer_row["layer"], src["source"], src["source_step"], layer_row["raw_bytes"], None),
        )
