"""A save that blocks training only for a copy: tensors into reused memory, files written later.

``torch.save`` into ``/dev/shm`` is slow (pickling, zip records and CRCs, fresh tmpfs pages), so
serializing a save inside ``save_checkpoint`` blocked a large run on a GPU for seventy to a
hundred times as long as a copy of the same bytes from the GPU into pinned host memory
(docs/PERFORMANCE.md, "Saving inside training"). Here ``save`` only copies: each distinct
tensor storage into a buffer kept from the save before last (pinned where CUDA is present), the structure around it
rebuilt as is, and a background thread writes the file with ``torch.save`` from that copy. The
bytes are those ``torch.save`` of the original would write: tensors keep their storage sharing,
offsets, strides, dtypes, ``requires_grad`` and Parameter type, and a storage copied from a GPU
is written with its GPU's location tag (a serialization tagger of our own, consulted first).

The tag must match in identity as well as in text. ``torch.save`` writes a storage's location
once per tensor that views it, and the pickler writes a string it has seen before as a short
back-reference only when it is the same object. torch's CUDA tagger builds ``"cuda:0"`` afresh
each call, its CPU tagger returns one constant ``"cpu"``. DeepSpeed's module weights are views
of one flat buffer, so on a GPU the first version of this file, which returned one stored string,
wrote a model-states file 1,024 bytes shorter than ``torch.save`` of the live state (the device
check, docs/benchmarks.md). So each copy records whether torch's tagger gives a new object each
time, and our tagger does the same.

Memory is bounded at two snapshots: buffers alternate between two generations, and a save waits
for the serialization of the save before last before it reuses that generation's buffers.

Fresh memory is far slower to touch than memory already mapped is to copy into
(docs/PERFORMANCE.md, "Fresh pages"), so a save that allocates its buffers blocks for far
longer than one that reuses them. The first save must allocate; after it, the writer thread
allocates and touches the second generation, with the first save's sizes, once that save's
files are written. So the second save reuses too. A second save that comes before the writer
has started on it cancels it and allocates as before; one that comes while it runs waits for
the rest, which is less than allocating.

Other ranks' commits cannot wait on this process's threads, so when a save's files are all
written a marker appears beside its tag folder: ``.written-<rank>``, or ``.failed-<rank>`` with
the reason. A file that cannot be written to staging is written where DeepSpeed would have put
it, from the same snapshot, so no save is lost.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from tailorstore.core.errors import StagingFailed, StoreError
from tailorstore.core.failpoints import failpoint
from tailorstore.core.host_memory import available_memory
from tailorstore.core.local_files import Beneath, read_small, write_atomic
from tailorstore.integrations.deepspeed.side_copy import SideCopies
from tailorstore.integrations.deepspeed.staging import FAILED, WRITTEN

log = logging.getLogger("tailorstore")
# a snapshot buffer's storage (its _cdata, unique while the buffer lives) -> the location tag of the
# storage it copies, and whether torch's tagger makes that tag afresh on every call
_locations: dict[int, tuple[str, bool]] = {}
Buffers = dict[tuple[str, int], torch.Tensor]  # (file name, storage number) -> its reused buffer
_registered = threading.Lock()
_is_registered = False


def _tag(storage: Any) -> str | None:
    found = _locations.get(getattr(storage, "_cdata", None))  # type: ignore[arg-type]
    if found is None:
        return None
    tag, fresh = found
    return "".join([tag[:1], tag[1:]]) if fresh else tag  # a new object with the same text, as torch's would be


def _record_location(buffer: torch.Tensor, source: Any) -> None:
    """Remember how ``torch.save`` tags ``source``, for when it writes ``buffer`` (its copy)."""
    first, second = torch.serialization.location_tag(source), torch.serialization.location_tag(source)
    _locations[buffer.untyped_storage()._cdata] = (first, first is not second)


def _register_tagger() -> None:
    global _is_registered
    with _registered:
        if not _is_registered:
            torch.serialization.register_package(0, _tag, lambda storage, location: None)
            _is_registered = True


def _forget(generations: list[Buffers]) -> None:
    for buffers in generations:
        for buf in list(buffers.values()):  # the writer thread may still be filling one
            _locations.pop(buf.untyped_storage()._cdata, None)


class Unsupported(Exception):
    """A tensor this snapshot does not copy (sparse, quantized, a subclass): save synchronously."""


def _holds_tensor(item: Any, depth: int) -> bool:
    """Whether a tensor hides inside ``item`` (an object's attributes, a namedtuple, a set)."""
    if isinstance(item, torch.Tensor):
        return True
    if depth == 0 or isinstance(item, str | bytes | int | float | bool | type(None)):
        return False
    if isinstance(item, dict):
        return any(_holds_tensor(v, depth - 1) for v in item.values())
    if isinstance(item, list | tuple | set | frozenset):
        return any(_holds_tensor(v, depth - 1) for v in item)
    attributes = getattr(item, "__dict__", None)
    return isinstance(attributes, dict) and any(_holds_tensor(v, depth - 1) for v in attributes.values())


class Snapshots:
    """Two generations of reused buffers and one writer thread, per engine."""

    def __init__(
        self,
        pinned: bool | None = None,
        on_staging_failed: Callable[[BaseException, Path], None] | None = None,
        ranks_on_node: int = 1,
        device_buffers: bool | None = None,
    ) -> None:
        self.pinned = torch.cuda.is_available() if pinned is None else pinned
        self.ranks_on_node = max(1, ranks_on_node)  # each readies its own second generation at once
        self.on_staging_failed = on_staging_failed or (lambda why, real: None)
        self._buffers: list[Buffers] = [{}, {}]
        self._pending: list[list[Future[None]]] = [[], []]
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="tailor-serialize")
        self._generation = 0
        self._prefault: Future[None] | None = None  # the second generation, made ready after the first save
        # this save's files, copied and waiting for its last copy before they are written (see write)
        self._held: list[tuple[Any, Path, Path, Any]] = []
        self._side: SideCopies | None = None  # copies out of GPU memory, off the training stream
        self._device_buffers = device_buffers
        self._landed: Any = None  # the event that says this file's copies out of the GPU have landed
        _register_tagger()
        weakref.finalize(self, _forget, self._buffers)  # a freed buffer's storage id may be reused

    # -- one save ------------------------------------------------------------------------
    def begin(self, save_number: int) -> None:
        """A save starts: wait until the save before last is written, then reuse its buffers."""
        self._release()  # a save that never finished: its files are written all the same
        self._generation = save_number % 2
        prefault, self._prefault = self._prefault, None
        if prefault is not None and not prefault.cancel():
            prefault.exception()  # under way: its buffers are ready once it ends
        for future in self._pending[self._generation]:
            future.exception()  # its outcome went into its marker; here only its end matters
        self._pending[self._generation] = []
        if self._side is not None:
            self._side.begin_save()

    def copy(self, state_dict: Any, name: str) -> tuple[Any, int]:
        """``state_dict`` with every tensor backed by a copy in this generation's buffers; the
        bytes copied. Raises Unsupported for a tensor it does not know how to copy."""
        buffers = self._buffers[self._generation]
        copies: dict[int, torch.Tensor] = {}  # original storage -> its copy (sharing kept)
        counter = [0]

        def storage_copy(t: torch.Tensor) -> torch.Tensor:
            storage = t.untyped_storage()
            key = storage._cdata  # the storage itself, as torch.save tells storages apart: not its address,
            # which every empty storage shares
            if key in copies:
                return copies[key]
            slot = (name, counter[0])
            counter[0] += 1
            nbytes = storage.nbytes()
            buf = buffers.get(slot)
            if buf is None or buf.numel() != nbytes:
                if buf is not None:
                    _locations.pop(buf.untyped_storage()._cdata, None)
                buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pinned and nbytes > 0)
                buffers[slot] = buf
            source = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
            if source.is_cuda and self.pinned:
                self._side_for(source.device).copy(slot, buf, source)
            else:
                buf.copy_(source)
            _record_location(buf, storage)
            copies[key] = buf
            return buf

        def walk(item: Any) -> Any:
            if isinstance(item, torch.Tensor):
                if type(item) not in (torch.Tensor, torch.nn.Parameter) or item.layout != torch.strided:
                    raise Unsupported(f"{type(item).__name__} with layout {item.layout}")
                if item.is_quantized or item.is_conj() or item.is_neg() or item._backward_hooks:
                    raise Unsupported("a quantized, conjugated or hooked tensor")
                buf = storage_copy(item)
                out = torch.empty(0, dtype=item.dtype).set_(
                    buf.untyped_storage(), item.storage_offset(), item.size(), item.stride()
                )
                if isinstance(item, torch.nn.Parameter):
                    return torch.nn.Parameter(out, requires_grad=item.requires_grad)
                return out.requires_grad_(item.requires_grad) if item.requires_grad else out
            if type(item) in (dict, OrderedDict):
                out_dict = type(item)((k, walk(v)) for k, v in item.items())
                extra = getattr(item, "__dict__", None)  # a state dict's _metadata (module versions)
                if extra:
                    if _holds_tensor(extra, 3):
                        raise Unsupported("a tensor in a dictionary's attributes")
                    out_dict.__dict__.update(extra)
                return out_dict
            if type(item) in (list, tuple):
                return type(item)(walk(v) for v in item)
            if _holds_tensor(item, 3):  # inside an object we do not rebuild: it would be written live
                raise Unsupported(f"a tensor inside a {type(item).__name__}")
            return item

        try:
            tree = walk(state_dict)
        except Unsupported:
            if self._side is not None and self._side.in_file:
                self._side.end_file()  # what was queued lands, unread: the file is written from the live state
            raise
        if self._side is not None and self._side.in_file:
            self._landed = self._side.end_file()
        return tree, sum(b.numel() for b in copies.values())

    def _side_for(self, device: torch.device) -> SideCopies:
        if self._side is None:
            self._side = SideCopies(device, self._device_buffers)
        elif self._side.device != device:
            raise Unsupported(f"tensors on {self._side.device} and on {device} in one engine's save")
        self._side.begin_file()
        return self._side

    def guard(self) -> None:
        """Before the saved tensors change (the optimizer step): the training stream waits, on the
        GPU, for the last save's capture (:mod:`.side_copy`). Without a GPU there is nothing to wait for."""
        if self._side is not None:
            self._side.guard()

    def write(self, tree: Any, staged: Path, real: Path) -> None:
        """Write ``tree`` to ``staged`` in the background (or, failing that, to ``real``), once this
        save's last file is copied (:meth:`finish`).

        Serializing a file as soon as it was copied took a core from the copy of the save's next
        file: on 2 cores, rank 0's optimizer file took twice as long to copy while its model
        states were being written as rank 1's, which has no other file (docs/PERFORMANCE.md,
        "Saving inside training"). The copies are the stall; the writes are not."""
        event, self._landed = self._landed, None  # None: the copies were made on the host, already done
        self._held.append((tree, staged, real, event))

    def _release(self) -> None:
        """Hand this save's copied files to the writer thread, in the order they came."""
        held, self._held = self._held, []
        for tree, staged, real, event in held:
            self._pending[self._generation].append(
                self._writer.submit(_write, tree, staged, real, event, self.on_staging_failed)
            )

    def finish(self, save_folder: Path, rank: int) -> None:
        """The save's files are all copied: write them, then leave the marker others wait for."""
        self._release()
        futures = list(self._pending[self._generation])
        self._pending[self._generation].append(self._writer.submit(_mark, futures, save_folder, rank))
        mine, other = self._buffers[self._generation], self._buffers[1 - self._generation]
        if mine and not other:  # the first save: ready the second generation after its files
            self._prefault = self._writer.submit(_prefault, dict(mine), other, self.pinned, self.ranks_on_node)

    def drain(self) -> None:
        """Write every file copied and wait for them (before moving staged files, and before exit)."""
        self._release()
        for generation in self._pending:
            for future in generation:
                future.exception()


