"""Metrics beyond a float's range: refused when recorded, read
as null from a manifest object a stranger wrote, never an OverflowError traceback; and a metric
name holding ':' can be named by keep-best."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import zstandard

from tailorstore import Store
from tailorstore.core.errors import MetricError
from tailorstore.curate.gc import KeepBest
from tailorstore.store.backends.location import resolve
from tests.conftest import tailor


@pytest.fixture
def tiny(tmp_path: Path) -> Path:
    save = tmp_path / "save"
    save.mkdir()
    torch.save({"w": torch.ones(4)}, save / "ckpt.pt")
    return save


@pytest.mark.parametrize("value", [10**400, "1" + "0" * 400, "1e400"])
def test_a_metric_beyond_a_float_is_refused_when_recorded(value: object, tiny: Path, tmp_path: Path) -> None:
    with Store.init(tmp_path / "store") as store:
        with pytest.raises(MetricError, match="beyond the range"):
            store.commit(tiny, step=1, metrics={"eval_loss": value})
        assert store.log() == []
    done = tailor("commit", str(tiny), "--step", "1", "--metric", f"eval_loss={value}", store=tmp_path / "store")
    assert done.returncode == 2 and "beyond the range" in done.stderr and "Traceback" not in done.stderr


def test_a_manifest_with_a_400_digit_metric_reads_as_null(tiny: Path, tmp_path: Path) -> None:
    location = tmp_path / "store"
    with Store.init(location) as store:
        store.commit(tiny, step=1, metrics={"eval_loss": 1.5})
    backend = resolve(str(location)).backend
    key = next(k for k in backend.list("manifests/"))
    doc = json.loads(zstandard.ZstdDecompressor().decompress(backend.get(key), max_output_size=1 << 20))
    doc["manifest"]["metrics"] = '{"eval_loss": ' + "9" * 400 + "}"
    backend.put(key, zstandard.ZstdCompressor().compress(json.dumps(doc).encode()))
    for args in (("index", "rebuild"), ("log", "--json"), ("gc", "--keep-best", "eval_loss:min:1", "--dry-run"),
                 ("checkout", "step=1", "--out", str(tmp_path / "out"))):  # fmt: skip
        done = tailor(*args, store=location)
        assert done.returncode == 0 and "Traceback" not in done.stderr, (args, done.stderr)
    assert json.loads(tailor("log", "--json", store=location).stdout)[0]["metrics"] == {"eval_loss": None}
    assert (tmp_path / "out" / "save" / "ckpt.pt").read_bytes() == (tiny / "ckpt.pt").read_bytes()


def test_keep_best_names_a_metric_with_a_colon() -> None:
    assert KeepBest.parse("eval:loss:min:3") == KeepBest("eval:loss", "min", 3)


@pytest.mark.slow  # seconds: the fast tier keeps its minute
def test_a_metric_added_after_the_commit_is_seen_by_every_host_and_keep_best(tiny: Path, tmp_path: Path) -> None:
    """``tailor metric step=N name=value``: the step gets its next version with the metric, keeps its
    tag and pin, and gc --keep-best ranks it; a bad value is refused and changes nothing."""
    location = tmp_path / "store"
    with Store.init(location) as store:
        store.commit(tiny, step=1, tag="first")
        store.pin("step=1")
        store.commit(tiny, step=2, metrics={"eval_loss": 3.0})
        store.commit(tiny, step=3)
    done = tailor("metric", "step=1", "eval_loss=1.5", "acc=0.9", store=location)
    assert done.returncode == 0, done.stderr
    refused = tailor("metric", "step=3", "eval_loss=" + "9" * 400, store=location)
    assert refused.returncode == 2 and "beyond the range" in refused.stderr
    backend = resolve(str(location)).backend
    assert sorted(k.rsplit("/", 1)[-1] for k in backend.list("manifests/")) == [
        # the older version stays while its tag and pin name it (they count for v2; a ref another host
        # moved meanwhile is never written over: FORMAT.md 8.1, I7), until a gc carries them over
        "step-00000000000000000001-v1.json.zst",
        "step-00000000000000000001-v2.json.zst",
        "step-00000000000000000002-v1.json.zst",
        "step-00000000000000000003-v1.json.zst",
    ]
    assert tailor("index", "rebuild", store=location).returncode == 0  # a host that never saw it
    steps = {s["step"]: s for s in json.loads(tailor("log", "--json", store=location).stdout)}
    assert steps[1]["metrics"] == {"acc": 0.9, "eval_loss": 1.5}
    assert steps[1]["tag"] == "first" and steps[1]["pinned"]
    with Store.open(location) as store:
        store.pin("step=1", False)
        store.untag("first")
    assert tailor("gc", "--keep-best", "eval_loss:min:1", store=location).returncode == 0
    assert [s["step"] for s in json.loads(tailor("log", "--json", store=location).stdout)] == [1]
    assert [k.rsplit("/", 1)[-1] for k in backend.list("manifests/") if k.endswith(".json.zst")] == [
        "step-00000000000000000001-v2.json.zst"
    ]


def test_a_merge_carries_no_metric_of_its_base(tmp_path: Path) -> None:
    """Regression: a merge showed its base step's metrics, which scored the base, not it."""
    from tailorstore.core.records import COMMIT, ManifestRecord
    from tailorstore.curate.merge_spec import merge_record

    base = ManifestRecord(step=6, origin=COMMIT, created_at=1.0, layout="deepspeed", ds_tag="global_step6",
                          zero_stage=2, world_size=2, policy="{}", exact=True, raw_bytes=1, new_bytes=1,
                          source="x", metrics='{"eval_loss": 1.5}')  # fmt: skip
    assert merge_record(base, "mix", {"name": "merge"}, tmp_path / "spec.yaml").metrics is None
