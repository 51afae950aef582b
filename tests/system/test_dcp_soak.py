"""A soak through the DCP writer, short: 100 async saves (benchmarks/dcp_soak.py runs
1,000). Every tenth save checks out as the bytes ``dcp.save`` writes of the same state, so no
staging buffer reused too early put another step's bytes into it; memory stays flat."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.dcp_soak import soak

pytestmark = pytest.mark.slow


def test_a_hundred_writer_saves_are_byte_exact_and_memory_stays_flat(tmp_path: Path) -> None:
    found = soak(tmp_path, 100)
    assert found["steps_in_store"] == 100 and found["verified"]
    assert len(found["byte_exact"]) == 10 and all(found["byte_exact"].values()), found["byte_exact"]
    assert found["losses_equal"]
    assert found["rss_ratio"] <= 1.05, found  # the last ten saves against saves 10-20
