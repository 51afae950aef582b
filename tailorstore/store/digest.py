"""A step's content digest: one hash of what the step holds, for naming "this exact checkpoint"
outside the store (a W&B or MLflow run records it; ``digest=HEX`` finds the step again).

A step's id (``records.stable_id``) names a run and a step: the same in two unrelated stores,
and kept when ``--force`` replaces the step with other bytes. The digest names its content
instead: xxh3-128 over the manifest's files (path, kind, size, the hash of their bytes, skeleton
or header, and of their container) and, under each file, its atoms (slot, offset, size, hash),
in a fixed order (docs/FORMAT.md section 3.3, "Digests"). Refs, tags, pins, metrics, times, runs,
step numbers and policies are left out, so two stores holding the same checkpoint bytes agree,
and a replacement with other bytes differs. It is computed from the rows every manifest object
already holds; nothing more is written.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path
from typing import Protocol

import xxhash

from tailorstore.core.records import AtomContent, FileContent

DIGEST_DIGITS = 32  # the whole xxh3-128, in lowercase hex
SHOWN_DIGITS = 12  # what `log` prints; a selector may give any MIN_DIGITS or more
MIN_DIGITS = 8


class ContentRows(Protocol):
    """The index as digests read it."""

    def content_rows(self, manifest: int) -> tuple[list[FileContent], list[AtomContent]]: ...


def _line(values: list[object]) -> bytes:
    return json.dumps(values, separators=(",", ":"), ensure_ascii=False).encode() + b"\n"


def digest_of(files: Iterable[FileContent], atoms: Iterable[AtomContent]) -> str:
    """Pure: the digest of one manifest's rows (files by path; atoms by path, slot, offset).

    An atom's line is formatted directly: its values are integers and a hash that every manifest
    check holds to 32 lowercase hex digits, which JSON writes as they are; a store of a thousand
    steps of many pieces each is hashed at a few million lines a second for ``tailor log``."""
    by_path: dict[str, list[AtomContent]] = defaultdict(list)
    for atom in atoms:
        by_path[atom.path].append(atom)
    h = xxhash.xxh3_128()
    for f in sorted(files, key=lambda f: f.path.encode()):
        h.update(_line(["file", f.path, f.kind, f.raw_size, f.blob, f.container]))
        pieces = sorted(by_path.get(f.path, ()), key=lambda a: (a.slot, a.offset))
        h.update("".join([f'["atom",{a.slot},{a.offset},{a.nbytes},"{a.blob}"]\n' for a in pieces]).encode())
    return h.hexdigest()


def digest(index: ContentRows, manifest: int) -> str:
    """The digest of one manifest, from its rows in the index (a cache of its object)."""
    return digest_of(*index.content_rows(manifest))


class DigestCache:
    """The digests this host has computed, kept beside its index (``index.sqlite-digests.json``), so
    that ``tailor log`` reads each manifest's rows once, not at every run: a store of a thousand
    steps of many pieces each has millions of atom rows.

    An entry is keyed by the manifest's object key: the rows an index holds under one key never
    change (thinning, new metrics and ``--force`` each write a new version under a new key, and
    the index takes the new rows with it), so an entry is never stale. The whole file is tied to
    the index it was computed from (its ``created_at``): a rebuilt or replaced index starts empty.
    Writing it is best effort (a read-only store, a full disk: the digests are computed again)."""

    def __init__(self, path: Path, index_created: str) -> None:
        self.path, self.index_created = path, index_created
        self.entries: dict[str, str] = {}
        self.changed = False
        try:
            doc = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, ValueError, RecursionError):
            return  # none yet, or damaged: computed again
        entries = doc.get("digests") if isinstance(doc, dict) and doc.get("index") == index_created else None
        if isinstance(entries, dict):
            self.entries = {
                k: v
                for k, v in entries.items()
                if isinstance(k, str) and isinstance(v, str) and re.fullmatch(r"[0-9a-f]{32}", v)
            }

    def digest(self, index: ContentRows, manifest: int, object_key: str | None) -> str:
        if object_key is not None and object_key in self.entries:
            return self.entries[object_key]
        found = digest(index, manifest)
        if object_key is not None:  # a manifest not yet published may still change: not kept
            self.entries[object_key], self.changed = found, True
        return found

    def save(self, keep: set[str]) -> None:
        """Write the entries of the object keys in ``keep`` (the manifests held now), if any is new."""
        if not self.changed:
            return
        doc = {"index": self.index_created, "digests": {k: v for k, v in self.entries.items() if k in keep}}
        tmp = self.path.with_name(f"{self.path.name}.{secrets.token_hex(4)}.tmp")
        try:
            tmp.write_text(json.dumps(doc, separators=(",", ":")), encoding="utf-8")
            os.replace(tmp, self.path)
        except OSError:  # best effort: on a read-only store even the unlink fails (EROFS)
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
