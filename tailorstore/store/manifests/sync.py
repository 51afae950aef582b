"""Index sync: the SQLite index brought up to date with the backend, which is the truth.

The index is only a cache of the manifest objects. :func:`sync` imports the manifests of
other hosts, drops those another host's gc dropped, takes tags, pins and runs from their
objects, and places blobs as the packs say. ``Repository.refresh`` runs it (on every open), and
``Repository.rebuild_index`` on a new index.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from tailorstore.core.records import RunRecord
from tailorstore.store.backends.base import Backend
from tailorstore.store.index._index import Index
from tailorstore.store.manifests.document import ManifestDocument, decode
from tailorstore.store.manifests.keys import current_of, listed_manifest_keys, pin_key
from tailorstore.store.manifests.refs import current_refs, listed_tags, pinned_keys
from tailorstore.store.manifests.runs import listed_runs
from tailorstore.store.packs.pack import pack_names
from tailorstore.store.packs.pack_sync import packs_agree, reconcile_packs


def sync(backend: Backend, index: Index, *, locked: bool, rebuilding: bool = False) -> tuple[int, int]:
    """Import the manifests the backend holds and the index lacks, drop those it no longer holds,
    take tags, pins and runs from the backend, and place blobs as the packs say (fully only when
    ``locked``: the caller holds the store lock; store/packs/pack_sync.py says why). Returns (imported,
    dropped). ``rebuilding`` (a new index, built alone) passes over a pack whose trailer is damaged,
    with a warning, rather than building nothing: ``verify`` then names the blobs it held.

    Reads first and writes only when something differs, so opening an unchanged store takes no
    write lock: one LIST of manifests, refs and packs, and one GET per tag. When something
    differs, everything is listed again inside the index's write transaction: a commit, a gc or
    a thinning of this store changes its manifest objects inside its own index transaction, so a
    listing taken inside ours cannot fall between their object and their rows (a listing taken
    before could: a thinned step's new version not listed yet, its rows already naming it, would
    have looked dropped).
    """
    if _Listing.take(backend, index).agrees(index, locked=locked):
        return 0, 0
    with index.transaction():
        seen = _Listing.take(backend, index)
        # Another host's gc may still delete a manifest between the listing and the read: what is
        # gone by then is treated as never listed.
        docs = {k: doc for k in seen.new if (doc := _read_if_held(backend, k)) is not None}
        new = [k for k in seen.new if k in docs]
        gone = seen.gone
        index.delete_manifests(gone)
        ids = {k: v for k, v in seen.indexed.items() if k in seen.present}
        for key in _order(new, docs):
            if not index.has_object(key):
                import_document(index, key, docs[key], ids)
        # after the imports: a manifest's blob rows say where the blob was when it was committed
        reconcile_packs(backend, index, seen.packs, locked=locked, skip_damaged=rebuilding)
        index.set_refs({mid: (seen.tags.get(key, ()), pin_key(key) in seen.pins) for key, mid in ids.items()})
        index.set_runs(seen.listed_runs.values())
    return len(new), len(gone)


@dataclass
class _Listing:
    """The backend's manifests, refs and packs beside what the index holds, at one moment."""

    packs: set[str]
    present: set[str]
    indexed: dict[str, int]
    tags: dict[str, tuple[str, ...]]  # current manifest key -> its tags
    pins: set[str]
    listed_runs: dict[str, RunRecord]
    known_runs: dict[str, RunRecord]
    indexed_refs: dict[int, tuple[tuple[str, ...], bool]]  # (tags, pinned) as the index has them

    @classmethod
    def take(cls, backend: Backend, index: Index) -> _Listing:
        packs = set(pack_names(backend))
        current = current_of(listed_manifest_keys(backend))
        present = set(current.values())
        records = index.manifests()
        known_runs = index.created_runs()
        return cls(
            packs=packs,
            present=present,
            indexed={r.object_key: r.id for r in records if r.object_key is not None},
            tags=current_refs(listed_tags(backend), current),
            pins={pin_key(current.get(key, key)) for key in pinned_keys(backend, current)},
            listed_runs=listed_runs(backend, known_runs),
            known_runs=known_runs,
            indexed_refs={r.id: (r.tags, r.pinned) for r in records if r.object_key in present},
        )

    @property
    def gone(self) -> list[int]:
        return [mid for key, mid in self.indexed.items() if key not in self.present]

    @property
    def new(self) -> list[str]:
        return sorted(self.present - self.indexed.keys())

    def listed_refs(self) -> dict[int, tuple[tuple[str, ...], bool]]:
        """(tags, pinned) of each indexed manifest as the backend's ref objects say."""
        return {
            mid: (self.tags.get(key, ()), pin_key(key) in self.pins)
            for key, mid in self.indexed.items()
            if key in self.present
        }

    def agrees(self, index: Index, *, locked: bool) -> bool:
        return (
            not self.gone
            and not self.new
            and self.indexed_refs == self.listed_refs()
            and self.listed_runs == self.known_runs
            and packs_agree(index, self.packs, locked=locked)
        )


def _read_if_held(backend: Backend, key: str) -> Any:
    try:
        return decode(backend.get(key), key)
    except FileNotFoundError:
        return None


def import_document(index: Index, key: str, doc: ManifestDocument, ids: dict[str, int]) -> int:
    """Insert one manifest object's rows; ``ids`` maps object keys already in the index to local ids."""
    # where a blob is, the packs decide: a known blob keeps its row
    index.add_blobs(doc.blobs)
    manifest = index.insert_manifest(replace(doc.manifest, object_key=key))
    ids[key] = manifest
    index.insert_files(manifest, doc.files)
    index.insert_atoms(manifest, doc.atoms)
    # A source gc dropped since: the layer's atoms are this manifest's own rows anyway (FORMAT.md 7).
    layers = [replace(layer, source=ids.get(source, manifest) if source else manifest) for layer, source in doc.layers]
    index.insert_layers(manifest, layers)
    return manifest


def _order(keys: list[str], docs: dict[str, ManifestDocument]) -> list[str]:
    """Sources before the manifests that inherit from them (sources are always older)."""
    return sorted(keys, key=lambda k: (docs[k].manifest.created_at, k))
