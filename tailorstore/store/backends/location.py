"""From what a user types (a directory, or ``s3://bucket/prefix``) to a backend and the
places of the index and the local lock.

A local store keeps its index beside its objects (``STORE/index.sqlite``). A remote store
keeps it in a cache directory of this host (``$TAILOR_CACHE``, by default
``$XDG_CACHE_HOME/tailorstore`` or ``~/.cache/tailorstore``), one folder per store
location: the index there is a cache that ``tailor index rebuild`` recreates from the
manifest objects in the store.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from tailorstore.core.environment import CACHE_ENV
from tailorstore.core.errors import StoreError
from tailorstore.store.backends.base import Backend
from tailorstore.store.backends.posix import PosixBackend

INDEX_NAME = "index.sqlite"


@dataclass(frozen=True)
class Location:
    text: str  # as the user wrote it (a path is made absolute)
    backend: Backend
    index_path: Path
    lock_path: Path  # the local lock file of this host
    local_root: Path | None  # the store directory, for a local store

    @property
    def remote(self) -> bool:
        return self.local_root is None


def is_remote(text: str) -> bool:
    return "://" in text


def cache_root() -> Path:
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "tailorstore"


def cache_dir(location: str, endpoint: str) -> Path:
    """A folder of this host's cache for one remote store, named so a person can tell which.

    The same ``s3://bucket/prefix`` on two servers is two stores, so the endpoint is part of
    the name; the store's id, checked at every open (repo.py), catches the rest (a store
    deleted and created again at the same place)."""
    import hashlib  # only a remote store has a cache folder to name

    readable = re.sub(r"[^A-Za-z0-9._-]+", "_", location.split("://", 1)[1])[:80]
    digest = hashlib.sha256(f"{endpoint}\n{location}".encode()).hexdigest()[:12]
    return cache_root() / f"{readable}-{digest}"


def resolve(text: str | os.PathLike) -> Location:
    text = os.fspath(text)
    if re.match(r"s3:(?!//)", text, re.IGNORECASE) or re.match(r"S3://", text):
        raise StoreError(f"{text!r} looks like an S3 location with a typo: write s3://bucket/prefix.")
    if is_remote(text):
        from tailorstore.store.backends.s3 import S3Backend  # obstore loads only for a store on S3

        backend = S3Backend(text)
        folder = cache_dir(backend.location, backend.endpoint)
        return Location(backend.location, backend, folder / INDEX_NAME, folder / "lock", None)
    root = Path(text).absolute()
    return Location(str(root), PosixBackend(root), root / INDEX_NAME, root / "lock", root)
