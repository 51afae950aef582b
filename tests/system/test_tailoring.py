"""Layer-wise tailoring on real DeepSpeed runs: policies, composites, merge, diff and plot."""

from __future__ import annotations

import itertools
import json
import math
import os
import subprocess
import zipfile
from pathlib import Path

import pytest
import torch

from tailorstore.core import atom_types as A
from tailorstore.core.layers import block_index
from tailorstore.core.policies import PolicySpec
from tailorstore.core.progress import Silent
from tailorstore.formats.layout import detect
from tailorstore.formats.reader import read_checkpoint
from tailorstore.formats.tensors import dtype_from_name
from tailorstore.ingest.commit import CommitOptions, commit_checkpoint, scan_checkpoint
from tailorstore.restore.checkout import checkout_step
from tailorstore.store.repo import Repository
from testbed.compare import tensors_identical
from testbed.runs import train_tiny
from tests.conftest import TAILOR_EVERY, TAILOR_STEPS, Runs, as_of_step, index_db, tailor

SAVES = list(range(TAILOR_EVERY, TAILOR_STEPS + 1, TAILOR_EVERY))
KINDS = (A.WEIGHT, A.MASTER, A.EXP_AVG, A.EXP_AVG_SQ)


class Warned(Silent):
    """A progress that keeps the warnings a verb gave."""

    def __init__(self, warnings: list[str]) -> None:
        self.warnings = warnings

    def warn(self, message: str) -> None:
        self.warnings.append(message)


def commit_series(store: Repository, save_dir: Path, work: Path, policy: PolicySpec) -> None:
    for step in SAVES:
        commit_checkpoint(store, as_of_step(save_dir, step, work / f"at{step}"), CommitOptions(policy=policy))


def pieces(ckpt: Path) -> dict[tuple[str, str, str, int, int], tuple[str, object]]:
    """(file key, param, kind, rank, start) -> (layer, tensor piece), read straight from the files."""
    layout = detect(ckpt)
    out = {}
    for f in read_checkpoint(layout):
        with f.open() as src:
            for entry in f.entries:
                for seg in entry.segments:
                    if seg.kind in KINDS and seg.numel:
                        key = (f.file_key, seg.param, seg.kind, seg.rank, seg.start)
                        data = bytearray(f.piece(src, entry, seg))
                        out[key] = (seg.layer, torch.frombuffer(data, dtype=dtype_from_name(entry.dtype_name)))
    return out


def assert_layers_from_sources(restored: Path, save_dir: Path, sources: dict[str, int], work: Path) -> None:
    originals = {step: pieces(as_of_step(save_dir, step, work / f"orig{step}")) for step in set(sources.values())}
    got = pieces(restored)
    checked = 0
    for key, (layer, tensor) in got.items():
        if layer not in sources:
            continue
        source_layer, original = originals[sources[layer]][key]
        assert source_layer == layer
        assert tensors_identical(tensor, original), f"{key} differs from step {sources[layer]}"  # type: ignore[arg-type]
        checked += 1
    assert checked > 0


def resume_finite(restored: Path, run_options: dict[str, object], start: int, work: Path, steps: int = 5) -> dict:
    losses = train_tiny(
        work / "resume-save",
        losses_out=work / "resume.json",
        resume_from=restored,
        steps=start + steps,
        save_every=0,
        **run_options,
    )
    assert sorted(losses) == list(range(start + 1, start + steps + 1))
    assert all(math.isfinite(float.fromhex(v)) for v in losses.values())
    return losses


def block_bytes(store: Repository) -> int:
    return (
        index_db(store)
        .execute(
            "SELECT coalesce(sum(b.stored_size), 0) FROM blobs b WHERE b.hash IN (SELECT blob FROM atoms "
            "WHERE layer LIKE 'block.%' AND derived IS NULL)"
        )
        .fetchone()[0]
    )


