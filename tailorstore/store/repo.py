"""A store: its backend, its SQLite index and its lock, opened together.

A store lives at a location: a directory, or ``s3://bucket/prefix``. Every byte of it goes
through the location's :class:`~tailorstore.store.backends.base.Backend`. Keys (docs/FORMAT.md
has the full specification)::

    tailorstore.json     what this is: format version and creation time (create-only)
    blobs/ab/<hash>      blobs, named by the xxh3-128 of their raw bytes

A local store also holds ``index.sqlite`` (WAL mode), ``tmp/`` (temp files of objects
being written) and ``lock`` (flock); a remote store keeps its index and lock in this
host's cache directory.
"""

from __future__ import annotations

import io
import json
import logging
import os
import re
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import BinaryIO, NamedTuple, Protocol

from tailorstore.core.environment import STORE_ENV
from tailorstore.core.errors import (
    BlobMissingError,
    Call,
    CorruptStoreError,
    LockTimeoutError,
    StepChangedError,
    StoreError,
    TailorError,
    UnknownStepError,
)
from tailorstore.core.progress import Progress
from tailorstore.core.records import COMMIT, MAIN_RUN, BlobRecord, ManifestRecord
from tailorstore.core.roles import view_as as view_target_as
from tailorstore.store import archive_codec, codec
from tailorstore.store.backends.base import Backend, blob_names
from tailorstore.store.backends.conditional import check_conditional_writes
from tailorstore.store.backends.listing import LIST_PAGE, Holdings, stored_part
from tailorstore.store.backends.location import Location, cache_root, resolve
from tailorstore.store.index._index import Index
from tailorstore.store.index.roles import R, view_as
from tailorstore.store.index.schema import FORMAT_VERSION
from tailorstore.store.lease import LeaseHandle, lease_lock
from tailorstore.store.lock import LockHandle, store_lock
from tailorstore.store.manifests.objects import publish
from tailorstore.store.manifests.refs import write_refs
from tailorstore.store.manifests.sync import sync
from tailorstore.store.packs.node_windows import NodeWindows, prune
from tailorstore.store.packs.pack import pack_names, read_trailer
from tailorstore.store.packs.pack_spans import PackSpans

MARKER = "tailorstore.json"
MAX_STEP = (1 << 63) - 1  # SQLite's INTEGER


STORE_ID = re.compile(r"[0-9a-f]{32}")


def store_id(backend: Backend) -> str | None:
    """The random id ``init`` wrote into the store's marker (None for a store made before ids,
    and raises FileNotFoundError where there is no store). The marker is read as input from a
    stranger: at most 64 KiB of a JSON object, and an id of 32 hex digits or none."""
    data = backend.get(MARKER, 0, 1 << 16)
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError):
        doc = None
    if not isinstance(doc, dict):
        raise CorruptStoreError(f"{backend.location}/{MARKER} is damaged: it is not the store's JSON marker")
    found = doc.get("store_id")
    if found is not None and not (isinstance(found, str) and STORE_ID.fullmatch(found)):
        raise CorruptStoreError(f"{backend.location}/{MARKER} is damaged: its store id {found!r} is not 32 hex digits")
    return found


def _check_cache(where: Location, index: Index) -> None:
    """A remote store's cache must be this store's: the same bucket and prefix on another server,
    or a store deleted and created again in the same place, would otherwise be read (and
    collected) through another store's index."""
    try:
        found = store_id(where.backend)
    except FileNotFoundError:
        raise StoreError(f"{where.text}: no tailorstore here. Create one: ", Call("init", where.text), ".") from None
    cached = index.meta("store_id")
    if found is None:
        return
    if cached is None:
        if not index.read_only:
            index.set_meta("store_id", found)
        return
    if cached != found:
        raise CorruptStoreError(
            f"{where.index_path}: this host's cache was built for another store (id {cached}) than the one at "
            f"{where.text} (id {found}); rebuild it with ",
            Call("rebuild_index"),
            ".",
        )


