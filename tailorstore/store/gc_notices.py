"""gc's deletions against publications that reuse blobs: each side writes, then reads the other's.

On a store locked by leases, a host may stall past its lease between the fence and the one request
after it (docs/FORMAT.md section 8.1). Fencing alone then lets a gc delete a pack that a commit,
published meanwhile, reuses, or lets a commit publish a step whose pack a gc has just deleted (the
simulation's ``--slip`` seeds 26 and 83). The rule here needs no timing, as the drop markers against
refs (``manifests.drop_marks.mark_unless_claimed``) need none.

Call order, gc (under its exclusive lock), before the request that deletes blob or pack objects:

1. :func:`announce`: put the notice ``gc/<token>.json.zst`` create-only, naming every blob it makes
   unavailable (dead blobs, orphan blob objects) and every pack it deletes;
2. :func:`published_since`: list the manifests and parts; read those that appeared since gc listed
   them before its sync and its index does not know. One that needs a blob of the notice, or names a
   pack of it, stops gc (:func:`withdraw` its notice, exit 4), having deleted nothing of them;
3. delete the objects;
4. :func:`withdraw` its notice. Only the gc that put a notice deletes it.

Call order, a publisher on a store locked by time (a commit, a part, finalize, merge, averaging,
metrics), right after its create-only put:

1. :func:`check_publication`: list ``gc/`` and read every notice; one that names a blob it needs or
   a pack it names stops it: it takes its object back and fails (exit 4);
2. still in it: every pack and loose blob it names exists (one listing, or a HEAD each when that
   costs fewer requests).

Why it holds: if gc's listing (2) came after the publisher's put, gc sees the publication and stops.
Otherwise the put came after gc's listing, so after gc's notice: the publisher's read of ``gc/``
finds the notice unless gc withdrew it, and gc withdraws it only after its deletions are done, so
the publisher's HEADs, later still, find the objects gone. Either way a step reported committed never
names a blob a gc deletes (I1, I6). Both may back off at once, which breaks nothing.

A notice left by a gc that died: its notice names its host and pid. Where that pid is free on the
same host, its gc is certainly gone and deletes nothing more, so publishers pass over the notice (the
existence check, step 2 above, still catches what it deleted before it died) and the next gc, alone
under its exclusive lock, deletes it (:func:`abandoned`). A notice of another host's gc, or of one
still running, stays: publications that need its blobs fail (exit 4) until a gc removes it with
``--clear-notices``, which a user gives once no such gc can be running.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import socket
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import zstandard

from tailorstore.core.errors import Call, CorruptStoreError, LeaseLostError, StoreError
from tailorstore.core.object_keys import HASH_NAME
from tailorstore.core.records import BlobRecord
from tailorstore.store import parts
from tailorstore.store.backends.base import Backend
from tailorstore.store.codec import decompress_bounded
from tailorstore.store.lease import names_a_process, process_may_run
from tailorstore.store.manifests import document
from tailorstore.store.manifests.keys import listed_manifest_keys

NOTICE_PREFIX = "gc/"
NOTICE_VERSION = 1
_NOTICE_KEY = re.compile(r"gc/[0-9]{1,10}-[0-9a-f]{16}\.json\.zst")
NOTICE_LIMIT = 1 << 28  # bytes a notice may decode to: 8 million names


@dataclass(frozen=True)
class Notice:
    """What one gc is about to delete."""

    key: str
    blobs: frozenset[str]  # blobs that will be nowhere once it is done
    packs: frozenset[str]  # packs whose objects it deletes
    host: str | None = None  # where its gc runs; None in a notice written before notices named it
    pid: int | None = None

    @property
    def abandoned(self) -> bool:
        """Its gc certainly died (this host, its pid free): it deletes nothing more."""
        return self.host is not None and self.pid is not None and not process_may_run(self.host, self.pid)

    def needs_any(self, blobs: Iterable[BlobRecord]) -> str | None:
        """The first of ``blobs`` this notice takes away (by its hash, or the pack its row names)."""
        for blob in blobs:
            if blob.hash in self.blobs or (blob.pack is not None and blob.pack in self.packs):
                return blob.hash
        return None


def announce(
    backend: Backend, blobs: Iterable[str], packs: Iterable[str], *, fence: Callable[[], None] | None = None
) -> Notice:
    """gc's step 1: put its notice, create-only, before it reads what was published meanwhile."""
    key = f"{NOTICE_PREFIX}{os.getpid()}-{secrets.token_hex(8)}.json.zst"
    notice = Notice(key, frozenset(blobs), frozenset(packs), socket.gethostname(), os.getpid())
    doc = {
        "tailorstore_gc_notice": NOTICE_VERSION,
        "blobs": sorted(notice.blobs),
        "packs": sorted(notice.packs),
        "host": notice.host,
        "pid": notice.pid,
    }
    body = zstandard.ZstdCompressor(level=3).compress(json.dumps(doc, separators=(",", ":")).encode())
    backend.put(key, body, create_only=True, fence=fence)
    return notice


