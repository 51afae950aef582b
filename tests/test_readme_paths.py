"""What a new user following the README ran into: each path now works as the README says."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import Runs, as_of_step, copy_tree

from tailorstore.checkout import checkout_step
from tailorstore.commit import CommitOptions, commit_checkpoint
from tailorstore.policies import PolicySpec
from tailorstore.store.repo import Store
from tailorstore.testing.runs import train_tiny

pytestmark = pytest.mark.slow


def tailor(*args: str, store: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, TAILOR_STORE=str(store))
    return subprocess.run(
        [sys.executable, "-m", "tailorstore.cli.app", *args], capture_output=True, text=True, env=env, timeout=300
    )


def test_a_tag_folder_checkout_is_resumable_as_is(runs: Runs, store: Store, tmp_path: Path) -> None:
    """`tailor commit out/global_step3` then `checkout` gave no `latest`: load_checkpoint found nothing."""
    run = runs.get("zero2-bf16")
    tag_dir = copy_tree(run.save_dir / "global_step3", tmp_path / "saves" / "global_step3")
    assert commit_checkpoint(store, tag_dir).step == 3
    out = tmp_path / "restored"
    checkout_step(store, "step=3", out)
    assert (out / "latest").read_text() == "global_step3"
    resumed = train_tiny(
        tmp_path / "resumed", losses_out=tmp_path / "resumed.json", resume_from=out, steps=6, save_every=0,
        **run.options,
    )
    assert resumed == {s: run.losses[s] for s in (4, 5, 6)}


@pytest.fixture
def tailored(runs: Runs, tmp_path: Path) -> Store:
    """Steps 6, 12 and 18 of the six-block run, 12 committed with parity (it inherits blocks from 6)."""
    run = runs.get("tailor-zero2")
    store = Store.init(tmp_path / "store")
    for step, policy in ((6, "full"), (12, "parity"), (18, "full")):
        options = CommitOptions(policy=PolicySpec(policy))
        commit_checkpoint(store, as_of_step(run.save_dir, step, tmp_path / f"at{step}"), options)
    return store


def test_merge_base_by_tag_fills_unnamed_blocks_and_agrees_with_show(tailored: Store, tmp_path: Path) -> None:
    store = tailored
    assert tailor("tag", "step=18", "late", store=store.root).returncode == 0
    spec = tmp_path / "spec.yaml"
    spec.write_text("base: {tag: late}\nslices:\n  - sources: [{step: 12, layer_range: [0, 2]}]\nnorm: {id: 1}\n")
    done = tailor("merge", str(spec), "--tag", "mix", "--json", store=store.root)
    assert done.returncode == 0, done.stderr
    merged = json.loads(done.stdout)
    shown = json.loads(tailor("show", "tag=mix", "--json", store=store.root).stdout)
    by_show = {layer["layer"]: layer["source_step"] for layer in shown["layers"]}
    assert merged["sources"] == {k: v for k, v in by_show.items() if k in merged["sources"]}
    # Under parity, step 12 stored one of blocks 0 and 1 and inherited the other from step 6: both
    # commands name the step whose blobs a layer uses, merge also the source the spec named.
    shown12 = json.loads(tailor("show", "step=12", "--json", store=store.root).stdout)
    at12 = {layer["layer"]: layer["source_step"] for layer in shown12["layers"]}
    assert sorted(at12[f"block.{i}"] for i in (0, 1)) == [6, 12]
    inherited = next(f"block.{i}" for i in (0, 1) if at12[f"block.{i}"] == 6)
    assert all(by_show[f"block.{i}"] == at12[f"block.{i}"] for i in (0, 1))
    assert merged["named"][inherited] == "step=12"
    text = tailor("merge", str(spec), "--tag", "mix2", store=store.root).stdout
    assert f"{inherited} <- step 6 (named step=12)" in text
    # Unnamed blocks 2..5 come from the base, step 18; the norm from id=1, step 6.
    assert all(by_show[f"block.{i}"] == 18 for i in range(2, 6)) and by_show["final_norm"] == 6
    out = tmp_path / "mix"
    checkout_step(store, "tag=mix", out)
    assert (out / "global_step18").is_dir() and (out / "latest").read_text() == "global_step18"


def test_every_manifest_has_a_reference_and_steps_are_unambiguous(tailored: Store, tmp_path: Path) -> None:
    store = tailored
    spec = tmp_path / "spec.yaml"
    spec.write_text("base: {step: 12}\nslices:\n  - sources: [{step: 18, layer_range: [0, 6]}]\n")
    assert tailor("merge", str(spec), "--tag", "mix", store=store.root).returncode == 0
    log = tailor("log", store=store.root).stdout
    assert "id=4" in log and "merge" in log
    assert tailor("rm", "step=12", "--force", store=store.root).returncode == 0
    done = tailor("show", "step=12", store=store.root)
    assert done.returncode == 2 and "id=4 (merge, tag mix)" in done.stderr, done.stderr
    assert tailor("show", "id=4", store=store.root).returncode == 0
    assert tailor("checkout", "id=4", "--out", str(tmp_path / "o"), store=store.root).returncode == 0


def test_untag_lets_rm_proceed(tailored: Store) -> None:
    store = tailored
    assert tailor("tag", "step=12", "keep", store=store.root).returncode == 0
    refused = tailor("rm", "step=12", store=store.root)
    assert refused.returncode == 2 and "tailor untag keep" in refused.stderr
    assert tailor("untag", "keep", store=store.root).returncode == 0
    assert tailor("rm", "step=12", store=store.root).returncode == 0
    assert tailor("untag", "keep", store=store.root).returncode == 2


def test_errors_name_real_paths_not_placeholders(runs: Runs, tmp_path: Path) -> None:
    """An inheritance that cannot work named `{tag}/...` in its message."""
    store = Store.init(tmp_path / "store")
    commit_checkpoint(store, as_of_step(runs.get("tailor-zero2").save_dir, 6, tmp_path / "a"))
    odd = as_of_step(runs.get("zero2-bf16-odd-two-groups").save_dir, 6, tmp_path / "b")
    done = tailor("commit", str(odd), "--step", "12", "--policy", "parity", "--force", store=store.root)
    assert done.returncode == 2
    assert "{tag}" not in done.stderr and "global_step6/" in done.stderr, done.stderr
