"""Commit, delete the originals, check out, compare every tensor, resume bit-exact."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tailorstore.formats.safe_load import load_torch_file
from tailorstore.ingest.commit import commit_checkpoint
from tailorstore.restore.checkout import checkout_step
from tailorstore.store.repo import Repository
from testbed.compare import differences
from testbed.runs import train_tiny
from tests.conftest import CONFIGS, Runs, as_of_step, copy_tree, index_db


def assert_same_checkpoint(original: Path, restored: Path) -> int:
    """Every file present on both sides and equal byte for byte (torch files also tensor by tensor)."""
    names = sorted(str(p.relative_to(original)) for p in original.rglob("*") if p.is_file())
    assert names == sorted(str(p.relative_to(restored)) for p in restored.rglob("*") if p.is_file())
    for name in names:
        a, b = original / name, restored / name
        if name.endswith(".pt"):
            diffs = differences(load_torch_file(a)[0], load_torch_file(b)[0])
            assert not diffs, f"{name}: {diffs[:5]}"
        assert a.read_bytes() == b.read_bytes(), f"{name} is not byte-identical"
    return len(names)


# Every configuration's checkout is byte-identical to its save; one per ZeRO stage and dtype also
# trains on from it under DeepSpeed (the others get the same bytes, so DeepSpeed's own determinism
# does the rest; each resume is a DeepSpeed job of some 8 s).
RESUMED = {"zero0-fp32", "zero1-bf16", "zero2-bf16", "zero3-bf16"}


@pytest.mark.parametrize("config", list(CONFIGS))
def test_commit_delete_checkout_resume(config: str, runs: Runs, repo: Repository, tmp_path: Path) -> None:
    run = runs.get(config)
    # What the save directory held right after each save, as separate copies we can delete.
    at3 = as_of_step(run.save_dir, 3, tmp_path / "at3")
    at6 = copy_tree(run.save_dir, tmp_path / "at6")
    assert commit_checkpoint(repo, at3).step == 3
    result6 = commit_checkpoint(repo, at6)
    assert result6.step == 6
    # Unchanged files (the scripts) and the step's own data dedup: step 6 stores fewer bytes than it holds.
    assert result6.new_bytes < result6.raw_bytes
    shutil.rmtree(at3)
    shutil.rmtree(at6)

    out3 = tmp_path / "out3"
    checkout_step(repo, "step=3", out3)
    assert assert_same_checkpoint(as_of_step(run.save_dir, 3, tmp_path / "ref3"), out3) >= 2
    out6 = tmp_path / "out6"
    checkout_step(repo, "latest", out6)
    assert_same_checkpoint(as_of_step(run.save_dir, 6, tmp_path / "ref6"), out6)
    if config not in RESUMED:
        return
    resumed = train_tiny(
        tmp_path / "resumed-save",
        losses_out=tmp_path / "resumed.json",
        resume_from=out3,
        nproc=run.nproc,
        steps=6,
        save_every=0,
        **run.options,
    )
    assert sorted(resumed) == [4, 5, 6]
    assert resumed == {s: run.losses[s] for s in (4, 5, 6)}, "resumed losses differ from the uninterrupted run"


def test_flat_partitions_are_cut_at_parameter_boundaries(runs: Runs, repo: Repository) -> None:
    """The odd model: ZeRO-2 partitions cut through a parameter; ZeRO-3 pieces carry padding."""
    commit_checkpoint(repo, runs.get("zero2-bf16-odd-two-groups").save_dir)
    rows = (
        index_db(repo)
        .execute("SELECT param, rank, start, numel FROM atoms WHERE kind='master' ORDER BY param, rank")
        .fetchall()
    )
    by_param: dict[str, list[tuple[int, int, int]]] = {}
    for r in rows:
        by_param.setdefault(r["param"], []).append((r["rank"], r["start"], r["numel"]))
    split = {p: pieces for p, pieces in by_param.items() if len(pieces) > 1}
    assert split, "expected a parameter split across the two ranks"
    for pieces in split.values():
        (r0, s0, n0), (r1, s1, _n1) = pieces
        assert (r0, r1) == (0, 1) and s0 == 0 and s1 == n0  # the second rank continues where the first ended
    padding = index_db(repo).execute("SELECT count(*) FROM atoms WHERE kind LIKE '%.padding'").fetchone()[0]
    assert padding > 0


def test_zero3_pieces_follow_ceil_split(runs: Runs, repo: Repository) -> None:
    commit_checkpoint(repo, runs.get("zero3-bf16-odd-per-layer").save_dir)
    rows = (
        index_db(repo)
        .execute("SELECT param, rank, start, numel FROM atoms WHERE kind='master' AND layer<>'state'")
        .fetchall()
    )
    per_param: dict[str, dict[int, tuple[int, int]]] = {}
    for r in rows:
        per_param.setdefault(r["param"], {})[r["rank"]] = (r["start"], r["numel"])
    odd = {p: v for p, v in per_param.items() if sum(n for _, n in v.values()) % 2 == 1}
    assert odd, "the odd model must have parameters with an odd element count"
    for ranks in odd.values():
        (s0, n0), (s1, n1) = ranks[0], ranks[1]
        assert s0 == 0 and s1 == n0 and n0 == n1 + 1  # ceil split; the missing element is padding on rank 1
    groups = index_db(repo).execute("SELECT count(DISTINCT param) FROM atoms WHERE kind='step'").fetchone()[0]
    assert groups > 2, "per-layer param groups give one optimizer step counter per group"
