"""Metrics recorded with a step, and keep-best retention.

The rule (docs/FORMAT.md 7.3): only a step that recorded a finite value of the metric ranks; a
NaN or infinite value is recorded as null and never ranks; among equal values the later step
ranks first. The pure rule is tested on records; the rest on real commits of real
``torch.save`` training states, through the API, the command line, an index rebuild and the HF
Trainer's own evaluation."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tailorstore.core.errors import MetricError
from tailorstore.core.metric_values import checked, decode, encode, parse_assignment
from tailorstore.core.records import COMMIT, ManifestRecord
from tailorstore.curate.gc import KeepBest, Retention, kept_manifests
from tests.conftest import tailor


def manifest(id_: int, step: int, metrics: dict | None, run: str = "main") -> ManifestRecord:
    return ManifestRecord(
        step=step, origin=COMMIT, created_at=0.0, layout="plain-file", ds_tag=None, zero_stage=None,
        world_size=None, policy="{}", exact=True, raw_bytes=1, new_bytes=1, source="x", id=id_, run=run,
        metrics=encode(metrics),
    )  # fmt: skip


def test_keep_best_ranks_finite_values_and_breaks_ties_by_the_later_step() -> None:
    losses = {1: 3.0, 2: 2.0, 3: None, 4: float("nan"), 5: 2.0, 6: 2.5, 7: float("inf")}
    records = [manifest(s, s, None if v is None else {"eval_loss": v, "other": 1.0}) for s, v in losses.items()]
    assert KeepBest.parse("eval_loss:min:2").best(records) == {5, 2}  # the tie at 2.0: both, later first
    assert KeepBest.parse("eval_loss:min:1").best(records) == {5}  # of equal values the later step ranks first
    assert KeepBest.parse("eval_loss:max:1").best(records) == {1}
    assert KeepBest.parse("eval_loss:min:10").best(records) == {1, 2, 5, 6}  # NaN, inf and missing never rank
    assert KeepBest.parse("accuracy:max:3").best(records) == set()  # a metric nobody recorded keeps nothing


def test_keep_best_composes_with_keep_last_tags_and_runs() -> None:
    records = [manifest(s, s, {"eval_loss": 10.0 - s if s != 4 else 0.5}) for s in range(1, 9)]
    records.append(manifest(9, 2, {"eval_loss": 0.1}, run="other"))
    kept = kept_manifests(records, Retention(keep_last=2, keep_best=KeepBest.parse("eval_loss:min:1")))
    assert kept == {7, 8, 4, 9}  # each run counted on its own: run other's only step is its best
    doc = Retention(keep_last=2, keep_best="eval_loss:min:1", thin="weights").as_doc()
    assert doc["keep_best"] == "eval_loss:min:1"
    assert Retention.from_doc("main", json.loads(json.dumps(doc))).keep_best == KeepBest("eval_loss", "min", 1)


@pytest.mark.parametrize(
    "text", ["eval_loss", "eval_loss:min", "eval_loss:median:3", "eval_loss:min:0", "eval loss:min:3", "x:min:y"]
)
def test_a_bad_keep_best_is_refused(text: str) -> None:
    with pytest.raises(Exception, match=r"keep-best|metric name|not allowed"):
        KeepBest.parse(text)


def test_metrics_are_checked_and_read_as_hostile() -> None:
    assert checked({"eval_loss": 2, "acc": "0.5", "bad": float("nan")}) == {"eval_loss": 2.0, "acc": 0.5, "bad": None}
    assert parse_assignment("eval_loss=2.31") == ("eval_loss", 2.31)
    for bad in (
        {"": 1.0},
        {"a b": 1.0},
        {"x" * 101: 1.0},
        {"x": "two"},
        {"x": True},
        {f"m{i}": 1.0 for i in range(65)},
    ):
        with pytest.raises(MetricError):
            checked(bad)
    for text in ("[1, 2]", "{", '{"a": "b"}', '{"a": {"b": 1}}', "x" * 20000):
        with pytest.raises(MetricError):
            decode(text)
    assert decode('{"a": NaN, "b": 1}') == {"a": None, "b": 1.0}
    assert encode({}) is None and json.loads(encode({"a": math.inf}) or "") == {"a": None}


# -- real commits --------------------------------------------------------------------------------------------


def training_states(folder: Path, steps: list[int]) -> list[Path]:
    """One real ``torch.save({"model", "optimizer", "step"})`` file a step, the model trained between."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 4))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    folder.mkdir(parents=True, exist_ok=True)
    out = []
    for step in steps:
        model(torch.randn(8, 16)).square().mean().backward()
        optim.step()
        optim.zero_grad()
        path = folder / f"ckpt_{step}.pt"
        torch.save({"model": model.state_dict(), "optimizer": optim.state_dict(), "step": step}, path)
        out.append(path)
    return out


