"""Every query and change of the store's index that code above the index may use.

The index (``store/index/_index.py``) is SQLite with some seventy methods; it is private to ``store/``.
These two protocols are the whole of what may be asked of it: :class:`Catalogue`, the queries,
and :class:`CatalogueEdit`, the changes, made only inside a transaction. No operation sees
either whole: each declares a role, a protocol of at most eight of these methods
(store/index/roles.py), and gets a view that answers only those (``Repository.view(Role)``,
``Repository.transaction(Role)``). Inserting a manifest's rows is in no role: only
``store/publish.py`` does it. Every query returns records from ``core/records.py``,
never tuples or SQLite rows, and SQLite's errors arrive as this library's own
(``index_failed``). tests/system/test_layers.py checks that nothing outside ``store/`` imports the index
or this module, and that each operation calls only what its role names.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol, runtime_checkable

from tailorstore.core.records import (
    AtomContent,
    AtomKey,
    AtomRecord,
    BlobRecord,
    BlobUse,
    FileContent,
    FileRecord,
    IndexCounts,
    KindTotals,
    LayerRecord,
    LayerTotals,
    ManifestRecord,
    RunRecord,
    StoredLayer,
)


@runtime_checkable
class Catalogue(Protocol):
    """The queries: manifests, runs, refs, files, atoms, layers, blobs and packs, and totals."""

    @property
    def read_only(self) -> bool:
        """True when the index was opened read-only (a remote store's cache without the lock)."""
        ...

    def atoms(
        self,
        manifest: int,
        *,
        layer: str | None = None,
        path: str | None = None,
        param: str | None = None,
        kind: str | None = None,
        derived: bool | None = None,
    ) -> list[AtomRecord]:
        """A manifest's atoms, by file, tensor slot and offset, optionally filtered; ``derived`` True or False
        keeps only derived or only stored pieces."""
        ...

    def atoms_by_key(self, manifest: int, layer: str | None = None) -> dict[AtomKey, AtomRecord]:
        """The manifest's atoms (optionally of one layer) by what they are, not where they sit."""
        ...

    def blob(self, digest: str) -> BlobRecord | None: ...

    def blob_hashes(self, *, loose_only: bool = False) -> set[str]: ...

    def blob_object_bytes(self) -> int:
        """What the backend holds for blobs: loose blob objects and whole packs."""
        ...

    def blob_uses(self, manifests: list[int]) -> list[BlobUse]:
        """Where each blob of the given manifests is used, in words (for verify's messages)."""
        ...

    def blobs_in_pack(self, name: str) -> list[BlobRecord]: ...

    def blobs_unused_by(self, keep: Iterable[int]) -> list[BlobRecord]:
        """Blob rows that none of the ``keep`` manifests needs (what gc may drop)."""
        ...

    def by_object_key(self, key: str) -> ManifestRecord | None: ...

    def bytes_alone(self) -> dict[int, int]:
        """Per manifest: stored bytes of the blobs no other manifest uses."""
        ...

    def commit_at(self, step: int, run: str) -> ManifestRecord | None: ...

    def commits_before(self, step: int, run: str) -> int: ...

    def count_atoms(self, manifest: int, layer: str, kind: str) -> int: ...

    def counts(self) -> IndexCounts: ...

    def content_rows(self, manifest: int) -> tuple[list[FileContent], list[AtomContent]]:
        """A manifest's files by path and atoms by (path, slot, offset): what its digest hashes."""
        ...

    def created_runs(self) -> dict[str, RunRecord]:
        """The runs created by name (each has an object in the backend), by name."""
        ...

    def files(self, manifest: int) -> list[FileRecord]: ...

    def has_pack(self, name: str) -> bool: ...

    def integrity_problems(self) -> list[str]:
        """What SQLite itself finds wrong: page-level damage and dangling foreign keys."""
        ...

    def kind_totals(self) -> list[KindTotals]:
        """Per atom kind over all manifests: raw bytes, derived bytes, stored bytes of its blobs."""
        ...

    def highest_step_commit(self, run: str) -> ManifestRecord | None:
        """The run's commit of the highest step."""
        ...

    def layer(self, manifest: int, layer: str) -> LayerRecord | None: ...

    def layer_history(self, before_step: int, run: str) -> list[StoredLayer]:
        """Every layer of every whole commit of the run before ``before_step``, newest step first (for
        inheritance: a thinned step keeps no optimizer state to inherit)."""
        ...

    def layer_names(self) -> set[str]: ...

    def layer_stored_bytes(self, manifest: int) -> dict[str, int]:
        """Per layer of a manifest: stored bytes of the distinct blobs it uses."""
        ...

    def layer_totals(self, manifest: int) -> list[LayerTotals]:
        """Per layer of a manifest: its kinds, raw bytes, and bytes derived rather than stored."""
        ...

    def layers(self, manifest: int) -> list[LayerRecord]: ...

    def loose_blob_count(self) -> int: ...

    def manifest(self, manifest: int) -> ManifestRecord | None: ...

    def manifests(self, run: str | None = None) -> list[ManifestRecord]:
        """Every manifest (of one run, if given), by step, then in the order they were recorded."""
        ...

    def manifests_at(self, step: int, run: str) -> list[ManifestRecord]: ...

    def last_recorded_commit(self, run: str) -> ManifestRecord | None:
        """The run's commit recorded last, whatever its step."""
        ...

    def non_atom_blob_bytes(self) -> int:
        """Stored bytes of blobs no atom uses: whole files, skeletons, headers and containers."""
        ...

    def object_keys(self, manifests: Iterable[int]) -> dict[int, str | None]: ...

    def packs(self) -> dict[str, int]:
        """Pack name -> size of its object."""
        ...

    def packs_named_by_blobs(self) -> set[str]:
        """Every pack some blob row names (read from the ``blobs_pack`` index)."""
        ...

    def param_sizes(self, manifest: int, kinds: tuple[str, str]) -> dict[str, int]:
        """Each parameter's element count (the end of its furthest piece of the given kinds)."""
        ...

    def referenced_blobs(self, manifest: int) -> list[BlobRecord]:
        """The blob rows a manifest needs: file contents, skeletons, containers and stored atoms."""
        ...

    def referenced_hashes(self, manifest: int) -> set[str]:
        """The hashes a manifest needs, whether or not they have a blob row."""
        ...

    def run(self, name: str) -> RunRecord | None: ...

    def runs(self) -> list[RunRecord]:
        """Every run: those created by name and those that only have manifests ('main' among them)."""
        ...

    def tagged(self, tag: str) -> ManifestRecord | None: ...

    def unpublished(self) -> list[int]:
        """Manifests without an object yet (a store upgraded from format 2), oldest first."""
        ...


@runtime_checkable
class CatalogueEdit(Catalogue, Protocol):
    """The changes, made inside one ``Repository.transaction(Role)``: they commit together or not at all."""

    def add_blobs(self, blobs: Iterable[BlobRecord]) -> None:
        """Record blobs not known yet; a known blob keeps its row (where it is, packs decide)."""
        ...

    def add_packs(self, packs: Iterable[tuple[str, int]]) -> None: ...

    def delete_blobs(self, hashes: Iterable[str]) -> None: ...

    def delete_commit_at(self, step: int, run: str) -> None: ...

    def delete_manifests(self, manifests: Iterable[int]) -> None:
        """Drop manifests; their files, atoms and layers go with them (foreign keys cascade)."""
        ...

    def delete_packs(self, names: Iterable[str]) -> None: ...

    def insert_atoms(self, manifest: int, atoms: Iterable[AtomRecord]) -> None: ...

    def insert_files(self, manifest: int, files: Iterable[FileRecord]) -> None: ...

    def insert_layers(self, manifest: int, layers: Iterable[LayerRecord]) -> None: ...

    def insert_manifest(self, record: ManifestRecord) -> int:
        """Record a manifest (its ``id`` is ignored); returns the new local id."""
        ...

    def move_blobs(self, placed: dict[str, tuple[str, int]]) -> None:
        """Point blobs at their new pack and offset (after a repack)."""
        ...

    def replace_contents(self, manifest: int, files: list[FileRecord], atoms: list[AtomRecord]) -> None:
        """A manifest's file and atom rows, all replaced (thinning keeps a subset of them)."""
        ...

    def set_pinned(self, manifest: int, pinned: bool) -> None: ...

    def set_runs(self, runs: Iterable[RunRecord]) -> None:
        """Replace the run rows with these (the backend's run objects are the truth)."""
        ...

    def add_tag(self, manifest: int, tag: str) -> None:
        """Tag a manifest; a tag that named another manifest moves here (a manifest holds any number)."""
        ...

    def drop_tag(self, tag: str) -> None: ...

    def set_tier(self, manifest: int, tier: str | None) -> None: ...

    def set_metrics(self, manifest: int, metrics: str | None) -> None: ...

    def upsert_blobs(self, blobs: Iterable[BlobRecord]) -> None:
        """Record blobs; a blob already known takes the new location (a repaired or repacked blob)."""
        ...
