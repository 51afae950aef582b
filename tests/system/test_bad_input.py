"""Bad input is refused with exit code 2 and a message naming the file; the store stays as it was."""

from __future__ import annotations

import io
import os
import pickle
import zipfile
from pathlib import Path

import pytest
import torch

from tailorstore.core.errors import (
    BadCheckpointError,
    CorruptStoreError,
    StepExistsError,
    UnsafePathError,
    UnsafePickleError,
)
from tailorstore.ingest.commit import CommitOptions, commit_checkpoint
from tailorstore.restore.checkout import checkout_step
from tailorstore.store.repo import Repository
from tests.conftest import Runs, as_of_step, blob_object, index_db, store_state, tailor


class Evil:
    """Unpickling this runs os.system: the loader must refuse before that happens."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (os.system, (f"touch {self.marker}",))


def rewrite_pt(path: Path, mutate) -> None:
    obj = torch.load(path, weights_only=False)
    mutate(obj)
    path.chmod(0o644)
    torch.save(obj, path)


@pytest.fixture
def committed(runs: Runs, repo: Repository, tmp_path: Path) -> tuple[Repository, Path]:
    """A store holding step 3 of the ZeRO-2 run, and a writable copy of step 6 to spoil."""
    run = runs.get("zero2-bf16")
    commit_checkpoint(repo, as_of_step(run.save_dir, 3, tmp_path / "at3"))
    return repo, as_of_step(run.save_dir, 6, tmp_path / "at6")


def test_not_a_checkpoint(repo: Repository, tmp_path: Path) -> None:
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "notes.txt").write_text("hello")
    before = store_state(repo.root)
    proc = tailor("commit", str(tmp_path / "junk"), store=repo.root)
    assert proc.returncode == 2
    assert "junk: not a checkpoint" in proc.stderr and "Expected a DeepSpeed save directory" in proc.stderr
    assert store_state(repo.root) == before


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_damaged_pt_file(committed: tuple[Repository, Path], damage: str) -> None:
    store, at6 = committed
    victim = at6 / "global_step6" / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
    data = victim.read_bytes()
    victim.chmod(0o644)
    if damage == "truncate":
        victim.write_bytes(data[: len(data) // 2])
    else:
        victim.write_bytes(data[:100] + bytes(1000) + data[1100:])
    before = store_state(store.root)
    proc = tailor("commit", str(at6), store=store.root)
    assert proc.returncode == 2, proc.stderr
    assert str(victim) in proc.stderr
    assert "restore it from a good copy" in proc.stderr
    assert store_state(store.root) == before


def test_unknown_global_is_refused_then_trusted(committed: tuple[Repository, Path]) -> None:
    store, at6 = committed
    victim = at6 / "global_step6" / "mp_rank_00_model_states.pt"
    rewrite_pt(victim, lambda obj: obj.__setitem__("client_extra", io.StringIO("x")))
    before = store_state(store.root)
    proc = tailor("commit", str(at6), store=store.root)
    assert proc.returncode == 2
    assert str(victim) in proc.stderr and "_io.StringIO" in proc.stderr and "--trust-pickles" in proc.stderr
    assert store_state(store.root) == before

    assert tailor("commit", str(at6), "--trust-pickles", store=store.root).returncode == 0
    refused = tailor("checkout", "step=6", "--out", str(at6.parent / "out"), store=store.root)
    assert refused.returncode == 2 and "--trust-pickles" in refused.stderr
    assert not (at6.parent / "out").exists()
    ok = tailor("checkout", "step=6", "--out", str(at6.parent / "out"), "--trust-pickles", store=store.root)
    assert ok.returncode == 0, ok.stderr
    restored = torch.load(at6.parent / "out" / "global_step6" / "mp_rank_00_model_states.pt", weights_only=False)
    assert restored["client_extra"].getvalue() == "x"


def test_malicious_pickle_is_not_executed(committed: tuple[Repository, Path], tmp_path: Path) -> None:
    store, at6 = committed
    marker = tmp_path / "pwned"
    victim = at6 / "global_step6" / "mp_rank_00_model_states.pt"
    rewrite_pt(victim, lambda obj: obj.__setitem__("payload", Evil(marker)))
    assert not marker.exists()
    before = store_state(store.root)
    with pytest.raises(UnsafePickleError, match=r"posix\.system|os\.system"):
        commit_checkpoint(store, at6)
    assert not marker.exists(), "the pickle's code ran"
    assert store_state(store.root) == before


def test_missing_rank_file(committed: tuple[Repository, Path]) -> None:
    store, at6 = committed
    (at6 / "global_step6" / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt").unlink()
    with pytest.raises(BadCheckpointError, match=r"rank\(s\) \[0\] are missing"):
        commit_checkpoint(store, at6)


def test_same_step_twice_is_refused_unless_forced(
    committed: tuple[Repository, Path], runs: Runs, tmp_path: Path
) -> None:
    store, _ = committed
    again = as_of_step(runs.get("zero2-bf16").save_dir, 3, tmp_path / "again")
    before = store_state(store.root)
    proc = tailor("commit", str(again), store=store.root)
    assert proc.returncode == 2 and "step 3 is already in the store" in proc.stderr and "--force" in proc.stderr
    assert store_state(store.root) == before
    with pytest.raises(StepExistsError):
        commit_checkpoint(store, again)
    commit_checkpoint(store, again, CommitOptions(force=True, tag="again"))
    assert store.manifest(store.resolve("tag=again")).step == 3
    assert index_db(store).execute("SELECT count(*) FROM manifests").fetchone()[0] == 1


def test_flipped_byte_in_blob_stops_checkout(committed: tuple[Repository, Path], tmp_path: Path) -> None:
    store, _ = committed
    row = (
        index_db(store)
        .execute(
            "SELECT a.blob, a.path FROM atoms a JOIN blobs b ON b.hash=a.blob WHERE a.manifest=1 AND b.raw_size > 4096 "
            "AND a.path LIKE '%optim_states.pt' LIMIT 1"
        )
        .fetchone()
    )
    path, start, size = blob_object(store, row["blob"])
    data = bytearray(path.read_bytes())
    data[start + size // 2] ^= 0x40
    path.chmod(0o644)
    path.write_bytes(bytes(data))
    out = tmp_path / "out"
    proc = tailor("checkout", "step=3", "--out", str(out), store=store.root)
    assert proc.returncode == 3
    assert row["blob"] in proc.stderr and "step 3" in proc.stderr and "optim_states.pt" in proc.stderr
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.tailor-partial")]
    with pytest.raises(CorruptStoreError):
        checkout_step(store, "step=3", out)


def test_manifest_path_escaping_out_is_refused(committed: tuple[Repository, Path], tmp_path: Path) -> None:
    store, _ = committed
    index_db(store).execute("PRAGMA foreign_keys=OFF")
    index_db(store).execute("UPDATE files SET path='../escaped' WHERE manifest=1 AND path='latest'")
    out = tmp_path / "sub" / "out"
    with pytest.raises(UnsafePathError, match="climbs out"):
        checkout_step(store, "step=3", out)
    assert not (tmp_path / "sub" / "escaped").exists() and not out.exists()
    index_db(store).execute("UPDATE files SET path='/etc/passwd-tailor' WHERE manifest=1 AND path='../escaped'")
    with pytest.raises(UnsafePathError):
        checkout_step(store, "step=3", out)


def test_checkout_refuses_nonempty_out(committed: tuple[Repository, Path], tmp_path: Path) -> None:
    store, _ = committed
    out = tmp_path / "busy"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    proc = tailor("checkout", "step=3", "--out", str(out), store=store.root)
    assert proc.returncode == 2 and "not empty" in proc.stderr
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    proc = tailor("checkout", "step=3", "--out", str(out / "keep.txt"), store=store.root)
    assert proc.returncode == 2 and "keep.txt: is a file, not a directory" in proc.stderr  # was "not empty"
    assert (out / "keep.txt").read_text() == "mine"


def test_legacy_pickle_format_is_named(committed: tuple[Repository, Path]) -> None:
    store, at6 = committed
    victim = at6 / "global_step6" / "mp_rank_00_model_states.pt"
    victim.chmod(0o644)
    victim.write_bytes(pickle.dumps({"not": "a zip"}))
    assert not zipfile.is_zipfile(victim)
    with pytest.raises(BadCheckpointError, match="not a torch zip checkpoint"):
        commit_checkpoint(store, at6)
