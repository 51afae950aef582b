"""Host memory (core/host_memory.py): what is available is read from the kernel."""

from __future__ import annotations


def test_available_memory_is_read_from_the_kernel() -> None:
    """What the snapshot's readied buffers are weighed against (core/host_memory.py)."""
    from tailorstore.core.host_memory import available_memory

    with open("/proc/meminfo") as f:
        total = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemTotal:"))
    found = available_memory()
    assert found is not None and 0 < found <= total
