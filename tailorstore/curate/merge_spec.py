"""What the two kinds of merge spec share: reading the YAML, naming a source, the layers a
spec may name, and the one error for a spec that is wrong.

``tailor merge`` takes a layer-picking spec (merge.py) or an averaging spec (averaging.py);
both name steps the same way and select layers with the same vocabulary, so a user who
learned one reads the other.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path
from typing import Any

import yaml

from tailorstore.core.errors import MergeSpecError
from tailorstore.core.layers import EMBEDDING, FINAL_NORM, LM_HEAD, block_label
from tailorstore.core.records import MERGE, BlobRecord, ManifestRecord
from tailorstore.core.run_names import RUN_NAME
from tailorstore.formats.small_text import read_small_text

AUX_KEYS = {"embed": EMBEDDING, "norm": FINAL_NORM, "lm_head": LM_HEAD}


# A spec is a few dozen lines. PyYAML is slow and memory-hungry (seconds and a hundred-odd MB a
# MiB: docs/PERFORMANCE.md, "Bounds set by a parser's cost"), so the general 64 MiB bound for
# small text files would let one spec run for minutes in gigabytes.
SPEC_LIMIT = 1 << 20


def load_spec(path: Path) -> Any:
    """The spec file's YAML document (any shape; the parsers check it)."""
    try:
        return yaml.safe_load(read_small_text(Path(path), "a merge spec (YAML)", SPEC_LIMIT, MergeSpecError))
    except (OSError, yaml.YAMLError) as exc:
        raise MergeSpecError(f"{path}: cannot read the spec ({exc})") from None


def ref_of(entry: Any, where: str) -> str:
    """A spec source as a selector: {step: N}, {tag: NAME} or {id: "HEX"}, exactly one of them;
    a step may name its run ({run: pretrain, step: 300}). An id is the hex name ``log`` prints;
    quoted, since YAML reads one of digits only as a number (and drops its leading zeros)."""
    keys = [k for k in ("step", "tag", "id") if isinstance(entry, dict) and k in entry]
    if len(keys) != 1:
        raise MergeSpecError(f"{where}: needs one of step, tag or id, e.g. {{step: 300}} or {{tag: warm}}")
    value = entry[keys[0]]
    run = entry.get("run")
    if run is not None and (keys[0] != "step" or not isinstance(run, str) or not RUN_NAME.fullmatch(run)):
        raise MergeSpecError(f"{where}: run {run!r} is not allowed here; write {{run: NAME, step: N}}")
    if keys[0] == "tag" and isinstance(value, str) and value:
        return f"tag={value}"
    if keys[0] == "id" and isinstance(value, str) and value:
        return f"id={value}"
    if keys[0] != "tag" and isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return f"{run}:step={value}" if run else f"{keys[0]}={value}"
    raise MergeSpecError(f"{where}: {keys[0]} {value!r} is not a valid {keys[0]}")


def layer_range(entry: Any, blocks: list[int], where: str) -> list[str]:
    """The block labels of ``layer_range: [start, end)``, each checked against the model's blocks."""
    span = entry.get("layer_range") if isinstance(entry, dict) else None
    if not (
        isinstance(span, list) and len(span) == 2 and all(isinstance(x, int) for x in span) and 0 <= span[0] < span[1]
    ):
        raise MergeSpecError(f"{where}: layer_range must be [start, end) with 0 <= start < end")
    for index in range(span[0], span[1]):
        if index not in blocks:
            has = f"blocks 0..{max(blocks)}" if blocks else "no numbered blocks (no layers.N in its names)"
            raise MergeSpecError(f"{where}: block {index} does not exist; the model has {has}")
    return [block_label(i) for i in range(span[0], span[1])]


def merge_record(
    base: ManifestRecord, tag: str, policy: dict[str, Any], spec_path: Path, new_blobs: Iterable[BlobRecord] = ()
) -> ManifestRecord:
    """The manifest row of a merge (composite or average): the base's facts under ``tag``, its own
    policy, source and new bytes, no pin, no object yet, and no metrics: the base's evaluation
    scored the base, never this merge (tests/system/test_metric_limits.py,
    ``test_a_merge_carries_no_metric_of_its_base``)."""
    return replace(
        base,
        origin=MERGE,
        metrics=None,
        tags=(tag,),
        created_at=time.time(),
        policy=json.dumps(policy),
        exact=False,
        new_bytes=sum(b.stored_size for b in new_blobs),
        source=str(Path(spec_path).resolve()),
        pinned=False,
        object_key=None,
    )
