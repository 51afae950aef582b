"""The read path's role view of the index: what a manifest holds (store/index/roles.py).

Checkout, export, resharding, the readers of atoms and the operations that derive a new
manifest's rows from stored ones (merge, averaging, thinning) ask only this of the index."""

from __future__ import annotations

from typing import Protocol

from tailorstore.core.records import AtomKey, AtomRecord, BlobRecord, FileRecord, LayerRecord


class Contents(Protocol):
    """A manifest's files, atoms and layers, and the blobs it needs (the full signatures and their
    meaning: store/index/catalogue.py)."""

    def files(self, manifest: int) -> list[FileRecord]: ...

    def atoms(
        self,
        manifest: int,
        *,
        layer: str | None = None,
        path: str | None = None,
        param: str | None = None,
        kind: str | None = None,
        derived: bool | None = None,
    ) -> list[AtomRecord]: ...

    def atoms_by_key(self, manifest: int, layer: str | None = None) -> dict[AtomKey, AtomRecord]: ...

    def layers(self, manifest: int) -> list[LayerRecord]: ...

    def layer(self, manifest: int, layer: str) -> LayerRecord | None: ...

    def referenced_blobs(self, manifest: int) -> list[BlobRecord]: ...

    def referenced_hashes(self, manifest: int) -> set[str]: ...