@pytest.mark.slow
def test_metrics_round_trip_through_the_command_line_objects_and_an_index_rebuild(tmp_path: Path) -> None:
    from tailorstore import Store

    saves = training_states(tmp_path / "saves", [1, 2])
    store = tmp_path / "store"
    assert tailor("init", str(store)).returncode == 0
    done = tailor("commit", str(saves[0]), "--metric", "eval_loss=2.31", "--metric", "accuracy=0.5", store=store)
    assert done.returncode == 0, done.stderr
    with Store.open(store) as st:
        st.commit(saves[1], metrics={"eval_loss": 2.0, "perplexity": float("nan")})
    log = tailor("log", store=store).stdout
    assert "accuracy=0.5  eval_loss=2.31" in log and "eval_loss=2  perplexity=nan" in log, log
    listed = json.loads(tailor("log", "--json", store=store).stdout)
    assert [s["metrics"] for s in listed] == [
        {"accuracy": 0.5, "eval_loss": 2.31},
        {"eval_loss": 2.0, "perplexity": None},
    ]
    assert "metrics:  eval_loss=2" in tailor("show", "step=2", store=store).stdout
    bad = tailor("commit", str(saves[0]), "--step", "9", "--metric", "eval loss=1", store=store)
    assert bad.returncode == 2 and "metric name" in bad.stderr and "Traceback" not in bad.stderr
    for f in store.glob("index.sqlite*"):  # the index lost: rebuilt from the manifest objects alone
        f.unlink()
    Store.rebuild_index(store)
    with Store.open(store) as st:
        assert [s.metrics for s in st.log()] == [
            {"accuracy": 0.5, "eval_loss": 2.31},
            {"eval_loss": 2.0, "perplexity": None},
        ]


@pytest.mark.slow
def test_gc_keep_best_keeps_exactly_the_best_and_the_last(tmp_path: Path) -> None:
    from tailorstore import Store

    steps = list(range(1, 9))
    losses = {1: 5.0, 2: 1.5, 3: None, 4: 1.0, 5: float("nan"), 6: 1.5, 7: 3.0, 8: 4.0}
    saves = training_states(tmp_path / "saves", steps)
    with Store.init(tmp_path / "store") as store:
        for step, save in zip(steps, saves, strict=True):
            store.commit(save, metrics=None if losses[step] is None else {"eval_loss": losses[step]})
        store.tag("step=1", "milestone")
        store.gc(Retention(keep_last=1, keep_best="eval_loss:min:2", thin="weights"))
        whole = {s.step for s in store.log() if s.tier is None}
        thinned = {s.step for s in store.log() if s.tier is not None}
        assert whole == {8, 4, 6, 1}, whole  # last, best two (6 wins the tie with 2 as the later step), the tag
        assert thinned == {2, 3, 5, 7}
        store.set_retention(Retention(keep_last=1, keep_best="eval_loss:min:1"))
        assert store.retention().keep_best == KeepBest("eval_loss", "min", 1)
        store.gc()  # the run's own rules: drop what they do not keep
        assert {s.step for s in store.log()} == {8, 4, 1}
        assert store.verify(deep=True).ok
    shown = tailor("run", "retention", store=tmp_path / "store").stdout
    assert "the 1 best by eval_loss (min)" in shown, shown


@pytest.mark.slow
def test_the_hf_callback_records_the_trainers_evaluation(tmp_path: Path) -> None:
    from transformers import Trainer, TrainingArguments

    from tailorstore import Store
    from tailorstore.integrations.hf import TailorCallback
    from testbed.train_hf import RampTokens
    from tests.system.test_plain_saves import tiny_llama

    Store.init(tmp_path / "store").close()
    args = TrainingArguments(
        output_dir=str(tmp_path / "run"), max_steps=4, save_steps=2, eval_strategy="steps", eval_steps=2,
        per_device_train_batch_size=2, report_to=[], use_cpu=True, logging_steps=1, disable_tqdm=True,
    )  # fmt: skip
    callback = TailorCallback(str(tmp_path / "store"), asynchronous=False)
    trainer = Trainer(
        model=tiny_llama(2), args=args, train_dataset=RampTokens(8, 16, 128), eval_dataset=RampTokens(4, 16, 128),
        callbacks=[callback],
    )  # fmt: skip
    trainer.train()
    callback.close()
    evaluated = {e["step"]: e["eval_loss"] for e in trainer.state.log_history if "eval_loss" in e}
    with Store.open(tmp_path / "store") as store:
        recorded = {s.step: s.metrics.get("eval_loss") for s in store.log()}
    assert recorded == evaluated and set(recorded) == {2, 4}


@pytest.mark.slow
def test_the_hf_callback_keeps_only_the_metrics_named(tmp_path: Path) -> None:
    """``TailorCallback(metrics=[...])`` records exactly the names given, from the evaluation and the
    training log of the saved step alike; a bare string or a bad name is refused at construction."""
    from transformers import Trainer, TrainingArguments

    from tailorstore import Store
    from tailorstore.core.errors import MetricError
    from tailorstore.integrations.hf import TailorCallback
    from testbed.train_hf import RampTokens
    from tests.system.test_plain_saves import tiny_llama

    Store.init(tmp_path / "store").close()
    for bad in ("eval_loss", ["eval loss"]):
        with pytest.raises(MetricError):
            TailorCallback(str(tmp_path / "store"), metrics=bad)
    args = TrainingArguments(
        output_dir=str(tmp_path / "run"), max_steps=4, save_steps=2, eval_strategy="steps", eval_steps=2,
        per_device_train_batch_size=2, report_to=[], use_cpu=True, logging_steps=1, disable_tqdm=True,
    )  # fmt: skip
    callback = TailorCallback(str(tmp_path / "store"), asynchronous=False, metrics=["eval_loss", "loss"])
    trainer = Trainer(
        model=tiny_llama(2), args=args, train_dataset=RampTokens(8, 16, 128), eval_dataset=RampTokens(4, 16, 128),
        callbacks=[callback],
    )  # fmt: skip
    trainer.train()
    callback.close()
    logged = {(e["step"], k): v for e in trainer.state.log_history for k, v in e.items() if k in ("eval_loss", "loss")}
    with Store.open(tmp_path / "store") as store:
        recorded = {s.step: s.metrics for s in store.log()}
    assert set(recorded) == {2, 4}
    for step, metrics in recorded.items():
        assert metrics == {"eval_loss": logged[(step, "eval_loss")], "loss": logged[(step, "loss")]}, metrics