def _write(
    tree: Any, staged: Path, real: Path, event: Any, on_staging_failed: Callable[[BaseException, Path], None]
) -> None:
    if event is not None:
        event.synchronize()  # the copies from the GPU have landed
    # torch.save names the records inside the zip by the file's name: write it under its own name
    # in a folder of its own, then move it into place, so no reader sees half a file
    tmp = staged.parent / f".tailor-writing-{staged.name}" / staged.name
    try:
        tmp.parent.mkdir(parents=True, exist_ok=True)
        torch.save(tree, tmp)
        failpoint("snapshot-file-written")
        os.replace(tmp, staged)
        tmp.parent.rmdir()
    except (OSError, RuntimeError) as exc:  # staging full or gone: the file goes where DeepSpeed writes it
        shutil.rmtree(tmp.parent, ignore_errors=True)
        on_staging_failed(exc, real.parent)
        real.parent.mkdir(parents=True, exist_ok=True)
        torch.save(tree, real)
        raise StoreError(f"staging {staged} failed ({exc}); the file was written to {real}") from exc


def _prefault(model: Buffers, target: Buffers, pinned: bool, ranks_on_node: int) -> None:
    """Buffers of ``model``'s slots and sizes into ``target``, every page touched, when the node
    can spare them.

    They are taken ahead of a second save that may never come, so they must not be what runs the
    node out of memory: every rank of the node readies its own at about the same moment, and
    they are readied only while at least as much again stays available (MemAvailable, or a
    container's limit). At 374M parameters on this 24 GiB machine, readying them unconditionally
    had the kernel kill a rank that trained and saved once without them. A second save then
    allocates its buffers as it copies, as before."""
    needed = sum(buf.numel() for buf in model.values()) * ranks_on_node
    available = available_memory()
    if available is None or available < 2 * needed:
        log.debug("the second snapshot generation is not readied: %s bytes available, %d needed", available, needed)
        return
    for slot, buf in model.items():
        nbytes = buf.numel()
        fresh = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned and nbytes > 0)
        fresh.zero_()
        target[slot] = fresh


