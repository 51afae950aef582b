"""Derived weights, dedup before compression, and codec choice on real DeepSpeed checkpoints."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from tailorstore.access import placement
from tailorstore.core.errors import CorruptStoreError
from tailorstore.ingest.commit import CommitOptions, commit_checkpoint
from tailorstore.report.inspect import show
from tailorstore.restore.checkout import checkout_step
from tailorstore.store import codec
from tailorstore.store.packs import writer as writer_module
from tailorstore.store.repo import Repository
from tests.conftest import Runs, as_of_step, edit_atoms, index_db
from tests.system.test_roundtrip import assert_same_checkpoint

# "9": nine compressing threads, so two helpers prepare (read, name, round) the pieces ahead of
# the commit's loop (ingest/pieces_ahead.py), as on a many-core node
THREADS = pytest.mark.parametrize("threads", ["", "9"], ids=["default-threads", "helpers"])


@THREADS
def test_bf16_weights_are_derived_and_rebuilt_bit_exact(
    runs: Runs, repo: Repository, tmp_path: Path, threads: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TAILOR_THREADS", threads)
    run = runs.get("zero2-bf16")
    result = commit_checkpoint(repo, as_of_step(run.save_dir, 6, tmp_path / "at6"))
    weights = (
        index_db(repo)
        .execute("SELECT count(*), sum(derived IS NOT NULL), sum(nbytes) FROM atoms WHERE kind='weight'")
        .fetchone()
    )
    assert weights[0] > 0 and weights[1] == weights[0], "every bf16 weight equals its rounded master in ZeRO-2"
    assert result.derived_bytes == weights[2]
    assert show(repo, "step=6").derived_bytes == weights[2]
    derived_blobs = (
        index_db(repo)
        .execute("SELECT count(*) FROM atoms a JOIN blobs b ON b.hash=a.blob WHERE a.derived IS NOT NULL")
        .fetchone()[0]
    )
    assert derived_blobs == 0, "a derived weight has no blob of its own"
    out = tmp_path / "out"
    checkout_step(repo, "step=6", out)
    assert_same_checkpoint(as_of_step(run.save_dir, 6, tmp_path / "ref"), out)


@THREADS
def test_split_masters_rebuild_weights_in_order_or_by_reading_back(
    runs: Runs, repo: Repository, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, threads: str
) -> None:
    """Weights whose masters are split across two ranks' files; then the read-back check; then a bad hash."""
    monkeypatch.setenv("TAILOR_THREADS", threads)
    run = runs.get("zero2-bf16-odd-two-groups")
    commit_checkpoint(repo, as_of_step(run.save_dir, 6, tmp_path / "at6"))
    split = (
        index_db(repo)
        .execute("SELECT param FROM atoms WHERE kind='master' GROUP BY param HAVING count(DISTINCT rank) > 1")
        .fetchall()
    )
    assert split, "the odd model has a parameter whose master is cut between the ranks"
    reference = as_of_step(run.save_dir, 6, tmp_path / "ref")
    checkout_step(repo, "step=6", tmp_path / "in-order")
    assert_same_checkpoint(reference, tmp_path / "in-order")

    monkeypatch.setattr(placement, "_EARLY_BUDGET", 0)  # nothing may wait: out-of-order weights are read back
    checkout_step(repo, "step=6", tmp_path / "read-back")
    assert_same_checkpoint(reference, tmp_path / "read-back")
    monkeypatch.undo()

    param = split[0]["param"]
    # the index now promises other bytes than rounding gives
    assert edit_atoms(repo, lambda _, a: replace(a, blob="0" * 32) if a.derived and a.param == param else a)
    with pytest.raises(CorruptStoreError, match=rf"{param} \(weight, rebuilt from its FP32 master\).*does not match"):
        checkout_step(repo, "step=6", tmp_path / "bad")
    assert not (tmp_path / "bad").exists() and not list(tmp_path.glob(".bad.tailor-partial-*"))


