"""The names of stored bytes: a blob or a pack is named by 32 lowercase hex digits, and sits
under a key made from its name (``blobs/ab/<hash>``, ``packs/ab/<name>``; docs/FORMAT.md 3).

Pure rules, in core because the records (core/records.py) name the object that holds a blob's
bytes, and a backend's listing reads names back from keys (store/backends/). A name is checked
before it becomes a key: an index row such as ``../../tmp/x`` must never let gc delete, or
checkout read, an object outside the store.
"""

from __future__ import annotations

import re

from tailorstore.core.errors import Call, CorruptStoreError

HASH_NAME = re.compile(r"[0-9a-f]{32}")  # blobs and packs are named by 32 lowercase hex digits
BLOB_PREFIX = "blobs/"


def check_name(name: str) -> str:
    """A blob name is 32 lowercase hex digits, checked before it becomes a key: an index row
    such as ``../../tmp/x`` must never let gc delete, or checkout read, an object outside the store."""
    if not isinstance(name, str) or not HASH_NAME.fullmatch(name):
        raise CorruptStoreError(
            f"the index names a blob {name!r}, which is not a 32-digit hex hash; the index is damaged. "
            "Rebuild it with ",
            Call("rebuild_index"),
            "; nothing was deleted.",
        )
    return name


def blob_key(name: str) -> str:
    return f"{BLOB_PREFIX}{name[:2]}/{check_name(name)}"


PACK_PREFIX = "packs/"


def pack_key(name: str) -> str:
    """The key of pack ``name`` (store/packs/pack.py); here, beside blob_key, so records name keys without zstd."""
    if not HASH_NAME.fullmatch(name):
        raise CorruptStoreError(f"the index names a pack {name!r}, which is not a 32-digit hex name")
    return f"{PACK_PREFIX}{name[:2]}/{name}"


def blob_name(key: str) -> str | None:
    """The blob name a key under ``blobs/`` stands for, or None for anything else found there."""
    parts = key.split("/")
    if len(parts) == 3 and parts[0] == "blobs" and HASH_NAME.fullmatch(parts[2]) and parts[2][:2] == parts[1]:
        return parts[2]
    return None


def pack_name(key: str) -> str | None:
    """The pack name a key under ``packs/`` stands for, or None for anything else found there."""
    parts = key.split("/")
    if len(parts) == 3 and parts[0] == "packs" and HASH_NAME.fullmatch(parts[2]) and parts[2][:2] == parts[1]:
        return parts[2]
    return None
