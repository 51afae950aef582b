"""gc's retention rules (curate/gc.py) on manifest records: which manifests a rule keeps, run by
run, and the numbers it refuses."""

from __future__ import annotations

import pytest

from tailorstore.core.errors import StoreError
from tailorstore.core.records import ManifestRecord
from tailorstore.curate.gc import Retention, kept_manifests


def rows(*specs: tuple) -> list[ManifestRecord]:
    return [
        ManifestRecord(
            step,
            origin,
            0.0,
            "deepspeed",
            None,
            None,
            None,
            "{}",
            True,
            0,
            0,
            "",
            (tag,) if tag else (),
            bool(pinned),
            id=mid,
        )
        for mid, step, origin, tag, pinned in specs
    ]


def test_kept_manifests() -> None:
    manifests = rows(
        (1, 1, "commit", None, 0),
        (2, 2, "commit", "warm", 0),
        (3, 3, "commit", None, 1),
        (4, 4, "commit", None, 0),
        (5, 5, "commit", None, 0),
        (6, 6, "commit", None, 0),
        (7, 6, "merge", "mix", 0),
    )
    assert kept_manifests(manifests, Retention()) == {1, 2, 3, 4, 5, 6, 7}
    assert kept_manifests(manifests, Retention(keep_last=2)) == {2, 3, 5, 6, 7}
    assert kept_manifests(manifests, Retention(keep_every=4)) == {2, 3, 4, 7}
    assert kept_manifests(manifests, Retention(keep_last=1, keep_every=5)) == {2, 3, 5, 6, 7}


def test_retention_counts_each_run_on_its_own_and_keeps_run_bases() -> None:
    from dataclasses import replace

    main = rows((1, 1, "commit", None, 0), (2, 2, "commit", None, 0), (3, 3, "commit", None, 0))
    ft = [replace(m, run="ft") for m in rows((4, 1, "commit", None, 0), (5, 2, "commit", None, 0))]
    manifests = main + ft
    assert kept_manifests(manifests, Retention(keep_last=1)) == {3, 5}, "the newest step of every run"
    assert kept_manifests(manifests, Retention(keep_last=1), bases=frozenset({1})) == {1, 3, 5}
    assert kept_manifests(manifests, Retention(keep_last=1, run="ft")) == {1, 2, 3, 5}, "main untouched"
    assert kept_manifests(manifests, Retention(keep_every=2, run="main")) == {2, 4, 5}


@pytest.mark.parametrize("bad", [{"keep_last": 0}, {"keep_last": -1}, {"keep_every": 0}])
def test_retention_refuses_numbers_below_one(bad: dict) -> None:
    with pytest.raises(StoreError):
        Retention(**bad)
