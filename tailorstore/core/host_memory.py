"""The host process's memory: glibc's allocator told to keep freed memory mapped (the command
line only), its free pages handed back after a save, and how much can still be allocated.

Touching fresh memory is far slower than copying into memory that is already mapped
(docs/PERFORMANCE.md, "Fresh pages"). glibc hands large allocations (compressed blobs, decoded
tensors) to mmap and unmaps them on free, so every new buffer is fresh memory. Raising the mmap
threshold, serving every allocation from the heap and never trimming it makes glibc reuse the
same pages; peak RSS is then the high-water mark of live buffers, which the commit pipeline
bounds. Called by the command-line entry points only: a library should not change its host
process's allocator (inside a library, pieces come from :mod:`piece_slab` instead, and streamed
chunks from :mod:`thread_buffers`).
"""

from __future__ import annotations

import ctypes
import functools

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_MMAP_MAX = -4


def reuse_freed_memory() -> bool:
    try:
        libc = _libc()
        ok = libc.mallopt(_M_MMAP_THRESHOLD, 32 << 20) == 1
        ok = ok and libc.mallopt(_M_MMAP_MAX, 0) == 1  # large buffers from the heap too, so they are reused
        return ok and libc.mallopt(_M_TRIM_THRESHOLD, 1 << 30) == 1
    except (OSError, AttributeError):  # not glibc
        return False


def release_free_memory() -> None:
    """Hand the heap's free pages back to the kernel (glibc's ``malloc_trim``); nothing else changes.

    A save inside training frees what it allocated, but glibc keeps freed heap memory for reuse
    in the arena of the thread that freed it, and an async save runs in a new thread each time:
    through the DCP writer, rank 0's resident memory grew by about 55 kB a save, 1,000 saves
    long, where the same saves made in one thread stayed flat (docs/benchmarks.md). Trimming
    after each save returns those pages; it does not change how the allocator behaves."""
    try:
        _libc().malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


@functools.cache
def _libc() -> ctypes.CDLL:
    """The C library this process already runs on (``dlopen(NULL)``, as store/backends/posix.py does).
    ``ctypes.util.find_library`` would fork and run ``ldconfig -p`` in every command."""
    return ctypes.CDLL(None, use_errno=True)


def available_memory() -> int | None:
    """Bytes this process could still allocate before the kernel reclaims or kills: the system's
    MemAvailable, or less where a cgroup v2 limit (a container) leaves less. None where neither
    can be read (not Linux)."""
    found = _meminfo_available()
    room = _cgroup_room()
    if found is None:
        return room
    return found if room is None else min(found, room)


def _meminfo_available() -> int | None:
    try:
        with open("/proc/meminfo", "rb") as f:
            for line in f.read(1 << 16).splitlines():
                if line.startswith(b"MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cgroup_room() -> int | None:
    """memory.max - memory.current of this process's cgroup (v2), or None without a limit."""
    try:
        with open("/proc/self/cgroup", "rb") as f:
            lines = f.read(1 << 16).decode("ascii", "replace").splitlines()
        path = next((line[3:] for line in lines if line.startswith("0::")), None)
        if path is None or ".." in path.split("/"):
            return None
        folder = "/sys/fs/cgroup" + path.rstrip("/")
        with open(f"{folder}/memory.max", "rb") as f:
            limit = f.read(64).strip()
        if limit == b"max":
            return None
        with open(f"{folder}/memory.current", "rb") as f:
            current = int(f.read(64).strip())
        return max(0, int(limit) - current)
    except (OSError, ValueError):
        return None