def assert_zip_crcs_hold(restored: Path) -> None:
    """A composite puts other steps' bytes into a step's zip files; every record's CRC-32 must match."""
    files = sorted(restored.rglob("*.pt"))
    assert files
    for path in files:
        with zipfile.ZipFile(path) as z:
            assert z.testzip() is None, f"{path.name}: a record's CRC-32 does not match its bytes"


@pytest.mark.parametrize("config", ["tailor-zero2", "tailor-zero3"])
def test_parity_halves_blocks_and_composites_resume(config: str, runs: Runs, tmp_path: Path) -> None:
    run = runs.get(config)
    full = Repository.init(tmp_path / "full")
    parity = Repository.init(tmp_path / "parity")
    commit_series(full, run.save_dir, tmp_path / "f", PolicySpec("full"))
    commit_series(parity, run.save_dir, tmp_path / "p", PolicySpec("parity"))
    # 6 blocks over 6 saves: the first stores all 6, the next five 3 each: 21 of 36 block versions.
    assert (stored_block_versions(parity), stored_block_versions(full)) == (21, 36)
    ratio = block_bytes(parity) / block_bytes(full)
    assert 0.5 <= ratio <= 0.65, ratio  # 21/36 = 0.583 of the block versions, compressed sizes differ a little

    log = index_db(parity).execute("SELECT id, step, exact FROM manifests ORDER BY step").fetchall()
    assert [r["exact"] for r in log] == [1, 0, 0, 0, 0, 0]
    halves = []
    for r in log[1:]:
        stored = {
            x["layer"]
            for x in index_db(parity).execute("SELECT layer FROM layers WHERE manifest=? AND stored", (r["id"],))
        }
        blocks = {block_index(x) for x in stored} - {None}
        turn = SAVES.index(r["step"]) % 2
        assert blocks == {i for i in range(6) if i % 2 == turn}
        halves.append(stored)
    layers = {
        x["layer"] for x in index_db(parity).execute("SELECT layer FROM layers WHERE manifest=?", (log[0]["id"],))
    }
    for this, following in itertools.pairwise(halves):  # every group, aux ones too, every other commit
        assert this & following == {"state"} and this | following == layers
        assert {"embedding", "lm_head"} - this and {"embedding", "lm_head"} - following

    for r in log[1:]:
        step = r["step"]
        sources = {
            x["layer"]: x["source_step"]
            for x in index_db(parity).execute("SELECT layer, source_step FROM layers WHERE manifest=?", (r["id"],))
        }
        assert any(v != step for v in sources.values())
        restored = tmp_path / f"composite{step}"
        warnings: list[str] = []
        checkout_step(parity, f"step={step}", restored, progress=Warned(warnings))
        assert warnings and "composite" in warnings[0] and f"from step {step - TAILOR_EVERY}" in warnings[0]
        assert_layers_from_sources(restored, run.save_dir, sources, tmp_path / f"cmp{step}")
        assert_zip_crcs_hold(restored)
        # the last ZeRO 3 composite trains on here; the ZeRO 2 one does in test_quality_parity_composite_against_exact
        if step == log[-1]["step"] and config == "tailor-zero3":
            resume_finite(restored, run.options, step, tmp_path / f"resume{step}")


def stored_block_versions(store: Repository) -> int:
    return index_db(store).execute("SELECT count(*) FROM layers WHERE stored AND layer LIKE 'block.%'").fetchone()[0]


