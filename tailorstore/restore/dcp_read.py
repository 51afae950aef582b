"""One DCP folder of a stored step, read item by item from the store: what a DCP ``StorageReader``
needs, with no file written (``integrations/dcp/reader.py`` wraps it for ``dcp.load``).

A ``.distcp`` file was stored as its container (the bytes between tensor data: zip records,
pickles, the pickled objects of ``BYTE_IO`` items) and one atom per tensor item, placed at its
``file_offset``. So a tensor item is its atom, decoded (hash-checked) straight into the memory
the caller gives, and an object item is a range of the container, whose own hash is checked when
it is read. ``.metadata`` is read again as hostile input (formats/dcp.py), as every reader of the
store does.

Call order: :func:`open_dcp_step` (on each rank; it resolves nothing itself: the caller gives
the manifest), then any number of :meth:`DcpStep.tensor_into` and :meth:`DcpStep.object_bytes`.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass, field

from tailorstore.access.atom_reader import blob_of, decode_atom_into, decode_stored_atom
from tailorstore.access.contents import Contents
from tailorstore.access.dcp_folders import dcp_folders, folder_metadata
from tailorstore.core.errors import Call, CorruptStoreError, StoreError, ThinnedStepError, UnsafePickleError
from tailorstore.core.records import AtomRecord, BlobRecord, FileRecord
from tailorstore.core.tensor_ref import DTYPES
from tailorstore.formats import dcp
from tailorstore.formats.torch_pickle import MemorySource, ObjectVerdicts
from tailorstore.formats.torch_zip import gaps
from tailorstore.restore.checkout import inherited_layers
from tailorstore.store.repo import Repository


@dataclass
class DcpStep:
    """A stored DCP folder: its checked metadata, and each item's place in the store."""

    store: Repository
    manifest: int
    step: int
    folder: str  # the folder's path in the step ("step-6", or "" at the top)
    metadata: dcp.DcpMetadata
    files: dict[str, FileRecord]  # .distcp file name -> its row
    tier: str | None = None  # thinned by gc to this tier: its optimizer moments are gone
    inherited: dict[str, int] = field(default_factory=dict)  # a composite: layer -> the step it comes from
    # (file, item offset) -> the item's pieces in file order (one, as commits cut DCP items today)
    _atoms: dict[tuple[str, int], list[AtomRecord]] = field(default_factory=dict)
    _containers: dict[str, bytes] = field(default_factory=dict)  # file -> its container, once read
    _items: dict[tuple[str, tuple[int, ...] | None], dcp.Item] = field(default_factory=dict)
    _rows: dict[str, BlobRecord] = field(default_factory=dict)  # every stored piece's blob row, looked up once
    _verdicts: ObjectVerdicts = field(default_factory=ObjectVerdicts)  # each distinct object item checked once

    def item(self, fqn: str, chunk_offsets: tuple[int, ...] | None) -> dcp.Item:
        """The stored item of ``fqn`` (a tensor's chunk at ``chunk_offsets``, or an object)."""
        if not self._items:
            for items in self.metadata.items.values():
                for one in items:
                    self._items[(one.fqn, one.chunk.offsets if one.chunk is not None else None)] = one
        found = self._items.get((fqn, chunk_offsets))
        if found is None:
            raise StoreError(f"step {self.step}: no item of {fqn} at {chunk_offsets} in its DCP folder")
        return found

    def any_thread(self, item: dcp.Item) -> bool:
        """Whether :meth:`tensor_into` of ``item`` may run on another thread than the index's: its
        pieces are stored, not rebuilt from a master (which needs the index)."""
        return all(a.derived is None for a in self._atoms.get((item.file, item.offset), []))

    def check_held(self, items: list[dcp.Item]) -> None:
        """Refuse, before anything is read, a tensor item the store keeps no piece of: in a step gc
        thinned, the state its tier dropped (the model alone still loads); elsewhere, damage."""
        for item in items:
            if item.chunk is None or not item.chunk.numel or self._atoms.get((item.file, item.offset)):
                continue
            where = f"step {self.step}, {self._path(item.file)}, item {item.fqn}"
            if self.tier is not None:
                raise ThinnedStepError(
                    f"{where}: step {self.step} was thinned to {self.tier} by gc, which dropped this state "
                    "(the optimizer's moments), so it cannot be loaded or resumed from. Load the model alone "
                    "(a state dict of the model's entries only), or ",
                    Call("export", f"step={self.step}", out="DIR"),
                    " for its weights as safetensors.",
                )
            raise CorruptStoreError(f"{where}: the store holds no piece of it; run ", Call("verify"))

    def reading(self) -> AbstractContextManager[None]:
        """The block in which items are read: on an object store, their packs are read a span at
        a time (:meth:`Repository.reading`)."""
        return self.store.reading_manifest(self.manifest, self._rows.values())

    def tensor_into(self, item: dcp.Item, dest: memoryview) -> None:
        """Decode a tensor item's elements into ``dest`` (its exact size), hash-checked; on any
        thread where :meth:`any_thread` says so."""
        if item.chunk is None:
            raise StoreError(f"step {self.step}: {item.fqn} is an object, not a tensor")
        if item.chunk.numel == 0 and len(dest) == 0:
            return
        if len(dest) != item.chunk.numel * DTYPES[self.metadata.tensors[item.fqn].dtype].itemsize:
            raise StoreError(
                f"step {self.step}: {item.fqn} is a chunk of {list(item.chunk.sizes)} "
                f"{self.metadata.tensors[item.fqn].dtype} elements, and {len(dest)} bytes were given for it"
            )
        self.check_held([item])
        pieces = self._atoms[(item.file, item.offset)]
        where = f"step {self.step}, {self._path(item.file)}, item {item.fqn}"
        first = pieces[0].file_offset or 0
        at = 0
        for atom in pieces:
            if (atom.file_offset or 0) - first != at or at + atom.nbytes > len(dest):
                raise CorruptStoreError(f"{where}: its pieces do not tile its {len(dest)} bytes; run ", Call("verify"))
            row = self._rows.get(atom.blob) if atom.derived is None else None
            if row is not None:
                decode_stored_atom(self.store, row, dest[at : at + atom.nbytes], where)  # no SQL: any thread
            else:
                decode_atom_into(self.store, self.manifest, atom, dest[at : at + atom.nbytes], where)
            at += atom.nbytes
        if at != len(dest):
            raise CorruptStoreError(f"{where}: its pieces hold {at} bytes, not {len(dest)}; run ", Call("verify"))

    def object_bytes(self, item: dcp.Item, *, trust_objects: bool = False) -> bytes:
        """An object item's pickled bytes (a ``BYTE_IO`` item), from its file's container, only if
        they pass the pickle allowlist (``torch_pickle.object_refusal``): DCP's loader unpickles
        them with ``torch.load(weights_only=False)``. ``trust_objects``: hand over any, unchecked."""
        if item.chunk is not None:
            raise StoreError(f"step {self.step}: {item.fqn} is a tensor, not an object")
        container = self._container(item.file)
        atoms = [
            (a.file_offset or 0, a.nbytes) for (name, _), got in self._atoms.items() if name == item.file for a in got
        ]
        out = bytearray()
        at = 0  # where each run of the file begins in the container
        for offset, length in gaps(self.files[item.file].raw_size, atoms):
            lo, hi = max(offset, item.offset), min(offset + length, item.offset + item.length)
            if lo < hi:
                out += container[at + lo - offset : at + hi - offset]
            at += length
        if len(out) != item.length:
            raise CorruptStoreError(f"step {self.step}: the object {item.fqn} overlaps a tensor's bytes in its file")
        data = bytes(out)
        where = f"step {self.step}, {self._path(item.file)}, object item {item.fqn}"
        if not trust_objects and (why := self._verdicts.refusal(MemorySource(data))) is not None:
            raise UnsafePickleError(
                f"{where}: {why}, so it was not handed to dcp.load (whose unpickler would run it). If you "
                "trust this store's objects, pass trust_objects=True to TailorStorageReader."
            )
        return data

    def _container(self, name: str) -> bytes:
        if name not in self._containers:
            row = self.files[name]
            if row.container is None:
                raise CorruptStoreError(f"step {self.step}: {self._path(name)} was stored without a container")
            self._containers[name] = self.store.read_blob(row.container, f"step {self.step}, {self._path(name)}")
        return self._containers[name]

    def _path(self, name: str) -> str:
        return f"{self.folder}/{name}" if self.folder else name


