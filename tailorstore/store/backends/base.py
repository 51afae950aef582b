"""Where a store's bytes live: the one interface every byte goes through.

A backend holds immutable objects under '/'-separated keys (``blobs/ab/<hash>``,
``manifests/...``, ``locks/...``). It offers exactly what both a POSIX directory and an
object store (S3 API) can promise:

- ``put``: an object appears whole or not at all; ``create_only`` refuses to replace one
  (S3 ``If-None-Match: *``, POSIX ``link``), which manifests and locks rely on;
- ``get`` of a byte range, and ``reader`` that streams a range in bounded chunks;
- ``get_versioned`` (a small object's bytes and a token that changes whenever they do) and
  ``put_if`` (replace it only while it still has that token: S3 ``If-Match``), which a ref that
  may be moved by another host meanwhile is dropped with (docs/FORMAT.md 3.3, tombstones);
- ``exists``, ``size``, ``list`` under a prefix (``sizes``: with each object's size, which
  an object store's listing carries for free), ``delete`` (``delete_many``: as few requests
  as the backend allows, with a ``fence`` checked before each one; ``put`` takes one too).

Every request passes ``core.failpoints.request`` first, named by its kind, so a test or the
multi-host simulation can stall or kill a host before any request.

Durability of many objects at once belongs to a :class:`Batch`, one per commit or gc,
never to shared state on the backend: a POSIX batch flushes all its files with one
``syncfs`` before it renames them into place, an S3 batch has nothing to do because every
completed PUT is durable. docs/FORMAT.md lists the keys.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator
from typing import BinaryIO, Protocol

from tailorstore.core.errors import StoreError
from tailorstore.core.object_keys import BLOB_PREFIX, blob_name

BytesLike = bytes | bytearray | memoryview
Chunks = Iterable[BytesLike]

_KEY = re.compile(r"[A-Za-z0-9._=-]+(/[A-Za-z0-9._=-]+)*")
READ_CHUNK = 8 << 20  # bytes a streaming reader holds at a time


def check_key(key: str) -> str:
    """Keys are relative, '/'-separated, and made of a safe alphabet: no '..', no leading '/'."""
    if not _KEY.fullmatch(key) or any(part in (".", "..") for part in key.split("/")):
        raise StoreError(f"{key!r} is not a valid object key")
    return key


def blob_names(backend: Backend) -> Iterator[str]:
    """Names of the blobs the backend holds (other objects under ``blobs/`` are skipped)."""
    for key in backend.list(BLOB_PREFIX):
        name = blob_name(key)
        if name is not None:
            yield name


class Batch(Protocol):
    """Objects written (or deleted) together: visible and durable after ``publish``."""

    def put(self, key: str, chunks: Chunks, size_hint: int = 0) -> None: ...
    def delete(self, key: str) -> None: ...
    def publish(self, fence: Callable[[], None] | None = None) -> None: ...
    def discard(self) -> None: ...


class Backend(Protocol):
    location: str  # how a user names this store: a directory, or s3://bucket/prefix

    def put(
        self, key: str, data: BytesLike | Chunks, *, create_only: bool = False, fence: Callable[[], None] | None = None
    ) -> None: ...
    def get(self, key: str, start: int = 0, length: int | None = None) -> bytes: ...
    def get_versioned(self, key: str) -> tuple[bytes, str]: ...
    def put_if(self, key: str, data: bytes, version: str, *, fence: Callable[[], None] | None = None) -> bool: ...
    def reader(self, key: str, start: int = 0, length: int | None = None) -> BinaryIO: ...
    def exists(self, key: str) -> bool: ...
    def size(self, key: str) -> int: ...
    def list(self, prefix: str) -> Iterator[str]: ...
    def sizes(self, prefix: str) -> Iterator[tuple[str, int]]: ...
    def stamps(self, prefix: str) -> Iterator[tuple[str, float]]: ...  # key, last modified (the server's clock)
    def delete(self, key: str) -> None: ...
    def delete_many(self, keys: Iterable[str], *, fence: Callable[[], None] | None = None) -> None: ...
    def batch(self) -> Batch: ...
    def leftovers(self) -> list[str]: ...
    def leftover_bytes(self, names: list[str]) -> int: ...
    def clear_leftovers(self, names: list[str]) -> None: ...


def as_chunks(data: BytesLike | Chunks) -> Chunks:
    return [data] if isinstance(data, bytes | bytearray | memoryview) else data