def test_filter_and_adaptive_policies(runs: Runs, tmp_path: Path) -> None:
    run = runs.get("tailor-zero2")
    filtered = Repository.init(tmp_path / "filter")
    commit_series(
        filtered, run.save_dir, tmp_path / "f", PolicySpec("filter", {"keep_first": 1, "keep_last": 1, "every": 3})
    )
    for i, r in enumerate(index_db(filtered).execute("SELECT id FROM manifests ORDER BY step").fetchall()):
        stored = {
            x[0] for x in index_db(filtered).execute("SELECT layer FROM layers WHERE manifest=? AND stored", (r["id"],))
        }
        blocks = {block_index(x) for x in stored} - {None}
        assert blocks == (set(range(6)) if i % 3 == 0 else {0, 5}), (i, blocks)
        assert {"embedding", "final_norm", "lm_head"} <= stored

    huge = Repository.init(tmp_path / "huge")
    commit_series(huge, run.save_dir, tmp_path / "h", PolicySpec("adaptive", {"threshold": 1e9}))
    zero = Repository.init(tmp_path / "zero")
    commit_series(zero, run.save_dir, tmp_path / "z", PolicySpec("adaptive", {"threshold": 0.0}))
    for store, expect_blocks in ((huge, False), (zero, True)):
        rows = index_db(store).execute("SELECT id FROM manifests ORDER BY step").fetchall()
        for r in rows[1:]:
            layers = (
                index_db(store)
                .execute("SELECT layer, stored, change FROM layers WHERE manifest=?", (r["id"],))
                .fetchall()
            )
            stored = {x["layer"] for x in layers if x["stored"]}
            assert {x for x in stored if block_index(x) is None} >= {"embedding", "final_norm", "lm_head", "state"}
            assert any(block_index(x) is not None for x in stored) == expect_blocks
            changes = [x["change"] for x in layers if block_index(x["layer"]) is not None]
            assert len(changes) == 6 and all(c is not None and c > 0 for c in changes)

    # A threshold between the measured changes: each commit stores exactly the blocks that moved at
    # least that much since their last stored version, and inherits the others.
    second = (
        index_db(zero)
        .execute("SELECT layer, change FROM layers WHERE manifest=2 AND layer LIKE 'block.%' ORDER BY change")
        .fetchall()
    )
    threshold = (second[2]["change"] + second[3]["change"]) / 2
    mid = Repository.init(tmp_path / "mid")
    commit_series(mid, run.save_dir, tmp_path / "m", PolicySpec("adaptive", {"threshold": threshold}))
    moved_at_second = {x["layer"] for x in second if x["change"] >= threshold}
    assert len(moved_at_second) == 3
    inherited_some = False
    for r in index_db(mid).execute("SELECT id FROM manifests ORDER BY step").fetchall()[1:]:
        layers = (
            index_db(mid)
            .execute("SELECT layer, stored, change FROM layers WHERE manifest=? AND layer LIKE 'block.%'", (r["id"],))
            .fetchall()
        )
        assert {x["layer"] for x in layers if x["stored"]} == {x["layer"] for x in layers if x["change"] >= threshold}
        inherited_some |= any(not x["stored"] for x in layers)
        if r["id"] == 2:  # measured against step 3, which stored everything: the same change as above
            assert {x["layer"] for x in layers if x["stored"]} == moved_at_second
    assert inherited_some


