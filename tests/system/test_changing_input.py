"""An input that changes under a commit is refused, and the store stays exactly as it was.

Each attack of the first-contact review is reproduced on a real ZeRO-2 save: a rank file
rewritten in place with another step's bytes, replaced by rename, truncated (once before its
pass and once under the reader), rewritten over and over while the commit runs, and file
names that checkout would refuse. Mid-commit changes are made from the commit's own progress
reporter, so they land at a known point of the commit every time.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from pathlib import Path

import pytest

from tailorstore.core.errors import BadCheckpointError, InputChangedError
from tailorstore.formats.source import InputFile
from tailorstore.ingest.commit import CommitOptions, commit_checkpoint
from tailorstore.report.verify import verify
from tailorstore.restore.checkout import checkout_step
from tailorstore.store.repo import Repository
from tests.conftest import Runs, as_of_step, store_state, tailor

OPTIM = "bf16_zero_pp_rank_{}_mp_rank_00_optim_states.pt"


class AtFile:
    """A progress reporter that does something to the input after the N-th file of the write pass
    (N=0: when the write pass starts)."""

    def __init__(self, after: int, action) -> None:
        self.after, self.action, self.done = after, action, 0

    def start(self, description: str, total: int) -> None:
        if self.after == 0:
            self.action()

    def advance(self, amount: int) -> None:
        self.done += 1
        if self.done == self.after:
            self.action()

    def close(self) -> None:
        pass


@pytest.fixture
def setting(runs: Runs, repo: Repository, tmp_path: Path):
    """A store holding step 3, a writable step-6 save to commit, and step 3's rank files as foreign bytes."""
    run = runs.get("zero2-bf16")
    at3 = as_of_step(run.save_dir, 3, tmp_path / "at3")
    commit_checkpoint(repo, at3)
    at6 = as_of_step(run.save_dir, 6, tmp_path / "at6")
    return repo, at6, at3 / "global_step3"


def overwrite_in_place(target: Path, source: Path) -> None:
    """What `dd if=source of=target conv=notrunc` does."""
    with open(target, "r+b") as f:
        f.write(source.read_bytes())


def assert_refused_and_unchanged(store: Repository, at6: Path, progress, match: str) -> None:
    before = store_state(store.root)
    with pytest.raises(InputChangedError, match=match):
        commit_checkpoint(store, at6, progress=progress)
    assert store_state(store.root) == before
    assert verify(store, deep=True).ok


def assert_honest_commit_restores(store: Repository, pristine: Path, out: Path) -> None:
    commit_checkpoint(store, pristine)
    checkout_step(store, "step=6", out)
    for original in pristine.rglob("*"):
        if original.is_file():
            assert (out / original.relative_to(pristine)).read_bytes() == original.read_bytes(), original.name


@pytest.mark.parametrize("after", [1, 3], ids=["before-its-read", "after-its-read"])
def test_rewritten_in_place_is_refused(setting, runs: Runs, tmp_path: Path, after: int) -> None:
    store, at6, foreign = setting
    target = at6 / "global_step6" / OPTIM.format(1)
    source = foreign / OPTIM.format(1)
    assert source.stat().st_size == target.stat().st_size
    assert_refused_and_unchanged(
        store, at6, AtFile(after, lambda: overwrite_in_place(target, source)), OPTIM.format(1) + ".*written to"
    )
    assert_honest_commit_restores(
        store, as_of_step(runs.get("zero2-bf16").save_dir, 6, tmp_path / "again"), tmp_path / "out"
    )


def test_replaced_by_rename_is_refused(setting, runs: Runs, tmp_path: Path) -> None:
    store, at6, foreign = setting
    target = at6 / "global_step6" / OPTIM.format(0)

    def replace() -> None:
        shutil.copyfile(foreign / OPTIM.format(0), target.with_suffix(".new"))
        os.replace(target.with_suffix(".new"), target)

    # progress now advances piece by piece, so the replace may land while the file is open: its descriptor
    # then sees the old file's unlink as a change (ctime), the reopen by name another file; both refuse
    assert_refused_and_unchanged(store, at6, AtFile(2, replace), "replaced by another file|it was written to")
    assert_honest_commit_restores(
        store, as_of_step(runs.get("zero2-bf16").save_dir, 6, tmp_path / "again"), tmp_path / "out"
    )


