"""The fuzz targets' CI tier: every reader of outside bytes (testbed/fuzz_targets.py),
fed real seeds mutated and raw bytes by Hypothesis, under a 512 MiB address-space cap and a time
cap, must give a result or one of tailorstore's errors and change no process-wide state. The
benchmark command runs them longer (docs/benchmarks.md); every input it ever found to break the
rule is kept in tests/data/fuzz/ and replayed here."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from testbed.fuzz_targets import TARGETS
from tests.conftest import TEST_DATA

DATA = TEST_DATA / "fuzz"


def fuzz(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "benchmarks.fuzz", *args], capture_output=True, text=True, timeout=600)


def test_every_input_the_fuzzer_found_reads_within_the_rule() -> None:
    """A manifest and a part object whose zstd frame declares no size: zstandard preallocated the
    whole 2 GiB bound for them (MemoryError under the cap; 2 GB without it)."""
    found = sorted(DATA.glob("*.bin"))
    assert found
    done = fuzz("--replay", *map(str, found))
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.slow
def test_every_reader_takes_200_fuzzed_inputs_within_the_rule(tmp_path: Path) -> None:
    done = fuzz("--examples", "200", "--crashes", str(tmp_path / "crashes"))
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("200 inputs") == len(TARGETS), done.stdout


@pytest.mark.slow  # seconds: the fast tier keeps its minute
def test_the_dcp_object_items_reader_takes_fuzzed_inputs_within_the_rule() -> None:
    """The allowlist the DCP reader puts every object item through before dcp.load unpickles it
    (``DcpStep.object_bytes``), fed real object items of a dcp.save and a hostile one, mutated."""
    done = fuzz("--targets", "dcp-object", "--examples", "150")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "dcp-object: 150 inputs" in done.stdout and "0 broke the rule" in done.stdout, done.stdout