def test_budget_policy_spends_its_bytes_on_the_layers_that_moved_most(runs: Runs, tmp_path: Path) -> None:
    """Six saves of a real run. Each commit stores state, every layer left unstored for max_age
    commits, then layers by measured change while the byte budget lasts: an unstored layer never
    fits in what is left, nor would it have where a layer that moved less was taken. The composite
    checks out with each layer from the step the index names."""
    run = runs.get("tailor-zero2")
    sizes = scan_checkpoint(detect(as_of_step(run.save_dir, SAVES[0], tmp_path / "s")), False).layer_bytes
    allowance, max_age = 0.4 * sum(sizes.values()), 3
    store = Repository.init(tmp_path / "budget")
    spec = PolicySpec("budget", {"fraction": 0.4, "max_age": max_age})
    for step in SAVES[:-1]:
        commit_checkpoint(store, as_of_step(run.save_dir, step, tmp_path / f"at{step}"), CommitOptions(policy=spec))
    # the last one through the command line, whose flags must reach the policy
    last = as_of_step(run.save_dir, SAVES[-1], tmp_path / f"at{SAVES[-1]}")
    flags = ["--policy", "budget", "--fraction", "0.4", "--max-age", str(max_age)]
    assert tailor("commit", str(last), *flags, store=tmp_path / "budget").returncode == 0
    store.refresh()
    recorded = json.loads(
        index_db(store).execute("SELECT policy FROM manifests WHERE step=?", (SAVES[-1],)).fetchone()[0]
    )
    assert recorded == {"name": "budget", "fraction": 0.4, "max_age": max_age}
    candidates = sorted(set(sizes) - {"state"})
    last_stored = dict.fromkeys(candidates, 0)
    rows = index_db(store).execute("SELECT id, step FROM manifests ORDER BY step").fetchall()
    inherited = 0
    for i, r in enumerate(rows[1:], start=1):
        layers = {x["layer"]: x for x in index_db(store).execute("SELECT * FROM layers WHERE manifest=?", (r["id"],))}
        assert layers["state"]["stored"]
        forced = {x for x in candidates if i - last_stored[x] >= max_age}
        stored = {x for x in candidates if layers[x]["stored"]}
        chosen = stored - forced
        assert forced <= stored
        spent = sum(sizes[x] for x in stored | {"state"})
        assert sum(sizes[x] for x in chosen) <= max(0.0, allowance - sum(sizes[x] for x in forced | {"state"}))
        for left in set(candidates) - stored:
            assert spent + sizes[left] > allowance, (r["step"], left)
            moved_less = [x for x in chosen if layers[x]["change"] < layers[left]["change"]]
            assert all(sizes[left] > sizes[x] for x in moved_less), (r["step"], left, moved_less)
        for x in stored:
            last_stored[x] = i
        assert all(i - last_stored[x] < max_age for x in candidates)  # nobody waits longer than the bound
        inherited += len(candidates) - len(stored)
    assert inherited >= 2 * (len(rows) - 1)  # the budget held commits well below every layer
    sources = {
        x["layer"]: x["source_step"]
        for x in index_db(store).execute("SELECT layer, source_step FROM layers WHERE manifest=?", (rows[-1]["id"],))
    }
    checkout_step(store, f"step={rows[-1]['step']}", tmp_path / "composite", progress=Warned([]))
    assert_layers_from_sources(tmp_path / "composite", run.save_dir, sources, tmp_path / "cmp")


def test_merge_from_three_steps(runs: Runs, tmp_path: Path) -> None:
    run = runs.get("tailor-zero2")
    store = Repository.init(tmp_path / "store")
    commit_series(store, run.save_dir, tmp_path / "c", PolicySpec("full"))
    spec = tmp_path / "spec.yaml"
    spec.write_text(
        "base: {step: 18}\n"
        "slices:\n"
        "  - sources: [{step: 6, layer_range: [0, 2]}]\n"
        "  - sources: [{step: 12, layer_range: [2, 4]}]\n"
        "  - sources: [{step: 18, layer_range: [4, 6]}]\n"
        "embed: {step: 18}\nnorm: {step: 12}\nlm_head: {step: 6}\n"
    )
    blobs_before = index_db(store).execute("SELECT count(*) FROM blobs").fetchone()[0]
    env = dict(os.environ, TAILOR_STORE=str(store.root))
    proc = subprocess.run(
        ["tailor", "merge", str(spec), "--tag", "mix", "--json"], capture_output=True, text=True, env=env
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["sources"]["block.2"] == 12
    assert index_db(store).execute("SELECT count(*) FROM blobs").fetchone()[0] == blobs_before  # no blob written
    restored = tmp_path / "mix"
    checkout_step(store, "tag=mix", restored)
    sources = {
        "block.0": 6,
        "block.1": 6,
        "block.2": 12,
        "block.3": 12,
        "block.4": 18,
        "block.5": 18,
        "embedding": 18,
        "final_norm": 12,
        "lm_head": 6,
    }
    assert_layers_from_sources(restored, run.save_dir, sources, tmp_path / "cmp")
    assert_zip_crcs_hold(restored)
    resume_finite(restored, run.options, 18, tmp_path / "resume")


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (
            "base: {step: 18}\nslices:\n  - sources: [{step: 6, layer_range: [0, 4]}]\n"
            "  - sources: [{step: 12, layer_range: [3, 6]}]\n",
            "ranges overlap",
        ),
        ("base: {tag: nothing}\nslices:\n  - sources: [{step: 6, layer_range: [0, 4]}]\n", "nothing is tagged"),
        ("base: {step: 18}\nslices:\n  - sources: [{step: 7, layer_range: [0, 6]}]\n", "step 7 is not in the store"),
        ("base: {step: 18}\nslices:\n  - sources: [{step: 6}]\n", "layer_range must be"),
        ("slices:\n  - sources: [{step: 6, layer_range: [0, 6]}]\n", "base: needs one of step, tag or id"),
        ("base: {step: 18}\nslices:\n  - sources: [{step: 6, layer_range: [0, 9]}]\n", "block 6 does not exist"),
    ],
)
def test_bad_merge_specs(body: str, message: str, runs: Runs, tmp_path: Path) -> None:
    run = runs.get("tailor-zero2")
    store = Repository.init(tmp_path / "store")
    for step in (6, 12, 18):
        commit_checkpoint(store, as_of_step(run.save_dir, step, tmp_path / f"at{step}"))
    spec = tmp_path / "bad.yaml"
    spec.write_text(body)
    env = dict(os.environ, TAILOR_STORE=str(store.root))
    proc = subprocess.run(["tailor", "merge", str(spec), "--tag", "bad"], capture_output=True, text=True, env=env)
    assert proc.returncode == 2
    assert message in proc.stderr
    assert index_db(store).execute("SELECT count(*) FROM manifests").fetchone()[0] == 3