def open_dcp_step(repo: Repository, manifest: int, folder: str | None = None) -> DcpStep:
    """The step's DCP folder ``folder`` (or its only one), ready to read item by item."""
    facts = repo.manifest(manifest)
    rows = repo.view(Contents).files(manifest)
    folders = dcp_folders(rows)
    if not folders:
        raise StoreError(f"step {facts.step} holds no DCP folder; dcp.load reads only steps saved with dcp.save")
    if folder is None:
        if len(folders) > 1:
            raise StoreError(f"step {facts.step} holds DCP folders {folders}; name the one to load (folder=...)")
        folder = folders[0]
    folder = folder.strip("/")
    if folder not in folders:
        raise StoreError(f"step {facts.step} has no DCP folder {folder!r}; it has {folders}")
    prefix = f"{folder}/" if folder else ""
    meta, files = folder_metadata(repo, facts.step, rows, folder)
    step = DcpStep(repo, manifest, facts.step, folder, meta, files, facts.tier, inherited_layers(repo, manifest))
    by_file: dict[str, list[AtomRecord]] = {}
    for atom in repo.view(Contents).atoms(manifest):
        if atom.path.startswith(prefix) and atom.path[len(prefix) :] in files:
            by_file.setdefault(atom.path[len(prefix) :], []).append(atom)
    for name, atoms in by_file.items():
        items = sorted((i for i in meta.items.get(name, []) if i.chunk is not None), key=lambda i: i.offset)
        for atom in atoms:
            at = atom.file_offset or 0
            owner = next((i for i in items if i.offset <= at < i.offset + i.length), None)
            if owner is None:
                raise CorruptStoreError(f"step {facts.step}, {prefix}{name}: a piece lies in no tensor item")
            step._atoms.setdefault((name, owner.offset), []).append(atom)
    for pieces in step._atoms.values():
        pieces.sort(key=lambda a: a.file_offset or 0)
        for atom in pieces:
            if atom.derived is None and atom.blob not in step._rows:
                step._rows[atom.blob] = blob_of(repo, atom.blob, f"step {facts.step}, {atom.path}")
    return step
