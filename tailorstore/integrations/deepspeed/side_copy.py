"""The snapshot's copies out of GPU memory, on side streams, so that a save does not wait for them.

A copy on the training's own stream is ordered before every kernel queued after it, so the next
step waits for the whole device-to-host copy (docs/PERFORMANCE.md, "Saving inside training"), and
anything that synchronizes that stream (a barrier, ``loss.item()``) blocks the host as long. Here
the copies run on two streams of their own:

1. ``capture``: waits for the training stream (the values at the save), then copies each storage
   into a buffer in GPU memory kept from save to save (a device-to-device copy runs at terabytes
   a second, so 5.2 GB takes milliseconds). Where the GPU has no room for such a buffer, the
   storage is copied straight into its pinned host buffer on this stream instead.
2. ``drain``: waits for ``capture``, then copies each GPU buffer into its pinned host buffer.
   Training runs beside it; the writer thread waits for its event before serializing.

Nothing on the training's stream waits for either, except through :meth:`SideCopies.guard`:
whatever changes the saved tensors (the optimizer step, and a forward that updates buffers) must
first call it. It makes the training stream wait, on the GPU, for ``capture``'s last copy, and
the host does not wait at all. So the next step runs its forward and backward during the copy,
and its optimizer step waits only for the capture (milliseconds with GPU buffers; the whole
device-to-host copy without them).

Call order, one save: ``begin_save``; then, for each file, ``begin_file`` before its first copy,
``copy`` for each storage and ``end_file`` after its last (the event its writer waits for); then
``guard`` before the next change.
A GPU buffer is reused only after the drain of the save before has read it: ``capture`` waits
for that save's last drain event before its first copy of the next save.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

log = logging.getLogger("tailorstore")

# GPU memory left free for training when GPU buffers are taken: a fraction of the card, and at least this
RESERVE_FRACTION = 0.10
RESERVE_BYTES = 2 << 30


class SideCopies:
    """Two side streams and the GPU buffers of one engine's snapshots (one CUDA device)."""

    def __init__(self, device: torch.device, use_device_buffers: bool | None = None) -> None:
        self.device = device
        self.capture = torch.cuda.Stream(device=device)
        self.drain = torch.cuda.Stream(device=device)
        self.use_device_buffers = use_device_buffers  # None: wherever the GPU has room
        self._buffers: dict[Any, torch.Tensor] = {}  # slot -> its buffer in GPU memory
        self._to_drain: list[tuple[torch.Tensor, torch.Tensor]] = []  # (host buffer, GPU buffer)
        self._guard: torch.cuda.Event | None = None  # capture's last copy: what a change must wait for
        self._drained: torch.cuda.Event | None = None  # the drain of the last file
        self._reuse_after: torch.cuda.Event | None = None  # the last drain of the save before
        self.in_file = False
        self.staged_bytes = 0  # of this engine's copies, how many went through GPU buffers (reported)

    def begin_save(self) -> None:
        """A save starts: its captures come after the drain of the save before (the GPU buffers
        it reads are this save's), never after this save's own earlier files."""
        self._reuse_after = self._drained

    def begin_file(self) -> None:
        """The capture stream waits for the training stream (and, once a save, for the last drain)."""
        if self.in_file:
            return
        self.in_file = True
        self.capture.wait_stream(torch.cuda.current_stream(self.device))
        reuse_after, self._reuse_after = self._reuse_after, None
        if reuse_after is not None:
            self.capture.wait_event(reuse_after)

    def copy(self, slot: Any, host: torch.Tensor, source: torch.Tensor) -> None:
        """Copy ``source`` (uint8 over a CUDA storage) into ``host`` (pinned, same size), off the
        training stream."""
        source.record_stream(self.capture)  # a storage freed meanwhile is not reused before the copy
        staged = self._device_buffer(slot, source.numel())
        with torch.cuda.stream(self.capture):
            if staged is None:
                host.copy_(source, non_blocking=True)
                return
            staged.copy_(source, non_blocking=True)
        self._to_drain.append((host, staged))

    def end_file(self) -> torch.cuda.Event:
        """The file's copies are queued: the event that says its host buffers hold them."""
        self.in_file = False
        captured = torch.cuda.Event()
        captured.record(self.capture)
        self._guard = captured
        self.drain.wait_event(captured)
        with torch.cuda.stream(self.drain):
            for host, staged in self._to_drain:
                host.copy_(staged, non_blocking=True)
        self._to_drain = []
        landed = torch.cuda.Event()
        landed.record(self.drain)
        self._drained = landed
        return landed

    def guard(self) -> None:
        """Before anything changes a saved tensor: the training stream waits (on the GPU) for the
        capture of the last save. The host goes on at once."""
        captured, self._guard = self._guard, None
        if captured is not None:
            torch.cuda.current_stream(self.device).wait_event(captured)

    def _device_buffer(self, slot: Any, nbytes: int) -> torch.Tensor | None:
        """This slot's GPU buffer of ``nbytes``, or None where none is used (turned off, no room)."""
        if self.use_device_buffers is False or nbytes == 0:
            return None
        found = self._buffers.get(slot)
        if found is not None and found.numel() == nbytes:
            return found
        if found is not None:
            found.record_stream(self.capture)  # freed only after the copies queued on it
            found.record_stream(self.drain)
            del self._buffers[slot]
        if self.use_device_buffers is None:
            free, total = torch.cuda.mem_get_info(self.device)
            if free - nbytes < max(RESERVE_BYTES, int(RESERVE_FRACTION * total)):
                return None
        buffer = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        self._buffers[slot] = buffer
        self.staged_bytes += nbytes
        return buffer