def test_diff_and_plot(runs: Runs, tmp_path: Path) -> None:
    run = runs.get("tailor-zero2")
    store = Repository.init(tmp_path / "store")
    commit_series(store, run.save_dir, tmp_path / "c", PolicySpec("full"))
    env = dict(os.environ, TAILOR_STORE=str(store.root))
    proc = subprocess.run(["tailor", "diff", "step=3", "step=18", "--json"], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr
    rows = {r["layer"]: r for r in json.loads(proc.stdout)["layers"]}
    assert {f"block.{i}" for i in range(6)} <= set(rows)
    assert all(rows[f"block.{i}"]["master"] > 0 and rows[f"block.{i}"]["weight"] > 0 for i in range(6))
    same = subprocess.run(["tailor", "diff", "step=6", "step=6", "--json"], capture_output=True, text=True, env=env)
    assert same.returncode == 0, same.stderr
    assert all(r["master"] == 0.0 for r in json.loads(same.stdout)["layers"])
    png = tmp_path / "change.png"
    proc = subprocess.run(["tailor", "plot", "--out", str(png)], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000


def test_quality_parity_composite_against_exact(runs: Runs, tmp_path: Path) -> None:
    """20 more steps from the parity composite and from the exact checkpoint of the same step."""
    run = runs.get("tailor-zero2")
    parity = Repository.init(tmp_path / "parity")
    commit_series(parity, run.save_dir, tmp_path / "p", PolicySpec("parity"))
    last = SAVES[-1]
    composite = tmp_path / "composite"
    checkout_step(parity, f"step={last}", composite)
    assert index_db(parity).execute("SELECT exact FROM manifests WHERE step=?", (last,)).fetchone()[0] == 0
    exact = as_of_step(run.save_dir, last, tmp_path / "exact")
    from_composite = resume_finite(composite, run.options, last, tmp_path / "rc", steps=20)
    from_exact = resume_finite(exact, run.options, last, tmp_path / "re", steps=20)
    a, b = float.fromhex(from_composite[last + 20]), float.fromhex(from_exact[last + 20])
    print(f"final loss after 20 more steps: parity composite {a:.6f}, exact {b:.6f}")
    assert abs(a - b) / b <= 0.05
