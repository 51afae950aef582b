"""Several hosts commit one step: each its own ranks' files as a part, then one finalize.

Two processes act as two hosts, each with its own cache and its own directory holding only
what DeepSpeed wrote on it, committing to one S3 store (a real local S3 server)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tailorstore import Store
from tailorstore.core.errors import BadCheckpointError
from tailorstore.core.records import FileRecord
from tailorstore.curate.gc import Retention, gc
from tailorstore.formats.layout import DEEPSPEED, HF_TRAINER
from tailorstore.ingest.finalize import missing_pieces
from tailorstore.report.verify import verify
from tailorstore.store.parts import part_keys
from tailorstore.store.repo import Repository
from testbed.compare import same_tree
from testbed.local_s3 import LocalS3
from testbed.runs import train_tiny
from tests.conftest import CLI, Runs, as_of_step, parts_of_any_age

OPTIM = "bf16_zero_pp_rank_{}_mp_rank_00_optim_states.pt"


def host(cache: Path, *args: str, store: str) -> subprocess.CompletedProcess[str]:
    """`tailor` as run on one host: its own cache directory, the shared store."""
    env = {**os.environ, "TAILOR_CACHE": str(cache), "TAILOR_STORE": store}
    return subprocess.run([*CLI, *args], capture_output=True, text=True, env=env, timeout=300)


def split_by_host(save: Path, step: int, root: Path) -> tuple[Path, Path]:
    """Host A keeps what rank 0 writes (latest, scripts, model states, rank 0's optimizer
    states); host B keeps rank 1's optimizer states and the model states, as DeepSpeed's
    ``use_node_local_storage`` writes them on every node, in its own tag folder."""
    full = as_of_step(save, step, root / "full")
    a = shutil.copytree(full, root / "host-a")
    (a / f"global_step{step}" / OPTIM.format(1)).unlink()
    b = root / "host-b" / f"global_step{step}"
    b.mkdir(parents=True)
    for name in (OPTIM.format(1), "mp_rank_00_model_states.pt"):
        shutil.copy2(full / f"global_step{step}" / name, b / name)
    return a, b


def test_two_hosts_commit_parts_to_one_s3_store_and_resume_bit_exact(
    s3_server: LocalS3, s3_location: str, runs: Runs, tmp_path: Path
) -> None:
    run = runs.get("zero2-bf16")
    host_a, host_b = split_by_host(run.save_dir, 3, tmp_path)
    cache_a, cache_b, cache_c = tmp_path / "cache-a", tmp_path / "cache-b", tmp_path / "cache-c"
    assert host(cache_a, "init", s3_location, store=s3_location).returncode == 0

    # both hosts at once, as after a real save
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "tailorstore.cli.app", "commit", str(d), "--part", "--json"],
            env={**os.environ, "TAILOR_CACHE": str(c), "TAILOR_STORE": s3_location},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for d, c in ((host_a, cache_a), (host_b, cache_b))
    ]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err for _, err in outs]
    parts = [json.loads(out)["part"] for out, _ in outs]
    assert all(key.startswith("parts/main/step-00000000000000000003/") for key in parts)

    # a part is not a step: nothing to log or check out yet
    assert json.loads(host(cache_a, "log", "--json", store=s3_location).stdout) == []

    # gc on a third host keeps every blob the parts need
    with_gc = host(cache_c, "gc", store=s3_location)
    assert with_gc.returncode == 0, with_gc.stderr

    done = host(cache_b, "commit", "--finalize", "step=3", store=s3_location)
    assert done.returncode == 0, done.stderr
    assert "2 parts" in done.stdout
    with Repository.open(s3_location) as store:
        assert part_keys(store.backend) == []  # finalize deletes the parts once the manifest is durable
        assert verify(store, deep=True).ok
    out = tmp_path / "restored"
    checkout = host(cache_c, "checkout", "step=3", "--out", str(out), store=s3_location)
    assert checkout.returncode == 0, checkout.stderr
    assert same_tree(out, tmp_path / "full")

    resumed = train_tiny(
        tmp_path / "resumed-save",
        losses_out=tmp_path / "resumed.json",
        resume_from=out,
        nproc=run.nproc,
        steps=6,
        save_every=0,
        **run.options,
    )
    assert resumed == {s: run.losses[s] for s in (4, 5, 6)}, "resumed losses differ from the uninterrupted run"


def test_a_step_with_a_missing_part_is_refused_naming_the_ranks(
    s3_server: LocalS3, s3_location: str, runs: Runs, tmp_path: Path
) -> None:
    host_a, host_b = split_by_host(runs.get("zero2-bf16").save_dir, 6, tmp_path)
    cache = tmp_path / "cache"
    assert host(cache, "init", s3_location, store=s3_location).returncode == 0
    assert host(cache, "commit", str(host_b), "--part", store=s3_location).returncode == 0
    only_b = host(cache, "commit", "--finalize", "step=6", store=s3_location)
    assert only_b.returncode == 2 and "rank(s) [0]" in only_b.stderr and "Traceback" not in only_b.stderr
    alone = tmp_path / "alone" / "global_step6"  # optimizer states without the model states cannot be cut
    alone.mkdir(parents=True)
    shutil.copy2(host_b / OPTIM.format(1), alone / OPTIM.format(1))
    refused = host(cache, "commit", str(alone), "--part", store=s3_location)
    assert refused.returncode == 2 and "use_node_local_storage" in refused.stderr
    assert host(cache, "commit", str(host_a), "--part", store=s3_location).returncode == 0

    os.rename(host_b, tmp_path / "elsewhere")  # finalize reads only the store, never the hosts' files
    with Repository.open(s3_location) as store:
        # drop host B's part: the step now lacks rank 1
        keys = part_keys(store.backend, 6)
        from tailorstore.store.parts import read_parts

        for part in read_parts(store.backend, 6):
            if any(f.path.endswith(OPTIM.format(1)) for f in part.files):
                store.backend.delete(part.key)
        assert len(part_keys(store.backend, 6)) == len(keys) - 1
    lacking = host(cache, "commit", "--finalize", "step=6", store=s3_location)
    assert lacking.returncode == 2, lacking.stderr
    assert "rank(s) [1]" in lacking.stderr and "Traceback" not in lacking.stderr
    assert json.loads(host(cache, "log", "--json", store=s3_location).stdout) == []
    with Store.open(s3_location) as api, pytest.raises(BadCheckpointError, match=r"rank\(s\) \[1\]"):
        api.finalize(6)  # the Python API says the same

    with Repository.open(s3_location) as store:  # an abandoned part goes only when asked
        assert gc(store, Retention()).drop_parts == []
        assert part_keys(store.backend, 6)
        with parts_of_any_age():
            plan = gc(store, Retention(), drop_parts=True)
        assert len(plan.drop_parts) == 1 and part_keys(store.backend) == []
        assert verify(store).ok


def record(path: str) -> FileRecord:
    return FileRecord(path, path, "torch", None, "0" * 32, 1, 0o644, False, None)


def test_missing_pieces_names_what_a_world_size_needs() -> None:
    model = record("global_step3/mp_rank_00_model_states.pt")
    optim = [record(f"global_step3/{OPTIM.format(r)}") for r in range(3)]
    assert missing_pieces(DEEPSPEED, [model, *optim], 3, 2) == []
    assert missing_pieces(DEEPSPEED, [model, optim[0], optim[2]], 3, 2) == ["the optimizer states of rank(s) [1]"]
    assert "model states" in missing_pieces(DEEPSPEED, optim, None, 2)[0]
    assert missing_pieces(DEEPSPEED, [model], 1, 0) == []  # ZeRO 0: the optimizer is inside the model states
    z3 = [record(f"global_step3/zero_pp_rank_{r}_mp_rank_00_model_states.pt") for r in (0, 1)]
    z3_optim = [record(f"global_step3/zero_pp_rank_{r}_mp_rank_00_optim_states.pt") for r in (0, 1)]
    assert missing_pieces(DEEPSPEED, [z3[0], *z3_optim], 2, 3) == ["the model states of rank(s) [1]"]
    assert missing_pieces(HF_TRAINER, [record("model.safetensors")], None, None) == []


ZERO3_RANK0 = ("zero_pp_rank_0_mp_rank_00_model_states.pt", "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt")


def test_parts_of_two_tries_of_a_step_are_never_mixed(runs: Runs, tmp_path: Path) -> None:
    """I4 (docs/FORMAT.md 8.1): a job that crashed mid-save saved the same step again after a restart.
    Finalize compared only each shared file's skeleton, the same for both tries, and took the first
    part's tensors: ZeRO-2 host A's part of try 1 with host B's of try 2 gave a mixed step, and two
    conflicting ZeRO-3 rank-0 parts were accepted. Both are refused now, naming the file."""
    first, second = split_by_host(runs.get("zero2-bf16").save_dir, 3, tmp_path / "try1")
    _, second = split_by_host(runs.get("zero2-bf16-try2").save_dir, 3, tmp_path / "try2")
    with Store.init(tmp_path / "store") as store:
        store.commit(first, part=True)
        store.commit(second, part=True)
        with pytest.raises(BadCheckpointError, match=r"mp_rank_00_model_states\.pt differs between parts"):
            store.finalize(3)
        assert store.log() == []

    # ZeRO-3: host A holds every rank's files of try 1, a stale part holds rank 0's of try 2
    zero3 = as_of_step(runs.get("zero3-bf16").save_dir, 3, tmp_path / "z3")
    stale = tmp_path / "z3-stale" / "global_step3"
    stale.mkdir(parents=True)
    again = runs.get("zero3-bf16-try2").save_dir / "global_step3"
    for name in ZERO3_RANK0:
        shutil.copy2(again / name, stale / name)
    with Store.init(tmp_path / "store3") as store:
        store.commit(zero3, part=True)
        store.commit(stale, part=True)
        with pytest.raises(BadCheckpointError, match="differs between parts"):
            store.finalize(3)
        assert store.log() == []


def test_parts_of_one_try_still_finalize_when_they_share_the_model_states(runs: Runs, tmp_path: Path) -> None:
    """The same check lets one save's parts through: both hold the model states (node-local storage),
    one derives weights the other stores, and the step checks out as the save."""
    a, b = split_by_host(runs.get("zero2-bf16").save_dir, 3, tmp_path)
    with Store.init(tmp_path / "store") as store:
        store.commit(a, part=True)
        store.commit(b, part=True)
        store.finalize(3)
        store.checkout("step=3", tmp_path / "out")
    assert same_tree(tmp_path / "out", tmp_path / "full")


def test_one_hosts_share_committed_as_a_whole_step_is_refused(runs: Runs, tmp_path: Path) -> None:
    """A whole commit must hold the whole save: host A's share (rank 0's optimizer states of a
    2-rank save) was recorded as if it were the step. It is refused, naming the missing rank, and
    commits as a part."""
    host_a, _ = split_by_host(runs.get("zero2-bf16").save_dir, 3, tmp_path)
    with Store.init(tmp_path / "store") as store:
        with pytest.raises(BadCheckpointError, match=r"incomplete: it lacks the optimizer states of rank\(s\) \[1\]"):
            store.commit(host_a)
        assert store.log() == []
        store.commit(host_a, part=True)
