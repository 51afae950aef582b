"""How many threads each pool runs: from the cores this process may use, never this machine's.

Three kinds of pool, each sized from ``usable_cores()`` (the affinity mask, which is what a
job scheduler or ``taskset`` gives a process, not the machine's core count):

* **compute** (a commit's compressing and hashing writers): one a core. A commit's writes go to
  the page cache and only its last step waits on the disk, so a thread more than the cores only
  shared them: on 2 cores, 3 threads cost a whole-process commit 0.69 CPU-seconds against 0.62
  for 2, at the same wall, with 38 MB more peak RSS (docs/benchmarks.md, "One compressing
  thread a core");
* **decode** (a checkout's, a reshard's and a deep verify's decoders): two a core, since half
  of them wait on the disk or the network at any time;
* **sync** (fsyncs of a checkout's files): eight a core, at most 64: they only wait.

``$TAILOR_THREADS`` (or a ``threads=`` argument of the API) sets the compute and decode pools.
Rank-parallel commits divide a node's cores among its ranks (``share``), so that eight ranks on
a 64-core node do not start 64 threads each.
"""

from __future__ import annotations

import os

from tailorstore.core.environment import THREADS_ENV
from tailorstore.core.errors import StoreError

MAX_THREADS = 1024


def usable_cores() -> int:
    """The cores this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # no affinity on this platform
        return max(1, os.cpu_count() or 1)


def configured(threads: int | None = None) -> int | None:
    """``threads`` if given, else ``$TAILOR_THREADS`` (read as hostile input), else None."""
    if threads is None:
        text = os.environ.get(THREADS_ENV)
        if text is None or text == "":
            return None
        try:
            threads = int(text[:10])
        except ValueError:
            raise StoreError(f"{THREADS_ENV}={text[:40]!r} is not allowed: give a whole number of threads.") from None
        where = THREADS_ENV
    else:
        where = "threads"
    if isinstance(threads, bool) or not 1 <= threads <= MAX_THREADS:
        raise StoreError(f"{where}={threads!r} is not allowed: give from 1 to {MAX_THREADS} threads.")
    return threads


def compute_threads(threads: int | None = None, *, share: int = 1) -> int:
    """Threads of a pool that compresses and hashes (a commit's blob writers)."""
    chosen = configured(threads)
    if chosen is not None:
        return chosen
    return max(1, usable_cores() // max(1, share))


def decode_threads(threads: int | None = None, *, share: int = 1) -> int:
    """Threads of a pool that decodes and writes (checkout, reshard, deep verify)."""
    chosen = configured(threads)
    if chosen is not None:
        return chosen
    return 2 * max(1, usable_cores() // max(1, share))


def sync_threads() -> int:
    """Threads that only wait on fsync."""
    return min(64, 8 * usable_cores())
