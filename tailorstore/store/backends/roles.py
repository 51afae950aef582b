"""Role views of the backend: what an operation above ``store/`` may do to a store's objects.

The backend can delete anything, so no module above ``store/`` holds it whole (a test reads the
AST: none touches ``.backend``). An operation declares the roles it needs, composed into one
protocol at its entry (gc's reads, lists, writes and deletes; a report's reads only), and asks the
repository for it once (``Repository.objects(Role)``); what it gets answers those names and refuses
every other at run time. Its helpers take the narrowest of these roles in their signatures, so a
reader sees at the ``def`` line whether a function can delete.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import BinaryIO, Protocol

from tailorstore.store.backends.base import Batch, BytesLike, Chunks


class Named(Protocol):
    location: str  # how a user names this store, for messages


class Reader(Named, Protocol):
    """Reads objects; changes nothing."""

    def get(self, key: str, start: int = 0, length: int | None = None) -> bytes: ...
    def get_versioned(self, key: str) -> tuple[bytes, str]: ...
    def reader(self, key: str, start: int = 0, length: int | None = None) -> BinaryIO: ...
    def exists(self, key: str) -> bool: ...
    def size(self, key: str) -> int: ...


class Lister(Named, Protocol):
    """Lists keys under a prefix (with their sizes or the server's stamps)."""

    def list(self, prefix: str) -> Iterator[str]: ...
    def sizes(self, prefix: str) -> Iterator[tuple[str, int]]: ...
    def stamps(self, prefix: str) -> Iterator[tuple[str, float]]: ...


class Writer(Named, Protocol):
    """Puts objects, one at a time or as a batch made durable together."""

    def put(
        self, key: str, data: BytesLike | Chunks, *, create_only: bool = False, fence: Callable[[], None] | None = None
    ) -> None: ...
    def put_if(self, key: str, data: bytes, version: str, *, fence: Callable[[], None] | None = None) -> bool: ...
    def batch(self) -> Batch: ...


class Remover(Named, Protocol):
    """Deletes objects: the one role that can lose data, so it is named wherever it is held."""

    def delete(self, key: str) -> None: ...
    def delete_many(self, keys: Iterable[str], *, fence: Callable[[], None] | None = None) -> None: ...


class Leftovers(Named, Protocol):
    """The temp files a killed writer left behind: found, sized, cleared."""

    def leftovers(self) -> list[str]: ...
    def leftover_bytes(self, names: list[str]) -> int: ...
    def clear_leftovers(self, names: list[str]) -> None: ...


class Scanner(Reader, Lister, Protocol):
    """Lists and reads (refs, parts, notices, retention): changes nothing."""


class Editor(Reader, Lister, Writer, Remover, Protocol):
    """Reads, lists, puts and deletes objects (refs and their marks): everything but the temp files."""
