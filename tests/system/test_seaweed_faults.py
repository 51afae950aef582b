"""Faults on a multi-server SeaweedFS (one master, three volume servers, a filer, the S3 gateway; each
its own process) under real `tailor` commands: each operation completes whole or fails with one
line, a fresh host then finds the store intact (``verify --deep``, every recorded step bit for bit),
and the operation succeeds once the server is back (testbed/seaweed_faults.py). The whole table is
``python -m benchmarks.seaweed_faults`` (docs/benchmarks.md); these run with
``TAILOR_TEST_S3=seaweedfs`` or ``both`` only: a cluster a file costs CI the minute it does not have."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from testbed.seaweed_faults import FAULTS, Bench, Fault, run_fault

pytestmark = pytest.mark.slow

CHOSEN = [f for f in FAULTS if (f.strike, f.operation) in {("kill-gateway", "commit"), ("kill-volume", "checkout"),
                                                          ("reset", "gc"), ("disk-full", "commit")}]  # fmt: skip


@pytest.fixture(scope="module")
def bench(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Bench]:
    from testbed.seaweed_s3 import missing_reason

    if os.environ.get("TAILOR_TEST_S3", "").lower() not in ("seaweedfs", "both"):
        pytest.skip("the SeaweedFS cluster's faults run with TAILOR_TEST_S3=seaweedfs or both")
    if missing_reason():
        pytest.skip(missing_reason())
    made = Bench(Path(tmp_path_factory.mktemp("seaweed-faults")))
    yield made
    made.stop()


@pytest.mark.parametrize("fault", CHOSEN, ids=[f"{f.strike}-{f.operation}" for f in CHOSEN])
def test_a_fault_leaves_the_store_intact_and_the_operation_succeeds_once_the_server_is_back(
    bench: Bench, fault: Fault
) -> None:
    out = run_fault(bench, fault, 100 + CHOSEN.index(fault))
    assert out.struck, "the fault never landed"
    assert out.code in (0, 5), (out.code, out.said)
    assert not out.problems, out.problems