def damaged_blob(where: str, digest: str) -> CorruptStoreError:
    """A blob whose bytes no longer hash to its name: what every reader says, naming the way to find them all."""
    return CorruptStoreError(
        f"{where}: blob {digest} does not match its hash (the blob file is damaged). Run ",
        Call("verify", deep=True),
        " to find every damaged blob.",
    )


def check_step(step: int) -> int:
    if not 0 <= step <= MAX_STEP:
        raise StoreError(f"step {step} is out of range: a step is a whole number from 0 to {MAX_STEP}.")
    return step


class RebuildResult(NamedTuple):
    """What a rebuilt index holds."""

    manifests: int
    blobs: int


class _Reading(io.RawIOBase):
    """A blob reader whose object may vanish under it (a remote reader opens lazily):
    that is a damaged store, said as such, not a FileNotFoundError."""

    def __init__(self, inner: BinaryIO, missing: CorruptStoreError) -> None:
        self._inner, self._missing = inner, missing

    def readable(self) -> bool:
        return True

    def readinto(self, dest: memoryview | bytearray) -> int:  # type: ignore[override]
        try:
            return self._inner.readinto(dest)  # type: ignore[attr-defined]
        except FileNotFoundError:
            raise self._missing from None

    def close(self) -> None:
        self._inner.close()
        super().close()


def _location(location: Path | str | None) -> Path | str:
    if location is None:
        location = os.environ.get(STORE_ENV)
    if not location:
        raise StoreError("no store given: pass ", Call(store="PATH"), f" or set {STORE_ENV}.")
    return location


# -- the repository's roles ----------------------------------------------------------------
# A verb (``tag``, ``checkout_step``, ``gc``...) is handed the whole Repository at its entry, as
# restic's commands get their repository. Every function below an entry takes one of these roles
# instead, the narrowest that covers what it and the functions it hands the role to use, so a
# signature says what it touches: BlobReader reads blobs back and changes nothing; StepReader also
# reads the index (through the operation's own small index role, ``view``) and names steps;
# StoreWriter also takes the lock and writes. Repository has every name of each (structural typing:
# no wrapper is made); tests/system/test_layers.py reads the syntax tree to pin that a function
# uses on its role only the role's names and hands it only to functions whose role is no wider.


class BlobReader(Protocol):
    """Blobs read back: a blob's row, and its bytes whole, into a buffer, or decoded piece by piece
    (each of these checks the hash, or leaves the check to its caller as its docstring says)."""

    location: str  # the store, as messages name it

    def blob(self, digest: str) -> BlobRecord | None: ...

    def read_blob(self, digest: str, where: str) -> bytes: ...

    def read_blob_into(self, row: BlobRecord, dest: memoryview, where: str) -> None: ...

    def decoded_pieces(
        self, row: BlobRecord, raw_size: int, space: codec.Space, where: str
    ) -> Iterator[memoryview]: ...

    def open_row(self, row: BlobRecord, where: str) -> BinaryIO: ...

    def object_size(self, key: str) -> int | None: ...

    def size_lookup(self, rows: list[BlobRecord]) -> Callable[[BlobRecord], int | None]: ...


class StepReader(BlobReader, Protocol):
    """A stored step read: the index through the operation's own small role (``view``), steps named
    by selector, the blobs planned for reading, the folders an output must stay out of."""

    where: Location

    def view(self, role: type[R]) -> R: ...

    def manifest(self, manifest_id: int) -> ManifestRecord: ...

    def resolve(self, selector: str, run: str = MAIN_RUN) -> int: ...

    def run_base(self, run: str) -> ManifestRecord | None: ...

    def content_digests(self, manifests: list[ManifestRecord]) -> dict[int, str]: ...

    def holdings(self) -> Holdings: ...

    def local_folders(self) -> list[Path]: ...

    def reading(self, rows: Iterable[BlobRecord]) -> AbstractContextManager[None]: ...

    def reading_manifest(
        self, manifest: int, rows: Iterable[BlobRecord] | None = None
    ) -> AbstractContextManager[None]: ...


