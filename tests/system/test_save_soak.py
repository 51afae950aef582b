"""A soak of saves through ``attach``, short: 100 saves through ``attach`` with the snapshot (benchmarks/save_soak.py
runs 1,000). Every tenth save is the bytes of a plain save of the same state, so no reused buffer
wrote another save's bytes (Megatron-LM's PR 2288 found that once); memory stays flat."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.save_soak import soak

pytestmark = pytest.mark.slow


def test_a_hundred_saves_are_byte_exact_and_memory_stays_flat(tmp_path: Path) -> None:
    found = soak(tmp_path, 100)
    assert found["steps_in_store"] == 100
    assert found["byte_exact"] and all(found["byte_exact"].values()), found["byte_exact"]
    assert found["losses_equal"]
    assert found["rss_ratio"] <= 1.05, found  # the last ten saves against saves 10-20
