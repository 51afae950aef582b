"""The test bed itself (testbed/runs.py): the rank launcher never leaves a rank waiting, and the
headline benchmark's training options keep DeepSpeed's bf16 layout."""

from __future__ import annotations

import json
import os

import pytest


def test_a_failed_rank_ends_the_job_and_the_others_are_killed(tmp_path) -> None:
    """The rank launcher (torchrun's job, without torchrun's start-up) never leaves a rank waiting."""
    import time

    from testbed.runs import TrainingFailed, torchrun

    module = tmp_path / "one_rank_fails.py"
    module.write_text(
        "import os, sys, time\n"
        "if os.environ['RANK'] == '1':\n    print('rank 1 gives up'); sys.exit(3)\n"
        "time.sleep(60)\n"
    )
    began = time.monotonic()
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = str(tmp_path)
    try:
        with pytest.raises(TrainingFailed, match="rank 1 exited with code 3") as caught:
            torchrun("one_rank_fails", [], nproc=2, log=tmp_path / "job.log")
    finally:
        os.environ.pop("PYTHONPATH") if old is None else os.environ.update(PYTHONPATH=old)
    assert time.monotonic() - began < 20, "rank 0 was not left sleeping"
    assert "rank 1 gives up" in caught.value.args[0] and "[rank 0]" in (tmp_path / "job.log").read_text()


@pytest.mark.slow
def test_the_headline_trainings_options_keep_deepspeeds_bf16_layout(tmp_path) -> None:
    """benchmarks/headline.py trains with text-like data, fp32 arithmetic and a held-out score;
    the checkpoint must still be the bf16 one (bf16 weights, FP32 masters) the policies are for."""
    import math

    from tailorstore.core import atom_types as A
    from tailorstore.formats.layout import detect
    from tailorstore.formats.reader import read_checkpoint
    from testbed.runs import train_tiny

    losses = train_tiny(
        tmp_path / "save",
        losses_out=tmp_path / "losses.json",
        steps=2,
        save_every=2,
        data="chain",
        fp32_compute=True,
        vocab=512,
        eval_batches=2,
        eval_out=tmp_path / "eval.json",
    )
    assert len(losses) == 2
    held_out = json.loads((tmp_path / "eval.json").read_text())
    assert held_out["batches"] == 2 and math.isfinite(held_out["held_out_loss"]) and held_out["held_out_loss"] > 0
    dtypes: dict[str, set[str]] = {}
    for f in read_checkpoint(detect(tmp_path / "save"), trust_pickles=False):
        for entry in f.entries:
            for seg in entry.segments:
                dtypes.setdefault(seg.kind, set()).add(entry.dtype_name)
    assert dtypes[A.WEIGHT] == {"bfloat16"} and dtypes[A.MASTER] == {"float32"}