class StoreWriter(StepReader, Protocol):
    """A change of the store: its lock, the index brought up to date under it, one write
    transaction of the index as a role, and the backend as the roles of store/backends/roles.py."""

    def lock(
        self, *, exclusive: bool, timeout: float, progress: Progress | None = None
    ) -> AbstractContextManager[LockHandle | LeaseHandle]: ...

    def refresh(self, held: LockHandle | LeaseHandle | None = None) -> tuple[int, int]: ...

    def refuse_writes(self) -> None: ...

    def transaction(self, role: type[R]) -> AbstractContextManager[R]: ...

    def objects(self, role: type[R]) -> R: ...


ROLES: tuple[type, ...] = (BlobReader, StepReader, StoreWriter)  # narrowest first


log = logging.getLogger("tailorstore")


INDEX_WAIT = 60.0  # seconds a write of the index waits for another process's, outside the store lock


class Repository:
    def __init__(self, where: Location, index: Index) -> None:
        self.where = where
        self.location = where.text
        self.backend: Backend = where.backend
        self.root = where.local_root  # the store directory of a local store, else None
        self._index = index
        self.spans: PackSpans | None = None  # the planned reads of the operation under way (reading)
        self.node: NodeWindows | None = None  # reads shared with this node's other ranks (share_reads_with_node)

    # -- lifecycle -----------------------------------------------------------------------
    @classmethod
    def init(cls, location: Path | str) -> Repository:
        where = resolve(location)
        if where.local_root is not None:
            root = where.local_root
            if root.exists() and not root.is_dir():
                raise StoreError(
                    f"{root}: exists and is not a directory; choose a new or empty directory for the store."
                )
            if where.index_path.exists():
                raise StoreError(f"{root}: a tailorstore already exists here.")
            if root.exists() and any(root.iterdir()):
                raise StoreError(f"{root}: the directory is not empty; choose an empty or new directory.")
            for sub in ("blobs", "tmp"):
                (root / sub).mkdir(parents=True, exist_ok=True)
        elif next(iter(where.backend.list("")), None) is not None:
            raise StoreError(f"{where.text}: this prefix already holds objects; choose an empty prefix for the store.")
        else:
            check_conditional_writes(where.backend, cache_root())
        marker = {"format_version": FORMAT_VERSION, "created_at": time.time(), "store_id": os.urandom(16).hex()}
        where.backend.put(MARKER, json.dumps(marker).encode(), create_only=True)
        if where.remote:
            where.index_path.parent.mkdir(parents=True, exist_ok=True)
            where.index_path.unlink(missing_ok=True)  # a stale cache of an earlier store at this location
        Index.create(where.index_path).close()
        return cls.open(where.text)

    @classmethod
    def open(cls, location: Path | str | None) -> Repository:
        where = resolve(_location(location))
        if where.remote and not where.index_path.is_file():
            if not where.backend.exists(MARKER):
                next(iter(where.backend.list("")), None)  # a bucket that is not there says so, not "no store"
                raise StoreError(f"{where.text}: no tailorstore here. Create one: ", Call("init", where.text), ".")
            where.index_path.parent.mkdir(parents=True, exist_ok=True)
            Index.create_if_absent(where.index_path)  # the node's other ranks may be creating it too
        store = cls(where, Index.open(where.index_path))
        try:
            if where.remote:
                _check_cache(where, store._index)
            try:  # within the connection's first, short wait (store/index/_index.py)
                store.refresh()
            except LockTimeoutError:
                # another process is inside its index transaction (stalled, or slow): read what the
                # index holds, as WAL lets readers; an operation that changes the store refreshes
                # again under the store lock, where it waits as long as its lock timeout says
                pass
            store._index.wait_for_writers(INDEX_WAIT)
        except BaseException:
            store.close()
            raise
        return store

    @property
    def read_only(self) -> bool:
        return self._index.read_only

    def refuse_writes(self) -> None:
        """Raise, naming why, when this store cannot be changed from here (before taking its lock)."""
        self._index.refuse_writes()

    def local_folders(self) -> list[Path]:
        """The folders of this host that hold the store's files, resolved: its directory (a local
        store) and its index's folder (for a remote store, this host's cache). Nothing we write may
        go into them, and nothing in them may be committed."""
        return [p.resolve() for p in (self.root, self.where.index_path.parent) if p is not None]

    def refresh(self, held: LockHandle | LeaseHandle | None = None) -> tuple[int, int]:
        """Bring the index up to date with the backend: write the objects of manifests that have
        none (a store upgraded from format 2), then import what other hosts committed and drop
        what their gc removed. Returns (imported, dropped).

        ``held`` is the store lock the caller holds. Only then are pack rows reconciled in full
        (store/packs/pack_sync.py): without it a gc may be mid-repack, and what the packs' listing says
        would be half of the truth."""
        if self.read_only:
            return 0, 0
        for manifest in self._index.unpublished():  # oldest first: a layer's source has its object before its heirs
            with self._index.transaction() as index:
                publish(self.backend, index, manifest, fence=None, replacing=True)
                write_refs(self.backend, index, [manifest])
        return sync(self.backend, self._index, locked=held is not None)

    @classmethod
    def rebuild_index(cls, location: Path | str | None) -> RebuildResult:
        """Recreate the index from the manifest objects alone (``tailor index rebuild``): for a
        lost or damaged ``index.sqlite``, or a cache on a new host.

        The new index is built beside the old one, which is never opened, and renamed over it,
        so a failure leaves the old index as it was. Run it while no other tailor process uses
        the store. Returns (manifests, blobs) of the new index.
        """
        where = resolve(_location(location))
        if not (where.backend.exists(MARKER) or any(where.backend.list("blobs/"))):
            raise StoreError(f"{where.text}: no tailorstore here, so there is no index to rebuild.")
        path = where.index_path
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.rebuild")
        for leftover in path.parent.glob(f"{tmp.name}*"):
            leftover.unlink()
        fresh = Index.create(tmp)
        try:
            if where.remote:
                _check_cache(where, fresh)  # records the store's id
            # Built alone (the docstring asks for it), so the packs' trailers are the whole truth.
            sync(where.backend, fresh, locked=True, rebuilding=True)
            counts = fresh.counts()
            fresh.checkpoint()
        except BaseException:
            fresh.close()
            for partial in path.parent.glob(f"{tmp.name}*"):  # with its -wal and -shm
                partial.unlink()
            raise
        fresh.close()
        for old in path.parent.glob(f"{path.name}-*"):  # the old index's -wal and -shm files
            old.unlink()
        os.replace(tmp, path)
        return RebuildResult(*counts)

    def close(self) -> None:
        self._index.close()

    def __enter__(self) -> Repository:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextmanager
    def lock(
        self, *, exclusive: bool, timeout: float, progress: Progress | None = None
    ) -> Iterator[LockHandle | LeaseHandle]:
        """Shared for commits, exclusive for gc: ``flock`` on a local store, leases in the
        backend on a remote one (they hold across hosts; store/lease.py). While it is held, the
        index waits for another process's write transaction as long as the lock would have waited:
        a process stalled inside its transaction (a local store's index is shared) is met with the
        same timeout and exit code as one stalled holding the lock, not 60 s and a damaged store."""
        self._index.wait_for_writers(timeout)
        if self.where.remote:
            check_conditional_writes(self.backend, cache_root())  # once per endpoint: what leases rest on
            with lease_lock(
                self.backend, exclusive=exclusive, timeout=timeout, progress=progress
            ) as lease:
                yield lease
            return
        with store_lock(self.where.lock_path, exclusive=exclusive, timeout=timeout, progress=progress) as handle:
            yield handle

    def view(self, role: type[R]) -> R:
        """The index's queries as ``role`` (a small protocol the operation declares) names them,
        and no others: the index itself is private to ``store/`` (store/index/roles.py)."""
        return view_as(self._index, role)

    def objects(self, role: type[R]) -> R:
        """The backend as ``role`` (composed of store/backends/roles.py's ``Reader``, ``Lister``,
        ``Writer``, ``Remover``, ``Leftovers``) names it, and nothing else: above ``store/``, the
        one way to the store's objects, asked for once at an operation's entry."""
        return view_target_as(self.backend, role, "the backend")

    @contextmanager
    def transaction(self, role: type[R]) -> Iterator[R]:
        """One write transaction of the index, seen as ``role``: its changes commit together or
        not at all."""
        with self._index.transaction() as edit:
            yield view_as(edit, role)

    # -- blobs ---------------------------------------------------------------------------
    def blob(self, digest: str) -> BlobRecord | None:
        return self._index.blob(digest)

    def held_blobs(self) -> set[str]:
        """Every blob the backend holds: loose blob objects and the entries of every pack."""
        held = set(blob_names(self.backend))
        for name in pack_names(self.backend):
            held.update(e.hash for e in read_trailer(self.backend, name)[1])
        return held

    def holdings(self) -> Holdings:
        """The size of every loose blob and pack the backend holds, from one listing of each."""
        return Holdings.of(self.backend)

    def size_lookup(self, rows: list[BlobRecord]) -> Callable[[BlobRecord], int | None]:
        """How many stored bytes each row's object holds (:meth:`stored_bytes`), learnt with the
        fewest requests: on an object store one listing (a request per 1,000 objects) when that
        costs fewer than a HEAD per loose blob; otherwise a size per loose blob and one per pack."""
        loose = sum(r.pack is None for r in rows)
        if self.where.remote and loose > 1 + self._index.loose_blob_count() // LIST_PAGE:
            return self.holdings().stored_bytes
        pack_sizes: dict[str, int | None] = {}

        def one(row: BlobRecord) -> int | None:
            if row.pack is None:
                return self.stored_bytes(row)
            if row.pack not in pack_sizes:
                pack_sizes[row.pack] = self.object_size(row.key())
            size = pack_sizes[row.pack]
            return None if size is None else stored_part(row, size)

        return one

    def object_size(self, key: str) -> int | None:
        try:
            return self.backend.size(key)
        except FileNotFoundError:
            return None

    def stored_bytes(self, row: BlobRecord) -> int | None:
        """How many of the blob's stored bytes its object holds (``stored_size`` when intact),
        or None when the object is missing."""
        size = self.object_size(row.key())
        return None if size is None else stored_part(row, size)

    @contextmanager
    def reading(self, rows: Iterable[BlobRecord]) -> Iterator[None]:
        """Say which blobs the operation in this block will read. On an object store their packs
        are then read a span at a time instead of a request per blob (:mod:`pack_spans`); on a
        local disk, where a read costs no round trip, this changes nothing. An operation inside
        another one's block reads by the outer plan."""
        if not self.where.remote or self.spans is not None:
            yield
            return
        self.spans = PackSpans(self.backend, rows, fetch=self.node.read if self.node is not None else None)
        try:
            yield
        finally:
            self.spans = None

    def share_reads_with_node(self) -> None:
        """From now on, what this process reads of a remote store is fetched once for every process
        of this host that shares its cache folder (the ranks of a node), a window at a time
        (store/packs/node_windows.py). A framework adapter turns it on for a node of several ranks;
        a local store is read from its disk and needs none."""
        if not self.where.remote or self.node is not None:
            return
        folder = self.where.index_path.parent / "node-windows"
        try:
            self.node = NodeWindows(self.backend, folder)
            prune(folder)
        except OSError as exc:  # no folder to share through (a file in its place, a full disk): read alone
            self.node = None
            log.warning("tailorstore: this rank reads the store on its own, not shared with its node: %s", exc)

    @contextmanager
    def reading_manifest(self, manifest: int, rows: Iterable[BlobRecord] | None = None) -> Iterator[None]:
        """:meth:`reading` of the blobs a manifest needs (``rows``, else all of them, asked of the index
        only when it helps). A blob found missing meanwhile is told apart from damage: when the
        manifest itself is gone after a fresh look (another process removed or replaced the step
        while this one read it), the error says so (:class:`StepChangedError`, exit 4: run it again)."""
        if rows is None:
            rows = self._index.referenced_blobs(manifest) if self.where.remote else ()
        record = self._index.manifest(manifest)
        try:
            with self.reading(rows):
                yield
        except BlobMissingError:
            if self._still_recorded(manifest):
                raise
            raise StepChangedError(
                f"step {record.step if record else '?'} was removed or replaced by another process while it "
                "was read, so this read stopped and kept nothing of it; run it again to read what the store "
                "holds now."
            ) from None

    def _still_recorded(self, manifest: int) -> bool:
        try:
            self.refresh()
        except (OSError, TailorError):
            return True  # cannot tell: report the missing blob as it is
        return self._index.manifest(manifest) is not None

    def open_row(self, row: BlobRecord, where: str) -> BinaryIO:
        """A reader of exactly the blob's stored bytes, loose or inside its pack."""
        key = row.key()
        missing = BlobMissingError(
            f"{where}: blob {row.hash} is missing from {self.location}/{key}; it was deleted behind the "
            "store's back. To see every step it affects: ",
            Call("verify"),
            ".",
        )
        spans = self.spans
        planned = spans.open(row) if spans is not None else None
        if planned is not None:
            return planned  # type: ignore[return-value]
        try:
            if self.node is not None:
                return _Reading(self.node.reader(key, row.pack_offset or 0, row.stored_size), missing)  # type: ignore[arg-type,return-value]
            # The stored size bounds the read: an object store needs no request to learn it.
            return _Reading(self.backend.reader(key, row.pack_offset or 0, row.stored_size), missing)  # type: ignore[return-value]
        except FileNotFoundError:
            raise missing from None

    def decoded_pieces(self, row: BlobRecord, raw_size: int, space: codec.Space, where: str) -> Iterator[memoryview]:
        """A blob's ``raw_size`` raw bytes in pieces, each at most a codec chunk, decoded into
        ``space(n)``; the caller hashes them. An archived blob needs its chain, so it comes whole,
        rebuilt and already hash-checked (archive_codec.py): one piece of the blob's size."""
        if archive_codec.is_archive(row.codec):
            if raw_size != row.raw_size:
                raise CorruptStoreError(f"{where}: blob {row.hash} holds {row.raw_size} bytes, not {raw_size}")
            whole = memoryview(bytearray(row.raw_size))
            self._read_archived_into(row, whole, where)
            yield whole
            return
        with self.open_row(row, where) as f:
            yield from codec.decode_pieces(row.codec, f, raw_size, space, f"{where}: blob {row.hash}")

    def read_blob_into(self, row: BlobRecord, dest: memoryview, where: str) -> None:
        """Decode a blob into ``dest`` and check its hash; never leaves unchecked bytes behind."""
        if archive_codec.is_archive(row.codec):
            self._read_archived_into(row, dest, where)
            return
        with self.open_row(row, where) as f:
            codec.decode_into(row.codec, f, dest, f"{where}: blob {row.hash}")
        if codec.content_hash(dest) != row.hash:
            raise damaged_blob(where, row.hash)

    def _read_archived_into(self, row: BlobRecord, dest: memoryview, where: str) -> None:
        """An archived blob (store/archive_codec.py): its chain decoded from the keyframe on, each
        link hash-checked, with two buffers of the blob's size whatever the chain's length.

        Every base's own descriptor must name exactly the bases before it, so a chain read from a
        hostile index can neither loop nor grow past ``MAX_CHAIN``."""
        spec = archive_codec.parse(row.codec, row.raw_size, f"{where}: blob {row.hash}")
        links: list[tuple[BlobRecord, archive_codec.ArchiveSpec | None]] = []
        for i, digest in enumerate(spec.bases):
            base = self.blob(digest)
            if base is None or base.raw_size != row.raw_size:
                raise CorruptStoreError(
                    f"{where}: archived blob {row.hash} is built on blob {digest}, which the index does not hold "
                    "at that size; the store is damaged. To see every step it affects: ",
                    Call("verify"),
                    ".",
                )
            base_spec = None
            if archive_codec.is_archive(base.codec):
                base_spec = archive_codec.parse(base.codec, base.raw_size, f"{where}: blob {digest}")
                if base_spec.bases != spec.bases[:i]:
                    raise CorruptStoreError(f"{where}: archived blob {row.hash} names a chain its bases disagree with")
            elif i:
                raise CorruptStoreError(f"{where}: archived blob {row.hash} names a whole blob inside its chain")
            links.append((base, base_spec))
        links.append((row, spec))
        previous: memoryview | None = None
        codec.check_raw_size(row.raw_size, row.stored_size, f"{where}: blob {row.hash}")
        spare = memoryview(bytearray(row.raw_size)) if links[:-1] else None
        for i, (link, link_spec) in enumerate(links):
            out = dest if (len(links) - 1 - i) % 2 == 0 else spare
            assert out is not None
            place = f"{where}: blob {link.hash}" + (f" (in the chain of {row.hash})" if link is not row else "")
            if link_spec is None:
                with self.open_row(link, place) as f:
                    codec.decode_into(link.codec, f, out, place)
            else:
                with self.open_row(link, place) as f:
                    payload = f.read(link.stored_size + 1)
                if len(payload) != link.stored_size:
                    raise CorruptStoreError(f"{place}: {len(payload)} stored bytes, the index says {link.stored_size}")
                archive_codec.decode_into(link_spec, payload, previous, out, place)
            if codec.content_hash(out) != link.hash:
                raise damaged_blob(place, link.hash)
            previous = out

    def read_blob(self, digest: str, where: str) -> bytes:
        row = self.blob(digest)
        if row is None:
            raise CorruptStoreError(f"{where}: blob {digest} has no row in the index")
        codec.check_raw_size(row.raw_size, row.stored_size, f"{where}: blob {digest}")
        buf = bytearray(row.raw_size)
        self.read_blob_into(row, memoryview(buf), where)
        return bytes(buf)

    # -- manifests -----------------------------------------------------------------------
    def resolve(self, selector: str, run: str = MAIN_RUN) -> int:
        """The manifest id that ``id=N``, ``step=N`` (or a bare N), ``tag=NAME`` or ``latest`` names.

        Steps are numbered per run: ``step=N`` and ``latest`` look in ``run``, or in the run a
        ``RUN:`` prefix names (``ft:step=200``). A run branched from another run's step
        reaches that base as ``latest`` until it has commits of its own, and by the base's step.
        ``tag=``, ``id=`` and ``digest=`` name one manifest in the whole store; an id is the short
        hex name every host gives that manifest (``records.stable_id``), a digest the hash of what
        it holds (``store/digest.py``). Merges carry their base's
        step, so they are named by ``tag=`` or ``id=`` (``tailor log`` prints both); a step
        that only merges carry is refused with the list of them.
        """
        text = selector.strip()
        prefixed = re.fullmatch(r"([A-Za-z0-9._-]+):(.*)", text)
        if prefixed:
            run, text = prefixed.group(1), prefixed.group(2)
        where = "" if run == MAIN_RUN else f" of run {run!r}"
        if text == "latest":
            latest = self._index.highest_step_commit(run) or self.run_base(run)
            if latest is None:
                raise UnknownStepError(f"run {run!r} holds no steps yet; commit one with ", Call("commit", "DIR"), ".")
            return latest.id
        if text.startswith("id=") and not prefixed:
            return self._by_stable_id(text[3:])
        if text.startswith("digest=") and not prefixed:
            return self._by_digest(text[7:])
        match = re.fullmatch(r"(?:step=)?(\d+)", text)
        if match:
            step = check_step(int(match.group(1)))
            found = self._index.manifests_at(step, run)
            commits = [m for m in found if m.origin == COMMIT]
            if commits:
                return commits[0].id
            if found:
                names = ", ".join(f"id={m.name} ({m.origin}, tag {', '.join(m.tags) or '-'})" for m in found)
                raise UnknownStepError(f"step {step}{where} has no commit, only: {names}. Name one by its id= or tag=.")
            base = self.run_base(run)
            if base is not None and base.step == step:
                return base.id
            if run != MAIN_RUN and not any(r.name == run for r in self._index.runs()):
                raise UnknownStepError(f"the store has no run {run!r}; ", Call("runs"), " lists the runs.")
            raise UnknownStepError(
                f"step {step} is not in the store{where}; ", Call("log"), " lists the steps it holds."
            )
        if text.startswith("tag=") and not prefixed:
            tagged = self._index.tagged(text[4:])
            if tagged is None:
                raise UnknownStepError(f"nothing is tagged {text[4:]!r}; ", Call("log"), " shows the tags.")
            return tagged.id
        raise UnknownStepError(
            f"cannot read {selector!r}: write step=N, RUN:step=N, tag=NAME, id=HEX, digest=HEX or latest."
        )

    def content_digests(self, manifests: list[ManifestRecord]) -> dict[int, str]:
        """The content digest (store/digest.py) of each manifest given, by its row id: from this host's
        cache beside the index where it has them, else from the index's rows (and then kept)."""
        from tailorstore.store.digest import ContentRows, DigestCache

        path = self.where.index_path.with_name(self.where.index_path.name + "-digests.json")
        cache = DigestCache(path, self._index.meta("created_at") or "")
        rows = self.view(ContentRows)
        out = {m.id: cache.digest(rows, m.id, m.object_key) for m in manifests}
        cache.save({m.object_key for m in self._index.manifests() if m.object_key})
        return out

    def _by_digest(self, prefix: str) -> int:
        """The manifest whose content digest (store/digest.py) starts with ``prefix``: at least 8 hex
        digits. Two manifests holding the same bytes (a merge equal to its base, one checkpoint
        committed to two runs) share a digest; such a prefix is refused with their ids."""
        from tailorstore.store.digest import DIGEST_DIGITS, MIN_DIGITS

        if not re.fullmatch(rf"[0-9a-f]{{{MIN_DIGITS},{DIGEST_DIGITS}}}", prefix):
            raise UnknownStepError(
                f"digest={prefix[:40]!r} names no manifest: a digest is the hex content hash ",
                Call("log"),
                f" prints ({MIN_DIGITS} to {DIGEST_DIGITS} of its leading digits, lowercase).",
            )
        manifests = self._index.manifests()
        digests = self.content_digests(manifests)
        found = [m for m in manifests if digests[m.id].startswith(prefix)]
        if not found:
            raise UnknownStepError(f"no manifest holds content of digest {prefix}; ", Call("log"), " lists them.")
        if len(found) > 1:
            names = ", ".join(f"id={m.name} (run {m.run}, step {m.step})" for m in found[:5])
            raise UnknownStepError(
                f"digest={prefix} names {len(found)} manifests: {names}; they hold the same bytes (or give more "
                "digits): name one by its id="
            )
        return found[0].id

    def _by_stable_id(self, prefix: str) -> int:
        """The manifest whose stable id (records.stable_id) starts with ``prefix``, as git takes a
        commit's abbreviated hash: at least 4 hex digits, and naming one manifest only."""
        if not re.fullmatch(r"[0-9a-f]{4,16}", prefix):
            raise UnknownStepError(
                f"id={prefix[:40]!r} names no manifest: an id is the hex name ",
                Call("log"),
                " prints (at least 4 of its digits), the same on every host.",
            )
        found = [m for m in self._index.manifests() if m.name.startswith(prefix)]
        if not found:
            raise UnknownStepError(f"no manifest has id {prefix}; ", Call("log"), " lists the ids.")
        if len(found) > 1:
            names = ", ".join(f"id={m.name} (step {m.step})" for m in found[:5])
            raise UnknownStepError(f"id={prefix} names {len(found)} manifests: {names}; give more digits.")
        return found[0].id

    def run_base(self, run: str) -> ManifestRecord | None:
        """The manifest a run branched from, if it was branched and the base is still held."""
        record = self._index.run(run)
        return self._index.by_object_key(record.base) if record and record.base else None

    def manifest(self, manifest_id: int) -> ManifestRecord:
        found = self._index.manifest(manifest_id)
        if found is None:
            raise UnknownStepError(f"manifest {manifest_id} is not in the store")
        return found
