"""The stored skeleton of a DCP ``.distcp`` file: where each of its items lies.

A ``.distcp`` file is ``torch.save`` zips back to back, one an item. A commit stores, as the
file's skeleton, a small JSON list of its items (name, offset, length, and for a tensor item
its atom's slot and chunk offsets); everything else is in the container. A composite or an
average puts other steps' tensor bytes into one step's container, and each tensor item's zip
then needs its CRCs mended: this module reads where the items are, without the readers.
"""

from __future__ import annotations

import itertools
import json

from tailorstore.core.errors import Call, CorruptStoreError

SKELETON_FORMAT = "tailorstore-dcp-items"


def skeleton_bytes(items: list[dict[str, object]]) -> bytes:
    return json.dumps({"format": SKELETON_FORMAT, "v": 1, "items": items}, separators=(",", ":")).encode()


def item_windows(skeleton: bytes, size: int | None = None, where: str = "a .distcp file") -> list[tuple[int, int]]:
    """(offset, length) of every tensor item, from a stored skeleton read as hostile: each must lie
    inside the file (``size``) and apart from the others."""
    try:
        doc = json.loads(skeleton)
        if doc.get("format") != SKELETON_FORMAT or doc.get("v") != 1:
            raise ValueError("not a DCP item list of version 1")
        windows = [(row["offset"], row["length"]) for row in doc["items"] if "slot" in row]
        ok = all(
            isinstance(o, int) and isinstance(n, int) and o >= 0 and n > 0 and (size is None or o + n <= size)
            for o, n in windows
        )
        if not ok:
            raise ValueError("an item outside the file")
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
        raise CorruptStoreError(
            f"{where}: its stored item list is damaged ({exc}); run ", Call("verify"), "."
        ) from None
    windows.sort()
    if any(a + n > b for (a, n), (b, _) in itertools.pairwise(windows)):
        raise CorruptStoreError(f"{where}: its stored item list has overlapping items; run ", Call("verify"), ".")
    return windows
