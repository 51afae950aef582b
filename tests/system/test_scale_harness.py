"""The metadata scale harness's smallest case (``python -m benchmarks.scale --quick``: a 7B Llama's
FSDP2 layout at 4 ranks, two steps through the DCP writer, one DCP folder committed): it runs
end to end, and what it measures is what it says, DCP's side measured in the same run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.metadata_scale import main

pytestmark = pytest.mark.slow


def test_the_smallest_case_runs_and_its_figures_are_sane(tmp_path: Path) -> None:
    out = tmp_path / "quick.json"
    assert main(["--quick", "--work", str(tmp_path / "work"), "--out", str(out)]) == 0
    found = json.loads(out.read_text())
    layout = found["layout"]
    assert (layout["model"], layout["ranks"]) == ("7b", 4)
    assert layout["chunks"] == 4 * layout["shards_a_rank"] and layout["shards_a_rank"] == 3 * (32 * 9 + 3)
    steps = found["writer"]["steps"]
    assert [s["step"] for s in steps] == [1, 2]
    for step in steps + found["folder"]["steps"]:
        assert step["index_added"] > 0 and step["manifests_added"] > 0  # every step adds rows and an object
        assert step["metadata_added"] == step["index_added"] + step["manifests_added"]
        assert step["dcp_metadata_bytes"] > 100_000  # DCP's own .metadata of the same save, same run
    for step in steps:
        assert step["commit_s"] > 0 and step["dcp_own_s"] > 0 and step["dcp_own_finish_s"] > 0
        assert step["commit_s"] == pytest.approx(step["store_plan_s"] + step["parts_s"] + step["finish_s"])
    assert found["writer"]["peak_rss"] >= found["writer"]["rss_before"] > 0
    ops = found["operations"]
    for name in ("log", "show", "diff", "verify", "gc_dry_run", "index_rebuild", "resume_one_rank", "gc"):
        assert ops[name]["s"] > 0 and ops[name]["peak_rss"] > 0, name
    resume = ops["resume_one_rank"]
    assert resume["loaded_equal_saved"] and resume["items"] > layout["shards_a_rank"]