def test_a_weight_that_is_not_its_rounded_master_is_stored(runs: Runs, repo: Repository, tmp_path: Path) -> None:
    at6 = as_of_step(runs.get("zero2-bf16").save_dir, 6, tmp_path / "at6")
    path = at6 / "global_step6" / "mp_rank_00_model_states.pt"
    obj = torch.load(path, weights_only=False)
    name = "model.layers.1.mlp.up_proj.weight"
    bumped = obj["module"][name].clone()
    bumped.view(torch.int16)[0] += 1  # one ulp away from the rounded master
    obj["module"][name] = bumped
    path.chmod(0o644)
    torch.save(obj, path)
    commit_checkpoint(repo, at6)
    query = "SELECT param, derived FROM atoms WHERE kind='weight'"
    rows = {r["param"]: r["derived"] for r in index_db(repo).execute(query)}
    assert rows[name] is None
    assert sum(v is not None for v in rows.values()) == len(rows) - 1
    out = tmp_path / "out"
    checkout_step(repo, "step=6", out)
    restored = torch.load(out / "global_step6" / "mp_rank_00_model_states.pt", weights_only=False)
    assert torch.equal(restored["module"][name].view(torch.int16), bumped.view(torch.int16))


def test_known_blobs_are_not_compressed_again(
    runs: Runs, repo: Repository, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    at6 = as_of_step(runs.get("zero3-bf16").save_dir, 6, tmp_path / "at6")
    commit_checkpoint(repo, at6)
    calls: list[int] = []
    real_encode = codec.encode

    def counting_encode(data: memoryview, **kwargs: object) -> codec.Encoded:
        calls.append(len(data))
        return real_encode(data, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(writer_module.codec, "encode", counting_encode)
    again = commit_checkpoint(repo, at6, CommitOptions(step=99))
    assert again.new_blobs == 0 and calls == [], "every blob was already stored"


def test_codec_choice_per_kind(runs: Runs, repo: Repository, tmp_path: Path) -> None:
    commit_checkpoint(repo, as_of_step(runs.get("zero2-fp32").save_dir, 6, tmp_path / "at6"))
    by_kind: dict[str, set[str]] = {}
    for r in index_db(repo).execute(
        "SELECT a.kind, b.codec FROM atoms a JOIN blobs b ON b.hash=a.blob WHERE b.raw_size > 4096"
    ):
        by_kind.setdefault(r["kind"], set()).add(json.loads(r["codec"])["id"])
    for kind in ("master", "exp_avg", "exp_avg_sq", "weight"):
        assert by_kind[kind] <= {"bytegroup-zstd", "raw"} and "bytegroup-zstd" in by_kind[kind]
    skeletons = {
        json.loads(r[0])["id"]
        for r in index_db(repo).execute(
            "SELECT b.codec FROM files f JOIN blobs b ON b.hash=f.blob WHERE f.kind='torch'"
        )
    }
    assert skeletons <= {"zstd", "raw"}


def test_zero0_optimizer_state_is_labelled_by_layer_and_weights_derive(
    runs: Runs, repo: Repository, tmp_path: Path
) -> None:
    """ZeRO 0 writes no param_shapes; with one param group the module order names the optimizer state."""
    commit_checkpoint(repo, as_of_step(runs.get("zero0-bf16").save_dir, 6, tmp_path / "at6"))
    layers = {
        r[0] for r in index_db(repo).execute("SELECT DISTINCT layer FROM atoms WHERE kind IN ('master', 'exp_avg')")
    }
    assert {"embedding", "block.0", "block.3", "final_norm", "lm_head"} <= layers and "state" not in layers
    total, derived = (
        index_db(repo).execute("SELECT count(*), sum(derived IS NOT NULL) FROM atoms WHERE kind='weight'").fetchone()
    )
    assert total == derived > 0
    out = tmp_path / "out"
    checkout_step(repo, "step=6", out)
    assert_same_checkpoint(as_of_step(runs.get("zero0-bf16").save_dir, 6, tmp_path / "ref"), out)