@pytest.mark.parametrize("name", ["mp_rank_00_model_states.pt", OPTIM.format(1)])
def test_truncated_during_commit_is_refused_without_temp_files(setting, name: str) -> None:
    """Truncated after the first pass unpickled it (mapped): before this fix, SIGBUS and temp files."""
    store, at6, _ = setting
    target = at6 / "global_step6" / name
    assert_refused_and_unchanged(
        store, at6, AtFile(0, lambda: os.truncate(target, target.stat().st_size // 2)), "size went from"
    )
    assert not list((store.root / "tmp").iterdir())


def test_a_reader_cut_short_raises_instead_of_reading_zeros(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(os.urandom(1 << 20))
    with InputFile(path) as src:
        os.truncate(path, 1000)
        with pytest.raises(InputChangedError, match="ends at byte 1000"):
            src.read(0, 1 << 20)
        with pytest.raises(InputChangedError, match="size went from"):
            src.check()


def test_bytes_that_change_between_naming_and_compressing_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"a" * (10 << 20))
    with InputFile(path) as src:
        digest = src.hash(0, src.size)
        with open(path, "r+b") as f:
            f.write(b"b" * 100)
        with pytest.raises(InputChangedError, match="differ between two reads"):
            for _ in src.verified_chunks(0, src.size, digest):
                pass


@pytest.mark.parametrize("threads", ["", "9"], ids=["default-threads", "helpers"])
def test_rewritten_over_and_over_never_poisons_the_store(
    setting, runs: Runs, tmp_path: Path, threads: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The review's worst case: repeated rewrites left blobs whose bytes did not match their names,
    and later honest commits reused them. Now the commit is refused and every blob stays true,
    also when helper threads prepare the pieces ahead of the loop (9 threads: pieces_ahead.py)."""
    monkeypatch.setenv("TAILOR_THREADS", threads)
    store, at6, foreign = setting
    target = at6 / "global_step6" / OPTIM.format(1)
    versions = [(foreign / OPTIM.format(1)).read_bytes(), target.read_bytes()]
    stop = threading.Event()
    rewrites = 0

    def flip() -> None:
        nonlocal rewrites
        while not stop.is_set():
            with open(target, "r+b") as f:
                f.write(versions[rewrites % 2])
            rewrites += 1

    before = store_state(store.root)
    thread = threading.Thread(target=flip)
    thread.start()
    try:
        while rewrites < 2 and thread.is_alive():  # rewritten over and over before the commit starts too
            time.sleep(0.001)
        at_start = rewrites
        with pytest.raises(InputChangedError):
            commit_checkpoint(store, at6)
        during = rewrites - at_start
    finally:
        stop.set()
        thread.join()
    assert at_start >= 2 and during >= 1, "the file must change under the commit, not only before it"
    assert store_state(store.root) == before
    assert verify(store, deep=True).ok
    assert_honest_commit_restores(
        store, as_of_step(runs.get("zero2-bf16").save_dir, 6, tmp_path / "again"), tmp_path / "out"
    )


@pytest.mark.parametrize("name", ["a\\b.json", "bad\udcffname.txt"])
def test_names_checkout_would_refuse_are_refused_at_commit(setting, name: str) -> None:
    store, at6, _ = setting
    try:
        (at6 / name).write_text("{}")
    except OSError:
        pytest.skip("this file system refuses the name itself")
    before = store_state(store.root)
    with pytest.raises(BadCheckpointError, match="cannot be stored"):
        commit_checkpoint(store, at6, CommitOptions())
    assert store_state(store.root) == before


def test_backslash_name_through_the_cli_is_one_line_and_exit_2(setting) -> None:
    store, at6, _ = setting
    (at6 / "a\\b.json").write_text("{}")
    before = store_state(store.root)
    done = tailor("commit", str(at6), store=store.root)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1
    assert "a\\\\b.json" in done.stderr or "a\\b.json" in done.stderr
    assert store_state(store.root) == before


def test_links_out_of_the_checkpoint_are_refused(setting, tmp_path: Path) -> None:
    """An HF-style checkpoint with a link to /etc committed all of /etc before; now it is refused."""
    store, at6, _ = setting
    (at6 / "trainer_state.json").write_text('{"global_step": 6}')
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_text("not part of the checkpoint")
    (at6 / "etclink").symlink_to(outside, target_is_directory=True)
    before = store_state(store.root)
    with pytest.raises(BadCheckpointError, match="symbolic link to a directory"):
        commit_checkpoint(store, at6)
    (at6 / "etclink").unlink()
    (at6 / "secret.txt").symlink_to(outside / "secret")
    with pytest.raises(BadCheckpointError, match="leads outside the checkpoint"):
        commit_checkpoint(store, at6)
    assert store_state(store.root) == before