def _mark(futures: list[Future[None]], folder: Path, rank: int) -> None:
    errors = [str(f.exception()) for f in futures if f.exception() is not None]
    folder.mkdir(parents=True, exist_ok=True)
    marker = f"{FAILED}{rank}" if errors else f"{WRITTEN}{rank}"
    try:  # a temp file renamed into place: never written through a link planted in staging
        write_atomic(folder, marker, "; ".join(errors)[:4000].encode())
    except OSError:
        if not errors:
            raise
        write_atomic(folder, marker, b"")  # a full staging folder has room for the name, not the words


def await_written(folder: Path, ranks: list[int], timeout: float, alive: Callable[[], bool] = lambda: True) -> None:
    """The committer: wait until every rank in ``ranks`` has written its files of the save in
    ``folder`` (its ``save-N/``); raise what a rank reported, or after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        # every rank's marker first, failed or not: none is left behind for a later save to trip on
        if all((folder / f"{WRITTEN}{r}").exists() or (folder / f"{FAILED}{r}").exists() for r in ranks):
            failed = [r for r in ranks if (folder / f"{FAILED}{r}").exists()]
            if not failed:
                return
            try:
                said = read_small(Beneath(folder, f"{FAILED}{failed[0]}", links=False), 16 << 10)
            except OSError as exc:  # a marker that is no file of the rank's: what it failed with is unknown
                said = str(exc).encode()
            text = said.decode("utf-8", errors="replace")[:2000]
            raise StagingFailed(f"rank {failed[0]} could not write its files of the save into staging: {text}")
        if time.monotonic() > deadline or not alive():
            missing = [r for r in ranks if not (folder / f"{WRITTEN}{r}").exists()]
            raise StoreError(f"ranks {missing[:8]} did not finish writing their files of the save in {timeout:g} s")
        time.sleep(0.01)


def clear_markers(folder: Path) -> None:
    """Clean-up of a save's markers: a staging folder gone read-only leaves them, with no failure."""
    for marker in list(folder.glob(f"{WRITTEN}*")) + list(folder.glob(f"{FAILED}*")):
        try:
            marker.unlink(missing_ok=True)
        except OSError:
            return
