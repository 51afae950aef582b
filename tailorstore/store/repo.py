"""A store on disk: the blob backend, the SQLite index and the lock, opened together.

Layout of a store directory (docs/FORMAT.md has the full specification)::

    STORE/index.sqlite   the index (WAL mode)
    STORE/blobs/ab/<hash> blobs, named by the xxh3-128 of their raw bytes
    STORE/tmp/           temp files of blobs being written
    STORE/lock           the store lock (flock)
"""

from __future__ import annotations

import os
import re
import sqlite3
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from .. import codec
from ..errors import CorruptStoreError, StoreError, UnknownStepError
from . import index
from .backend import PosixBackend
from .lock import LockHandle, store_lock

STORE_ENV = "TAILOR_STORE"
MAX_STEP = (1 << 63) - 1  # SQLite's INTEGER


def check_step(step: int) -> int:
    if not 0 <= step <= MAX_STEP:
        raise StoreError(f"step {step} is out of range: a step is a whole number from 0 to {MAX_STEP}.")
    return step


@dataclass(frozen=True)
class BlobRow:
    hash: str
    raw_size: int
    stored_size: int
    codec: str


class Store:
    def __init__(self, root: Path, conn: sqlite3.Connection) -> None:
        self.root = root
        self.conn = conn
        self.backend = PosixBackend(root)

    # -- lifecycle -----------------------------------------------------------------------
    @classmethod
    def init(cls, root: Path) -> Store:
        root = Path(root)
        if root.exists() and not root.is_dir():
            raise StoreError(f"{root}: exists and is not a directory; choose a new or empty directory for the store.")
        if (root / index.INDEX_NAME).exists():
            raise StoreError(f"{root}: a tailorstore already exists here.")
        if root.exists() and any(root.iterdir()):
            raise StoreError(f"{root}: the directory is not empty; choose an empty or new directory.")
        for sub in ("blobs", "tmp"):
            (root / sub).mkdir(parents=True, exist_ok=True)
        index.create(root / index.INDEX_NAME)
        return cls.open(root)

    @classmethod
    def open(cls, root: Path | str | None) -> Store:
        if root is None:
            root = os.environ.get(STORE_ENV)
        if not root:
            raise StoreError(f"no store given: pass --store PATH or set {STORE_ENV}.")
        root = Path(root)
        conn = index.open_index(root / index.INDEX_NAME)
        return cls(root, conn)

    def close(self) -> None:
        self.conn.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextmanager
    def lock(
        self, *, exclusive: bool, timeout: float, on_wait: Callable[[str], None] | None = None
    ) -> Iterator[LockHandle]:
        with store_lock(self.root / "lock", exclusive=exclusive, timeout=timeout, on_wait=on_wait) as handle:
            yield handle

    @contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        """One write transaction; IMMEDIATE so two writers queue instead of failing midway."""
        self.conn.execute("BEGIN IMMEDIATE")
        try:
            yield self.conn
        except BaseException:
            self.conn.execute("ROLLBACK")
            raise
        self.conn.execute("COMMIT")

    # -- blobs ---------------------------------------------------------------------------
    def blob(self, digest: str) -> BlobRow | None:
        row = self.conn.execute(
            "SELECT hash, raw_size, stored_size, codec FROM blobs WHERE hash=?", (digest,)
        ).fetchone()
        return BlobRow(*row) if row else None

    def open_blob(self, digest: str, where: str) -> BinaryIO:
        try:
            return self.backend.open(digest)
        except FileNotFoundError:
            raise CorruptStoreError(
                f"{where}: blob {digest} is missing from {self.backend.path(digest)}; it was deleted behind the "
                "store's back. Run `tailor verify` to see every step it affects."
            ) from None

    def read_blob_into(self, row: BlobRow, dest: memoryview, where: str) -> None:
        """Decode a blob into ``dest`` and check its hash; never leaves unchecked bytes behind."""
        with self.open_blob(row.hash, where) as f:
            codec.decode_into(row.codec, f, dest, f"{where}: blob {row.hash}")
        if codec.content_hash(dest) != row.hash:
            raise CorruptStoreError(
                f"{where}: blob {row.hash} does not match its hash (the blob file is damaged). "
                "Run `tailor verify --deep` to find every damaged blob."
            )

    def read_blob(self, digest: str, where: str) -> bytes:
        row = self.blob(digest)
        if row is None:
            raise CorruptStoreError(f"{where}: blob {digest} has no row in the index")
        buf = bytearray(row.raw_size)
        self.read_blob_into(row, memoryview(buf), where)
        return bytes(buf)

    # -- manifests -----------------------------------------------------------------------
    def resolve(self, selector: str) -> int:
        """The manifest id that ``id=N``, ``step=N`` (or a bare N), ``tag=NAME`` or ``latest`` names.

        ``step=N`` names the commit of step N; merges carry their base's step, so they are named by
        ``tag=`` or ``id=`` (``tailor log`` prints both). A step that only merges carry is refused
        with the list of them.
        """
        text = selector.strip()
        if text == "latest":
            row = self.conn.execute(
                "SELECT id FROM manifests WHERE origin='commit' ORDER BY step DESC LIMIT 1"
            ).fetchone()
            if row is None:
                raise UnknownStepError("the store holds no steps yet; commit one with `tailor commit DIR`.")
            return int(row[0])
        match = re.fullmatch(r"id=(\d+)", text)
        if match:
            manifest = check_step(int(match.group(1)))
            if not self.conn.execute("SELECT 1 FROM manifests WHERE id=?", (manifest,)).fetchone():
                raise UnknownStepError(f"no manifest has id {manifest}; `tailor log` lists the ids.")
            return manifest
        match = re.fullmatch(r"(?:step=)?(\d+)", text)
        if match:
            step = check_step(int(match.group(1)))
            rows = self.conn.execute(
                "SELECT id, origin, tag FROM manifests WHERE step=? ORDER BY id", (step,)
            ).fetchall()
            commits = [r for r in rows if r["origin"] == "commit"]
            if commits:
                return int(commits[0]["id"])
            if rows:
                names = ", ".join(f"id={r['id']} ({r['origin']}, tag {r['tag']})" for r in rows)
                raise UnknownStepError(f"step {step} has no commit, only: {names}. Name one by its id= or tag=.")
            raise UnknownStepError(f"step {step} is not in the store; `tailor log` lists the steps it holds.")
        if text.startswith("tag="):
            row = self.conn.execute("SELECT id FROM manifests WHERE tag=?", (text[4:],)).fetchone()
            if row is None:
                raise UnknownStepError(f"nothing is tagged {text[4:]!r}; `tailor log` shows the tags.")
            return int(row[0])
        raise UnknownStepError(f"cannot read {selector!r}: write step=N, tag=NAME, id=N or latest.")

    def manifest(self, manifest_id: int) -> sqlite3.Row:
        row = self.conn.execute("SELECT * FROM manifests WHERE id=?", (manifest_id,)).fetchone()
        if row is None:
            raise UnknownStepError(f"manifest {manifest_id} is not in the store")
        return row