def withdraw(backend: Backend, notice: Notice) -> None:
    """gc's step 4 (or its back-off): only the gc that put a notice deletes it."""
    backend.delete(notice.key)


def publications(backend: Backend) -> set[str]:
    """The keys of every manifest and part object listed now."""
    return set(listed_manifest_keys(backend)) | set(parts.part_keys(backend))


def published_since(backend: Backend, known: set[str], notice: Notice) -> str | None:
    """gc's step 2: the first publication not in ``known`` (listed before gc's sync, or in its index)
    that needs what ``notice`` deletes; one that cannot be read counts as needing it."""
    for key in sorted(publications(backend) - known):
        try:
            data = backend.get(key)
        except FileNotFoundError:
            continue  # taken back, or deleted by its finalize
        try:
            if key.startswith(parts.PART_PREFIX):
                blobs = parts.decode(data, key).blobs
            else:
                blobs = document.decode(data, key).blobs
        except (CorruptStoreError, StoreError):  # damaged, or of a version this gc cannot read
            return key
        if notice.needs_any(blobs) is not None:
            return key
    return None


def abandoned(backend: Backend) -> list[Notice]:
    """The notices whose gc certainly died; the next gc, under its exclusive lock, deletes them. A
    damaged notice is not among them (it raises, naming ``--clear-notices``)."""
    found = (read_notice(backend, key) for key in notice_keys(backend))
    return [n for n in found if n is not None and n.abandoned]


def notice_keys(backend: Backend) -> list[str]:
    """The notices listed now. Only keys of the form a gc writes count: anything else under ``gc/``
    (a stranger's object, a key no request may name) is ignored, never a reason to fail."""
    return sorted(k for k in backend.list(NOTICE_PREFIX) if _NOTICE_KEY.fullmatch(k))


def read_notice(backend: Backend, key: str) -> Notice | None:
    """A notice read as a stranger's object; None when it went away while being read."""
    try:
        data = backend.get(key)
    except FileNotFoundError:
        return None
    try:
        doc = json.loads(decompress_bounded(data, NOTICE_LIMIT))
        if not isinstance(doc, dict) or doc.get("tailorstore_gc_notice") != NOTICE_VERSION:
            raise ValueError("not a gc notice this tailorstore reads")
        names = {}
        for field in ("blobs", "packs"):
            found = doc.get(field)
            if not isinstance(found, list) or not all(isinstance(n, str) and HASH_NAME.fullmatch(n) for n in found):
                raise ValueError(f"{field} is not a list of 32-digit hex names")
            names[field] = frozenset(found)
        host, pid = doc.get("host"), doc.get("pid")
        if (host, pid) != (None, None) and not names_a_process(host, pid):
            raise ValueError("its host and pid name no process")
        return Notice(key, names["blobs"], names["packs"], host, pid)
    except (zstandard.ZstdError, ValueError, UnicodeDecodeError) as exc:
        raise CorruptStoreError(
            f"gc notice {key} is damaged ({exc}); once no gc is running, delete it with ",
            Call("gc", clear_notices=True),
            ".",
        ) from None


def check_publication(
    backend: Backend, blobs: list[BlobRecord], what: str, stored_bytes: Callable[[BlobRecord], int | None]
) -> None:
    """A publisher on a leased store, right after its create-only put: raise :class:`LeaseLostError`
    when a gc's notice takes away a blob it needs, or when one of its objects is gone (a gc ran
    whole between the put and this read). ``stored_bytes`` tells what a blob's object holds, None
    when it is missing (``Repository.size_lookup``: a listing or a HEAD per object, whichever costs
    fewer requests). The caller then takes its object back."""
    for key in notice_keys(backend):
        notice = read_notice(backend, key)
        if notice is not None and (blob := notice.needs_any(blobs)) is not None and not notice.abandoned:
            raise LeaseLostError(
                f"{backend.location}: {what} was taken back: a gc running meanwhile ({key}) deletes blob "
                f"{blob}, which it needs. Nothing it did is visible; run it again."
            )
    for blob in blobs:
        if stored_bytes(blob) is None:
            raise LeaseLostError(
                f"{backend.location}: {what} was taken back: blob {blob.hash}, which it needs, was deleted by "
                "a gc that ran meanwhile. Nothing it did is visible; run it again."
            )
