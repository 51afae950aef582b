"""Per-thread buffers that only grow, for code that streams chunk by chunk.

New pages cost a small fraction of what decoding or copying runs at on first touch
(docs/PERFORMANCE.md, "Fresh pages"), so a decoder or rounder that allocated a fresh buffer per
chunk would spend most of its time faulting pages in (:mod:`host_memory` keeps freed memory for
the command line, :mod:`piece_slab` a commit's pieces; this module the chunks of a stream). Each thread keeps one buffer
per purpose instead, touched once and reused. The purposes are named apart so that a stream
read through another (a derived weight rounded from a streamed master) never has its chunk
overwritten underneath it.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

_local = threading.local()


def thread_buffer(name: str, nbytes: int, minimum: int = 1 << 20) -> np.ndarray:
    """``nbytes`` of this thread's buffer ``name`` (uint8), grown to at least ``minimum`` at once
    so that chunks of varying size do not regrow it. Valid until this thread asks for ``name`` again."""
    buf = getattr(_local, name, None)
    if buf is None or len(buf) < nbytes:
        import numpy  # on first use: listing steps needs no numpy (start-up)

        buf = numpy.empty(max(nbytes, minimum), dtype=numpy.uint8)
        setattr(_local, name, buf)
    return buf[:nbytes]
