"""The training-loop integrations with real 2-rank trainings: DeepSpeed's save helper and the
HF Trainer callback commit every save in the background and delete the originals; resuming
from the store is bit-exact."""

from __future__ import annotations

from pathlib import Path

from conftest import HFRun, Runs
from safetensors.torch import load_file

from tailorstore import Store
from tailorstore.testing.compare import differences
from tailorstore.testing.runs import train_hf, train_tiny


def test_deepspeed_save_helper_commits_in_the_background_and_resume_is_bit_exact(runs: Runs, tmp_path: Path) -> None:
    reference = runs.get("zero2-bf16")
    Store.init(tmp_path / "store").close()
    save = tmp_path / "save"
    losses = train_tiny(
        save,
        losses_out=tmp_path / "losses.json",
        steps=6,
        save_every=3,
        commit_to=tmp_path / "store",
        delete_after_commit=True,
        **reference.options,
    )
    assert losses == reference.losses, "committing in the background must not change training"
    assert not list(save.glob("global_step*")), "every save was deleted once committed"
    with Store.open(tmp_path / "store") as store:
        assert [s.step for s in store.log()] == [3, 6]
        assert store.verify(deep=True).ok
        store.checkout(3, tmp_path / "restored")
    resumed = train_tiny(
        tmp_path / "resume-save",
        losses_out=tmp_path / "resumed.json",
        resume_from=tmp_path / "restored",
        steps=6,
        save_every=0,
        **reference.options,
    )
    assert {s: resumed[s] for s in (4, 5, 6)} == {s: reference.losses[s] for s in (4, 5, 6)}


def test_hf_trainer_callback_with_delete_and_save_total_limit(hf_run: HFRun, tmp_path: Path) -> None:
    Store.init(tmp_path / "store").close()
    out = tmp_path / "out"
    train_hf(
        out,
        final_weights=tmp_path / "final.safetensors",
        steps=6,
        save_steps=3,
        tailor_store=tmp_path / "store",
        delete_after_commit=True,
        save_total_limit=1,
    )
    assert not differences(load_file(hf_run.final_weights), load_file(tmp_path / "final.safetensors"))
    assert not list(out.glob("checkpoint-*")), "every checkpoint folder was deleted once committed"
    with Store.open(tmp_path / "store") as store:
        assert [s.step for s in store.log()] == [3, 6]
        assert store.verify(deep=True).ok
        store.checkout("latest", tmp_path / "restored" / "checkpoint-6")
        store.checkout(3, tmp_path / "restored" / "checkpoint-3")
    latest = load_file(tmp_path / "restored" / "checkpoint-6" / "model.safetensors")
    assert not differences(load_file(hf_run.final_weights), latest), "latest holds the final weights"

    final = tmp_path / "resumed.safetensors"  # resume_from_checkpoint takes the checked-out folder as it is
    train_hf(tmp_path / "resumed", final_weights=final, resume_from=tmp_path / "restored" / "checkpoint-3", steps=6)
    assert not differences(load_file(hf_run.final_weights), load_file(final)), "resumed run ended elsewhere"
