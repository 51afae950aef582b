"""An HF Trainer + DeepSpeed checkpoint-N/ folder: commit, delete, check out, resume_from_checkpoint."""

from __future__ import annotations

import shutil
from pathlib import Path

from safetensors.torch import load_file

from tailorstore.ingest.commit import commit_checkpoint
from tailorstore.restore.checkout import checkout_step
from tailorstore.store.repo import Repository
from testbed.compare import differences
from testbed.runs import train_hf
from tests.conftest import HFRun, copy_tree, index_db
from tests.system.test_roundtrip import assert_same_checkpoint


def test_hf_trainer_checkpoint_round_trip_and_resume(hf_run: HFRun, repo: Repository, tmp_path: Path) -> None:
    ck3 = copy_tree(hf_run.output_dir / "checkpoint-3", tmp_path / "work" / "checkpoint-3")
    ck6 = copy_tree(hf_run.output_dir / "checkpoint-6", tmp_path / "work" / "checkpoint-6")
    r3 = commit_checkpoint(repo, ck3)
    r6 = commit_checkpoint(repo, ck6)
    assert (r3.step, r6.step) == (3, 6)
    kinds = dict(index_db(repo).execute("SELECT path, kind FROM files WHERE manifest=1").fetchall())
    assert kinds["model.safetensors"] == "safetensors"
    assert kinds["global_step3/mp_rank_00_model_states.pt"] == "torch"
    assert kinds["trainer_state.json"] == kinds["training_args.bin"] == kinds["rng_state_1.pth"] == "raw"
    # model.safetensors holds the same bf16 weights as the DeepSpeed module: no extra blobs for them.
    extra = (
        index_db(repo)
        .execute(
            "SELECT count(*) FROM atoms a WHERE a.manifest=1 AND a.path='model.safetensors' AND a.blob NOT IN "
            "(SELECT blob FROM atoms WHERE manifest=1 AND path LIKE 'global_step3/%')"
        )
        .fetchone()[0]
    )
    assert extra == 0
    shutil.rmtree(tmp_path / "work")

    out = tmp_path / "restored" / "checkpoint-3"
    checkout_step(repo, "step=3", out)
    assert assert_same_checkpoint(hf_run.output_dir / "checkpoint-3", out) >= 10
    assert (out / "model.safetensors").read_bytes() == (
        hf_run.output_dir / "checkpoint-3" / "model.safetensors"
    ).read_bytes()

    final = tmp_path / "resumed.safetensors"
    train_hf(tmp_path / "resumed-out", final_weights=final, resume_from=out, steps=6, save_steps=3)
    assert not differences(load_file(hf_run.final_weights), load_file(final)), "resumed run ended elsewhere"
