"""Runs (curate/runs.py): a selector read in a run, and the names a run may have."""

from __future__ import annotations

import pytest

from tailorstore.core.errors import StoreError


def test_selectors_read_in_a_run() -> None:
    from tailorstore.curate.runs import qualify
    from tailorstore.store.manifests.runs import check_run_name

    assert qualify("step=3", "ft") == "ft:step=3"
    assert qualify("latest", "ft") == "ft:latest"
    assert qualify("main:step=3", "ft") == "main:step=3"
    assert qualify("tag=warm", "ft") == "tag=warm" and qualify("id=4", "ft") == "id=4"
    assert qualify("step=3", None) == "step=3"
    for bad in ("", "a/b", "a:b", "..", "x" * 101, "ü"):
        with pytest.raises(StoreError):
            check_run_name(bad)
