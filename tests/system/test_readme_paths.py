"""What a new user following the README ran into: each path now works as the README says."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tailorstore.core.policies import PolicySpec
from tailorstore.ingest.commit import CommitOptions, commit_checkpoint
from tailorstore.restore.checkout import checkout_step
from tailorstore.store.repo import Repository
from testbed.runs import train_tiny
from tests.conftest import Runs, as_of_step, copy_tree, index_db, store_state, tailor


def test_a_tag_folder_checkout_is_resumable_as_is(runs: Runs, repo: Repository, tmp_path: Path) -> None:
    """`tailor commit out/global_step3` then `checkout` gave no `latest`: load_checkpoint found nothing."""
    run = runs.get("zero2-bf16")
    tag_dir = copy_tree(run.save_dir / "global_step3", tmp_path / "saves" / "global_step3")
    assert commit_checkpoint(repo, tag_dir).step == 3
    out = tmp_path / "restored"
    checkout_step(repo, "step=3", out)
    assert (out / "latest").read_text() == "global_step3"
    resumed = train_tiny(
        tmp_path / "resumed",
        losses_out=tmp_path / "resumed.json",
        resume_from=out,
        steps=6,
        save_every=0,
        **run.options,
    )
    assert resumed == {s: run.losses[s] for s in (4, 5, 6)}


@pytest.fixture
def tailored(runs: Runs, tmp_path: Path) -> Repository:
    """Steps 6, 12 and 18 of the six-block run, 12 committed with parity (it inherits blocks from 6)."""
    run = runs.get("tailor-zero2")
    store = Repository.init(tmp_path / "store")
    for step, policy in ((6, "full"), (12, "parity"), (18, "full")):
        options = CommitOptions(policy=PolicySpec(policy))
        commit_checkpoint(store, as_of_step(run.save_dir, step, tmp_path / f"at{step}"), options)
    return store


def test_merge_base_by_tag_fills_unnamed_blocks_and_agrees_with_show(tailored: Repository, tmp_path: Path) -> None:
    store = tailored
    assert tailor("tag", "step=18", "late", store=store.root).returncode == 0
    spec = tmp_path / "spec.yaml"
    first = json.loads(tailor("log", "--json", store=store.root).stdout)[0]
    assert first["step"] == 6
    slices = "slices:\n  - sources: [{step: 12, layer_range: [0, 2]}]\n"
    spec.write_text(f'base: {{tag: late}}\n{slices}norm: {{id: "{first["id"]}"}}\n')
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
    # Unnamed blocks 2..5 come from the base, step 18; the norm from step 6's id.
    assert all(by_show[f"block.{i}"] == 18 for i in range(2, 6)) and by_show["final_norm"] == 6
    out = tmp_path / "mix"
    checkout_step(store, "tag=mix", out)
    assert (out / "global_step18").is_dir() and (out / "latest").read_text() == "global_step18"


def test_every_manifest_has_a_reference_and_steps_are_unambiguous(tailored: Repository, tmp_path: Path) -> None:
    store = tailored
    spec = tmp_path / "spec.yaml"
    spec.write_text("base: {step: 12}\nslices:\n  - sources: [{step: 18, layer_range: [0, 6]}]\n")
    assert tailor("merge", str(spec), "--tag", "mix", store=store.root).returncode == 0
    log = tailor("log", store=store.root).stdout
    merge_id = next(s["id"] for s in json.loads(tailor("log", "--json", store=store.root).stdout) if s["tag"] == "mix")
    assert f"id={merge_id}" in log and "merge" in log
    assert tailor("rm", "step=12", "--force", store=store.root).returncode == 0
    done = tailor("show", "step=12", store=store.root)
    assert done.returncode == 2 and f"id={merge_id} (merge, tag mix)" in done.stderr, done.stderr
    assert tailor("show", f"id={merge_id[:6]}", store=store.root).returncode == 0
    assert tailor("checkout", f"id={merge_id}", "--out", str(tmp_path / "o"), store=store.root).returncode == 0


def test_untag_lets_rm_proceed(tailored: Repository) -> None:
    store = tailored
    assert tailor("tag", "step=12", "keep", store=store.root).returncode == 0
    refused = tailor("rm", "step=12", store=store.root)
    assert refused.returncode == 2 and "tailor untag keep" in refused.stderr
    assert tailor("untag", "keep", store=store.root).returncode == 0
    assert tailor("rm", "step=12", store=store.root).returncode == 0
    assert tailor("untag", "keep", store=store.root).returncode == 2


def test_errors_name_real_paths_not_placeholders(runs: Runs, tmp_path: Path) -> None:
    """An inheritance that cannot work named `{tag}/...` in its message."""
    store = Repository.init(tmp_path / "store")
    commit_checkpoint(store, as_of_step(runs.get("tailor-zero2").save_dir, 6, tmp_path / "a"))
    odd = as_of_step(runs.get("zero2-bf16-odd-two-groups").save_dir, 6, tmp_path / "b")
    done = tailor("commit", str(odd), "--step", "12", "--policy", "parity", "--force", store=store.root)
    assert done.returncode == 2
    assert "{tag}" not in done.stderr and "global_step6/" in done.stderr, done.stderr


def test_another_model_is_refused_and_diff_says_why(runs: Runs, tmp_path: Path) -> None:
    store = Repository.init(tmp_path / "store")
    commit_checkpoint(store, as_of_step(runs.get("zero2-bf16").save_dir, 3, tmp_path / "a"))
    odd = as_of_step(runs.get("zero2-bf16-odd-two-groups").save_dir, 6, tmp_path / "b")
    refused = tailor("commit", str(odd), store=store.root)
    assert refused.returncode == 2 and "different model from step 3" in refused.stderr, refused.stderr
    assert "--force" in refused.stderr and "elements, not" in refused.stderr
    assert tailor("commit", str(odd), "--force", store=store.root).returncode == 0
    done = tailor("diff", "step=3", "step=6", store=store.root)
    assert done.returncode == 2 and "hold different models" in done.stderr, done.stderr


def test_du_accounts_for_every_byte(tailored: Repository) -> None:
    store = tailored
    u = json.loads(tailor("du", "--json", store=store.root).stdout)
    blob_files = sum(
        p.stat().st_size for sub in ("blobs", "packs") for p in (store.root / sub).rglob("*") if p.is_file()
    )
    assert u["stored_bytes"] - u["index_bytes"] == blob_files
    assert u["raw_bytes"] == sum(r["raw_bytes"] for r in json.loads(tailor("log", "--json", store=store.root).stdout))
    stored = index_db(store).execute("SELECT sum(stored_size) FROM blobs").fetchone()[0]
    assert sum(k["stored_bytes"] for k in u["kinds"].values()) == stored  # every blob under one kind
    overhead = blob_files - stored  # pack trailers
    assert 0 <= overhead < 0.02 * blob_files
    assert sum(k["raw_bytes"] for k in u["kinds"].values()) == u["raw_bytes"]
    assert {"weights", "masters", "moments"} <= set(u["kinds"])
    assert u["kinds"]["weights"]["derived_bytes"] > 0
    # Step 12 (parity) holds alone only the blocks it stored; steps 6 and 18 hold more alone.
    alone = {s["step"]: s["held_alone"] for s in u["steps"]}
    assert 0 < alone[12] < alone[6] and 0 < alone[12] < alone[18]
    assert u["gc_frees"] == 0
    assert tailor("rm", "step=18", store=store.root).returncode == 0
    after = json.loads(tailor("du", "--json", store=store.root).stdout)
    assert alone[18] <= after["gc_frees"] <= alone[18] + overhead  # its packs go whole, trailers included
    assert "smaller" in tailor("du", store=store.root).stdout


def test_plot_marks_inherited_layers_and_shows_every_committed_step(tailored: Repository, tmp_path: Path) -> None:
    """A merge is no step of training (it carries its base's step): the plot leaves it out."""
    from tailorstore.report.diff import change_matrix

    store = tailored
    spec = tmp_path / "spec.yaml"
    spec.write_text("base: {step: 12}\nslices:\n  - sources: [{step: 18, layer_range: [0, 6]}]\n")
    assert tailor("merge", str(spec), "--tag", "mix", store=store.root).returncode == 0
    m = change_matrix(store)
    assert m.columns == ["step 12", "step 18"]
    assert {"embedding", "final_norm", "lm_head"} <= set(m.layers) and "state" not in m.layers
    layers12 = {
        r["layer"]: r["source_step"]
        for r in index_db(store).execute("SELECT layer, source_step FROM layers WHERE manifest=2")
    }
    for layer, flags in zip(m.layers, m.inherited, strict=True):
        assert flags[0] == (layers12[layer] != 12), layer
        assert flags[1] is False
    assert any(flags[0] for flags in m.inherited) and not all(flags[0] for flags in m.inherited)
    assert tailor("plot", "--out", str(tmp_path / "p.png"), store=store.root).returncode == 0
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"


def test_plot_writes_a_png_file_outside_the_store_or_nothing(tailored: Repository, tmp_path: Path) -> None:
    """matplotlib picks a format from any suffix and writes DIR.png for a directory named; plot
    takes a .png path, a new one or an old plot's, outside the store, and writes it whole."""
    store = tailored
    before = store_state(store.root)
    (tmp_path / "folder.png").mkdir()
    refused = {
        str(tmp_path): "give a path ending in .png",  # wrote tmp_path.png beside it, said it wrote tmp_path
        str(tmp_path / "p.sqlite"): "give a path ending in .png",  # a ValueError traceback
        str(tmp_path / "folder.png"): "not a regular file",
        str(store.root / "blobs" / "p.png"): "lies inside the store",
    }
    for out, says in refused.items():
        proc = tailor("plot", "--out", out, store=store.root)
        assert proc.returncode == 2 and says in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert not Path(f"{tmp_path}.png").exists() and not (tmp_path / "p.sqlite").exists()
    assert store_state(store.root) == before
    (tmp_path / "old.png").write_bytes(b"an old plot")
    assert tailor("plot", "--out", str(tmp_path / "old.png"), store=store.root).returncode == 0
    assert (tmp_path / "old.png").read_bytes()[:4] == b"\x89PNG"
    assert not list(tmp_path.glob(".*tailor-partial*"))
