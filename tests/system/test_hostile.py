"""What the hostile-input review got through, each attack reproduced through the real CLI.

Every case ends in one line on stderr and exit 2 (bad input), 3 (damaged store) or 4 (lock),
never a traceback, and the store is left as it was unless the case is a repair.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import pickle
import resource
import shutil
import signal
import sqlite3
import struct
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import zstandard

from tailorstore import Store
from tailorstore.core.atom_types import TensorSlot
from tailorstore.core.errors import StoreError
from tailorstore.ingest.commit import commit_checkpoint
from tailorstore.report.diff import change_matrix
from tailorstore.store.index.catalogue import Catalogue
from tailorstore.store.repo import Repository
from tests.conftest import (
    TEST_DATA,
    HFRun,
    Runs,
    as_of_step,
    blob_object,
    copy_tree,
    edit_atoms,
    index_db,
    one_line,
    store_state,
    tailor,
    tailor_here,
)

MODEL = "mp_rank_00_model_states.pt"


@pytest.fixture
def two_steps(runs: Runs, repo: Repository, tmp_path: Path):
    """A store with steps 3 and 6 of the ZeRO-2 bf16 run, and a writable copy of step 6."""
    run = runs.get("zero2-bf16")
    commit_checkpoint(repo, as_of_step(run.save_dir, 3, tmp_path / "at3"))
    at6 = as_of_step(run.save_dir, 6, tmp_path / "at6")
    commit_checkpoint(repo, at6)
    return repo, at6


@contextlib.contextmanager
def mounted(*args: str):
    """A real mount for the test, or a skip where this sandbox forbids mounting."""
    target = Path(args[-1])
    target.mkdir(parents=True, exist_ok=True)
    if subprocess.run(["mount", *args], capture_output=True).returncode != 0:
        pytest.skip("mounting is not permitted here")
    try:
        yield target
    finally:
        subprocess.run(["umount", "-l", str(target)], capture_output=True)


# -- medium ---------------------------------------------------------------------------------


def test_gc_never_deletes_outside_the_store(two_steps, tmp_path: Path) -> None:
    store, _ = two_steps
    victim = tmp_path / "victim"
    victim.write_text("must survive")
    rel = os.path.relpath(victim, store.root / "blobs" / "..")
    conn = sqlite3.connect(store.root / "index.sqlite")
    conn.execute("PRAGMA foreign_keys=OFF")
    conn.execute(
        "INSERT INTO blobs(hash, raw_size, stored_size, codec, created_at) VALUES (?, 1, 1, ?, 0)",
        (rel, '{"id": "raw", "v": 1}'),
    )
    conn.commit()
    one_line(tailor_here("gc", store=store.root), 3, "not a 32-digit hex hash")
    assert victim.read_text() == "must survive"

    conn.execute("DELETE FROM blobs WHERE hash=?", (rel,))  # a pack name that is a path
    conn.execute("INSERT INTO packs(name, size) VALUES (?, 1)", (rel,))
    conn.commit()
    conn.close()
    proc = tailor_here("gc", store=store.root)  # no such pack in the backend: the open drops the stale row
    assert proc.returncode == 0 and "Traceback" not in proc.stderr
    assert victim.read_text() == "must survive"
    with Repository.open(store.root) as again:
        assert index_db(again).execute("SELECT count(*) FROM packs WHERE name=?", (rel,)).fetchone()[0] == 0


@pytest.mark.parametrize("damage", ["delete", "truncate"])
def test_commit_repairs_a_missing_or_cut_blob(two_steps, tmp_path: Path, damage: str) -> None:
    store, at6 = two_steps
    digest = (
        index_db(store)
        .execute(
            "SELECT a.blob FROM atoms a JOIN manifests m ON m.id=a.manifest WHERE m.step=6 AND a.kind='exp_avg'"
            " AND a.derived IS NULL ORDER BY a.nbytes DESC LIMIT 1"
        )
        .fetchone()[0]
    )
    path, start, size = blob_object(store, digest)
    if damage == "delete":
        path.unlink()
    else:
        os.truncate(path, start + size // 2)
    assert tailor_here("verify", store=store.root).returncode == 3
    done = tailor_here("commit", str(at6), "--force", store=store.root)
    assert done.returncode == 0, done.stderr
    # step 6 is whole again; blobs only step 3 kept in the same pack stay damaged, and verify says so
    assert tailor_here("verify", "step=6", "--deep", store=store.root).returncode == 0
    done = tailor_here("checkout", "step=6", "--out", str(tmp_path / "out"), store=store.root)
    assert done.returncode == 0, done.stderr


def test_verify_deep_rebuilds_derived_weights(two_steps) -> None:
    """A master atom pointed at another step's intact blob: blob checks pass, the weight no longer rebuilds."""
    store, _ = two_steps
    rows = (
        index_db(store)
        .execute(
            "SELECT a.path, a.slot, a.offset, a.param, a.start, m.step, a.blob FROM atoms a JOIN manifests m"
            " ON m.id=a.manifest WHERE a.kind='master' AND a.derived IS NULL AND a.layer='block.0'"
            " AND a.param IN (SELECT param FROM atoms WHERE derived IS NOT NULL) ORDER BY a.nbytes DESC"
        )
        .fetchall()
    )
    at6 = next(r for r in rows if r["step"] == 6)
    at3 = next(r for r in rows if r["step"] == 3 and (r["param"], r["start"]) == (at6["param"], at6["start"]))
    assert at3["blob"] != at6["blob"]
    step6 = index_db(store).execute("SELECT id FROM manifests WHERE step=6").fetchone()[0]
    assert edit_atoms(store, lambda m, a: replace(a, blob=at3["blob"]) if m == step6 and a.blob == at6["blob"] else a)
    assert tailor_here("verify", store=store.root).returncode == 0  # the blobs themselves are fine
    done = tailor_here("verify", "--deep", store=store.root)
    assert done.returncode == 3 and "rebuilt from the master" in done.stderr, done.stderr


def test_an_input_holding_our_own_slot_type_is_refused(two_steps) -> None:
    store, at6 = two_steps
    torch.save({"state": {"x": TensorSlot(0, "float32", (1,))}}, at6 / "optimizer.pt")
    before = store_state(store.root)
    one_line(tailor_here("commit", str(at6), "--step", "7", store=store.root), 2, "allowlist")
    one_line(tailor_here("commit", str(at6), "--step", "7", "--trust-pickles", store=store.root), 2, "TensorSlot")
    assert store_state(store.root) == before


@pytest.mark.parametrize("damage", ["truncate", "garbage", "format-abc"])
def test_a_damaged_index_is_one_line_and_exit_3(two_steps, damage: str) -> None:
    store, _ = two_steps
    store.close()
    index = store.root / "index.sqlite"
    for side in ("index.sqlite-wal", "index.sqlite-shm"):
        (store.root / side).unlink(missing_ok=True)
    if damage == "truncate":
        os.truncate(index, 3000)
    elif damage == "garbage":
        index.write_bytes(os.urandom(8192))
    else:
        conn = sqlite3.connect(index)
        conn.execute("UPDATE meta SET value='abc' WHERE key='format_version'")
        conn.commit()
        conn.close()
    for command in (["log"], ["verify"], ["show", "step=3"]):
        one_line(tailor_here(*command, store=store.root), 3, "index")


def test_a_directory_in_an_objects_place_is_a_damaged_store(two_steps, tmp_path: Path) -> None:
    """A directory where a blob or pack should be opens (a directory does) and failed at its
    first read: 'Is a directory', naming nothing, exit 2. It is a missing object: exit 3, named."""
    store, _ = two_steps
    master = max(store.view(Catalogue).atoms(2, kind="master"), key=lambda a: a.nbytes)
    file, _, _ = blob_object(store, master.blob)
    file.parent.chmod(0o755)
    file.unlink()
    file.mkdir()
    one_line(tailor_here("checkout", "step=6", "--out", str(tmp_path / "out"), store=store.root), 3, "is missing from")
    assert not (tmp_path / "out").exists()
    deep = tailor_here("verify", "--deep", store=store.root)  # one line per problem
    assert deep.returncode == 3 and "file missing" in deep.stdout + deep.stderr and "Traceback" not in deep.stderr


@pytest.mark.parametrize("damage", ["lock-is-a-directory", "tmp-is-a-file"])
def test_a_damaged_lock_or_temp_folder_is_exit_3_and_the_store_stays(two_steps, damage: str) -> None:
    """Both were 'Is a directory' / 'Not a directory' with the exit code of bad input."""
    store, at6 = two_steps
    if damage == "lock-is-a-directory":
        (store.root / "lock").unlink()
        (store.root / "lock").mkdir()
    else:
        shutil.rmtree(store.root / "tmp", ignore_errors=True)
        (store.root / "tmp").write_text("not a folder")
    before = store_state(store.root)
    one_line(tailor_here("commit", str(at6), "--step", "8", store=store.root), 3, "move it away and retry")
    assert store_state(store.root) == before


def test_a_missing_index_does_not_suggest_init(two_steps) -> None:
    store, _ = two_steps
    store.close()
    for name in ("index.sqlite", "index.sqlite-wal", "index.sqlite-shm"):
        (store.root / name).unlink(missing_ok=True)
    done = tailor_here("verify", store=store.root)
    one_line(done, 3, "missing")
    assert "tailor init" not in done.stderr.replace("`tailor init` refuses", "")


def test_read_commands_work_on_a_read_only_store(two_steps, tmp_path: Path) -> None:
    store, _ = two_steps
    store.close()
    with mounted("--bind", str(store.root), str(tmp_path / "ro")) as ro:
        assert subprocess.run(["mount", "-o", "remount,bind,ro", str(ro)], capture_output=True).returncode == 0
        for command in (["log"], ["show", "step=6"], ["verify", "--deep"], ["du"]):
            done = tailor_here(*command, store=ro)
            assert done.returncode == 0, (command, done.stderr)
        for command in (["tag", "step=6", "x"], ["rm", "step=3"], ["pin", "step=3"]):  # they said "damaged", exit 3
            one_line(tailor_here(*command, store=ro), 2, "read-only")
        done = tailor_here("checkout", "step=6", "--out", str(tmp_path / "out"), store=ro)
        assert done.returncode == 0, done.stderr


def test_checkout_into_the_store_is_refused(two_steps) -> None:
    store, _ = two_steps
    before = store_state(store.root)
    one_line(
        tailor_here("checkout", "step=6", "--out", str(store.root / "blobs" / "zz"), store=store.root), 2, "inside"
    )
    assert store_state(store.root) == before
    assert tailor_here("gc", "--dry-run", store=store.root).returncode == 0


def test_bad_numbers_are_refused(two_steps) -> None:
    store, at6 = two_steps
    before = store_state(store.root)
    one_line(tailor_here("commit", str(at6), "--step", "-7", store=store.root), 2, "out of range")
    one_line(tailor_here("gc", "--keep-last", "-1", store=store.root), 2, "--keep-last")
    one_line(tailor_here("gc", "--keep-every", "0", store=store.root), 2, "--keep-every")
    one_line(tailor_here("commit", str(at6), "--step", "9", "--level", "99", store=store.root), 2, "--level")
    one_line(tailor_here("gc", "--lock-timeout", "nan", store=store.root), 2, "lock timeout")
    one_line(tailor_here("show", "step=99999999999999999999999", store=store.root), 2, "out of range")
    # options of another policy were ignored and recorded in the manifest as if they had counted
    one_line(tailor_here("commit", str(at6), "--step", "9", "--every", "3", store=store.root), 2, "not --every 3")
    one_line(
        tailor_here("commit", str(at6), "--step", "9", "--policy", "adaptive", "--threshold", "nan", store=store.root),
        2,
        "a finite number",
    )
    assert store_state(store.root) == before


def test_force_keeps_the_tag_and_the_pin(two_steps) -> None:
    store, at6 = two_steps
    assert tailor_here("tag", "step=6", "keep-me", store=store.root).returncode == 0
    assert tailor_here("pin", "step=6", store=store.root).returncode == 0
    done = tailor_here("commit", str(at6), "--force", store=store.root)
    assert done.returncode == 0, done.stderr
    row = json.loads(tailor_here("log", "--json", store=store.root).stdout)
    step6 = next(r for r in row if r["step"] == 6)
    assert step6["tag"] == "keep-me" and step6["pinned"]


# -- memory and bombs ------------------------------------------------------------------------


def test_a_large_raw_file_commits_and_checks_out_in_bounded_memory(two_steps, tmp_path: Path) -> None:
    """A 1 GB sparse file: RSS took its size before (4.4 GB for 4 GB); now it streams in chunks."""
    store, at6 = two_steps
    big = at6 / "big.bin"
    with open(big, "wb") as f:
        f.truncate(1 << 30)
        f.seek(1 << 29)
        f.write(b"not all zeros")
    # VmHWM, not ru_maxrss: Linux carries ru_maxrss across fork and exec, so it would report the
    # pytest process's own peak (which grows with the tests that ran before this one).
    probe = (
        "import sys; sys.argv=['tailor',*sys.argv[1:]];"
        "import tailorstore.cli.app as a\ntry: a.main()\nfinally: "
        "print([x.split()[1] for x in open('/proc/self/status') if x.startswith('VmHWM')][0], file=sys.stderr)"
    )
    for args in (["commit", str(at6), "--step", "7"], ["checkout", "step=7", "--out", str(tmp_path / "out")]):
        done = subprocess.run(
            [sys.executable, "-c", probe, *args],
            capture_output=True,
            text=True,
            env=dict(os.environ, TAILOR_STORE=str(store.root)),
            timeout=600,
        )
        assert done.returncode == 0, done.stderr
        peak_mb = int(done.stderr.strip().splitlines()[-1]) / 1024
        assert peak_mb < 300, f"{args[0]} peaked at {peak_mb:.0f} MB for a 1 GB file"  # 61 and 77 MB measured
    restored = tmp_path / "out" / "big.bin"
    assert restored.stat().st_size == 1 << 30
    with open(restored, "rb") as f:
        f.seek(1 << 29)
        assert f.read(13) == b"not all zeros"


def torch_zip(path: Path, pickle_bytes: bytes, *, deflate: bool = False) -> None:
    """A torch-style zip whose data.pkl is exactly these bytes."""
    method = zipfile.ZIP_DEFLATED if deflate else zipfile.ZIP_STORED
    with zipfile.ZipFile(path, "w", compression=method) as z:
        z.writestr("archive/data.pkl", pickle_bytes)
        z.writestr("archive/version", "3\n")
        z.writestr("archive/byteorder", "little")


def billion_laughs() -> bytes:
    """Nine levels, each a list holding the level below ten times: 10^9 nodes from a few hundred bytes."""
    node: list = []
    for _ in range(9):
        node = [node] * 10
    return pickle.dumps({"state": node}, protocol=2)


@pytest.mark.parametrize("bomb", ["laughs", "deep", "zip"])
def test_pickle_and_zip_bombs_fail_fast_and_bounded(two_steps, bomb: str) -> None:
    store, at6 = two_steps
    target = at6 / "optimizer.pt"
    if bomb == "laughs":
        torch_zip(target, billion_laughs())
        expect = "nodes"
    elif bomb == "deep":
        # 5,000 empty lists, each appended into the one below: nested 5,000 deep (pickle.dumps itself
        # cannot write this; a hostile file can).
        torch_zip(target, b"\x80\x02" + b"]" * 5000 + b"a" * 4999 + b".")
        expect = ""
    else:
        torch_zip(target, pickle.dumps({"x": 1}) + b"\x00" * (200 << 20), deflate=True)
        expect = "zip bomb"
    assert target.stat().st_size < 1 << 20
    before = store_state(store.root)
    done = tailor("commit", str(at6), "--step", "8", store=store.root)
    one_line(done, 2, expect)
    assert store_state(store.root) == before
    peak_mb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    assert peak_mb < 2000, f"a bomb made a child peak at {peak_mb:.0f} MB"


# -- low: tracebacks that became one line -------------------------------------------------------


def test_malformed_safetensors_headers(two_steps) -> None:
    store, at6 = two_steps
    for header in ({"w": {"shape": [1]}}, {"w": ["x"]}, {"w": {"dtype": "F32", "shape": "ab", "data_offsets": [0, 4]}}):
        raw = json.dumps(header).encode()
        (at6 / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * 4)
        one_line(tailor_here("commit", str(at6), "--step", "8", store=store.root), 2, "malformed")


def test_odd_paths_and_arguments(two_steps, tmp_path: Path) -> None:
    store, at6 = two_steps
    (at6 / "proc-link").symlink_to("/proc/self/status")
    one_line(tailor_here("commit", str(at6), "--step", "8", store=store.root), 2, "outside the checkpoint")
    (at6 / "proc-link").unlink()
    long_out = tmp_path / ("x" * 300)
    one_line(tailor_here("checkout", "step=6", "--out", str(long_out), store=store.root), 2)
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    one_line(
        tailor_here("checkout", "step=6", "--out", str(tmp_path / "dangling"), store=store.root), 2, "symbolic link"
    )
    (tmp_path / "a-file").write_text("x")
    one_line(tailor_here("init", str(tmp_path / "a-file")), 2, "not a directory")


def test_text_files_that_are_binary_or_huge(two_steps, tmp_path: Path) -> None:
    """`latest`, trainer_state.json and a merge spec are read whole: a binary one is one line (it
    was a UnicodeDecodeError traceback), a huge one is refused at a bound instead of loaded, and
    a FIFO is refused instead of waited on (a merge spec that was one hung)."""
    store, at6 = two_steps
    before = store_state(store.root)
    (at6 / "latest").write_bytes(b"\xffglobal_step6")
    one_line(tailor_here("commit", str(at6), "--step", "8", store=store.root), 2, "latest: not UTF-8 text")
    with open(at6 / "latest", "wb") as f:
        f.truncate((64 << 10) + 1)  # sparse
    one_line(tailor_here("commit", str(at6), "--step", "8", store=store.root), 2, "latest: over 64 KiB")
    hf = tmp_path / "final"  # no step in the name: it is read from trainer_state.json
    hf.mkdir()
    (hf / "trainer_state.json").write_bytes(b'{"global_step": 6\xfe}')
    one_line(tailor_here("commit", str(hf), store=store.root), 2, "trainer_state.json: not UTF-8 text")
    spec = tmp_path / "spec.yaml"
    spec.write_bytes(b"layers:\n  - \x80\x81\n")
    one_line(tailor_here("merge", str(spec), "--tag", "m", store=store.root), 2, "spec.yaml: not UTF-8 text")
    # a spec of a million steps parsed for seconds per MiB, up to the 64 MiB bound of other text files
    spec.write_text("method: sma\nsteps: [" + ", ".join(map(str, range(150_000))) + "]\n")
    one_line(tailor_here("merge", str(spec), "--tag", "m", store=store.root), 2, "spec.yaml: over 1 MiB")
    os.mkfifo(tmp_path / "spec.fifo")  # nobody writes it: reading it would wait forever
    one_line(
        tailor("merge", str(tmp_path / "spec.fifo"), "--tag", "m", store=store.root, timeout=60),
        2,
        "not a regular",
    )
    assert store_state(store.root) == before


def test_tag_names_that_cannot_be_keys_or_lines(two_steps) -> None:
    """A tag names an object key and a line of `tailor log`: `..` (a path), a newline or tab,
    bytes argv could not decode, and names whose escaped key is too long for a file name are
    refused before anything is written (`..` was a backend error, 200 bytes a failed temp file)."""
    store, _ = two_steps
    before = store_state(store.root)
    for bad in ("..", ".", "a\nb", "a\tb", os.fsdecode(b"\xff"), "x" * 73, "\u00fc" * 37):
        one_line(tailor_here("tag", "step=6", "--", bad, store=store.root), 2, "is not allowed")
    assert store_state(store.root) == before
    longest = "\u00fc" * 36  # 72 bytes, 216 escaped
    assert tailor_here("tag", "step=6", "--", longest, store=store.root).returncode == 0
    assert longest in tailor_here("log", store=store.root).stdout


def test_a_store_inside_the_checkpoint_it_commits_is_refused(hf_run: HFRun, tmp_path: Path) -> None:
    """An HF checkpoint folder's subfolders are committed; a store kept there had its own index,
    changing as the commit wrote it, recorded as files of the step. Beside it, the same commit works."""
    checkpoint = copy_tree(hf_run.output_dir / "checkpoint-6", tmp_path / "checkpoint-6")
    inside = Repository.init(checkpoint / "store")
    before = store_state(inside.root)
    one_line(tailor_here("commit", str(checkpoint), store=inside.root), 2, "lies inside this checkpoint")
    assert store_state(inside.root) == before
    shutil.rmtree(checkpoint / "store")
    beside = Repository.init(tmp_path / "store")
    assert tailor_here("commit", str(checkpoint), store=beside.root).returncode == 0


def test_checkout_onto_a_mount_point_or_a_full_disk(two_steps, tmp_path: Path) -> None:
    store, _ = two_steps
    with mounted("-t", "tmpfs", "-o", "size=64k", "tmpfs", str(tmp_path / "small")) as small:
        one_line(tailor_here("checkout", "step=6", "--out", str(small), store=store.root), 2, "mount point")
        one_line(tailor_here("checkout", "step=6", "--out", str(small / "out"), store=store.root), 2, "no space")
        assert list(small.iterdir()) == []


def test_a_full_disk_under_the_index(runs: Runs, tmp_path: Path) -> None:
    """SQLite's 'database or disk is full' at the manifest transaction: exit 3, one line, and the
    blobs the commit wrote are removed again, so the store is as it was."""
    at3 = as_of_step(runs.get("zero2-bf16").save_dir, 3, tmp_path / "at3")
    with mounted("-t", "tmpfs", "-o", "size=16m", "tmpfs", str(tmp_path / "disk")) as disk:

        def free() -> int:
            return os.statvfs(disk).f_bavail * os.statvfs(disk).f_frsize

        assert tailor_here("init", str(disk / "probe")).returncode == 0
        assert tailor_here("commit", str(at3), store=disk / "probe").returncode == 0
        blobs = [p for sub in ("blobs", "packs", "manifests") for p in (disk / "probe" / sub).rglob("*") if p.is_file()]
        blob_bytes = sum(-(-p.stat().st_size // 4096) * 4096 for p in blobs)
        subprocess.run(["rm", "-rf", str(disk / "probe")], check=True)
        assert tailor_here("init", str(disk / "st")).returncode == 0
        before = store_state(disk / "st")
        with open(disk / "filler", "wb") as f:
            f.write(b"\0" * (free() - blob_bytes - (48 << 10)))  # room for the blobs, not for the index
        done = tailor_here("commit", str(at3), store=disk / "st")
        one_line(done, 3, "index")
        (disk / "filler").unlink()
        assert store_state(disk / "st") == before
        assert tailor_here("verify", store=disk / "st").returncode == 0


def test_an_unreadable_file_is_one_line(two_steps) -> None:
    """Root reads anything; without the DAC capabilities (as a normal user would be) a mode-000
    file cannot be opened, and the commit names it instead of printing a traceback."""
    store, at6 = two_steps
    secret = at6 / "unreadable.json"
    secret.write_text("{}")
    secret.chmod(0)
    before = store_state(store.root)
    env = dict(os.environ, TAILOR_STORE=str(store.root))
    done = subprocess.run(
        [
            "setpriv",
            "--bounding-set",
            "-dac_override,-dac_read_search",
            sys.executable,
            "-m",
            "tailorstore.cli.app",
            "commit",
            str(at6),
            "--step",
            "8",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    if "setpriv" in done.stderr and done.returncode != 2:
        pytest.skip(f"setpriv cannot drop capabilities here: {done.stderr.strip()[:200]}")
    one_line(done, 2, "unreadable.json", "cannot be read")
    assert store_state(store.root) == before


def test_two_checkouts_into_one_directory(two_steps, tmp_path: Path) -> None:
    """One wins and leaves a complete checkout; the other says so in one line, and leaves nothing."""
    store, _ = two_steps
    env = dict(os.environ, TAILOR_STORE=str(store.root))
    for i in range(4):
        out = tmp_path / f"out{i}"
        procs = [
            subprocess.Popen(
                [sys.executable, "-m", "tailorstore.cli.app", "checkout", "step=6", "--out", str(out)],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=env,
            )
            for _ in range(2)
        ]
        results = [(p.wait(timeout=300), p.stderr.read()) for p in procs]
        codes = sorted(code for code, _ in results)
        assert codes == [0, 2], results
        loser = next(err for code, err in results if code == 2)
        assert "Traceback" not in loser and len(loser.strip().splitlines()) == 1, loser
        assert not list(tmp_path.glob(f".out{i}.tailor-partial-*"))
        assert (out / "latest").read_text() == "global_step6"


def _rewritten(obj: Path, change) -> None:
    """Rewrite a manifest object's document through ``change`` (a host with another writer, or damage)."""
    doc = json.loads(zstandard.ZstdDecompressor().decompress(obj.read_bytes(), max_output_size=1 << 30))
    change(doc)
    obj.write_bytes(zstandard.ZstdCompressor().compress(json.dumps(doc).encode()))


def _set(table: str, row: int, column: str, value: object):
    def change(doc: dict) -> None:
        t = doc[table]
        t["rows"][row][t["columns"].index(column)] = value

    return change


SLOW = pytest.mark.slow  # four cases run in the fast tier; all fourteen in the slow


@pytest.mark.parametrize(
    ("change", "words"),
    [
        (lambda d: d.pop("files"), ["table of FileRecord rows"]),  # was KeyError, exit 1
        pytest.param(
            lambda d: d["files"]["rows"][0].pop(), ["FileRecord row has 8 values for 9 columns"], marks=SLOW
        ),  # TypeError
        pytest.param(lambda d: d["manifest"].pop("step"), ["ManifestRecord has no step"], marks=SLOW),  # KeyError
        pytest.param(
            lambda d: d["manifest"].update(step="three"), ["ManifestRecord.step is 'three', not an int"], marks=SLOW
        ),  # accepted
        pytest.param(
            lambda d: d["manifest"].update(created_at="today"), ["created_at is 'today'"], marks=SLOW
        ),  # every later `log` failed
        pytest.param(lambda d: d["atoms"].update(rows=5), ["table of AtomRecord rows"], marks=SLOW),  # TypeError
        pytest.param(
            _set("layers", 0, "layer", None), ["LayerRow.layer is None"], marks=SLOW
        ),  # a constraint error of the index
        (_set("blobs", 0, "hash", "zz"), ["'zz' is not a 32-digit hex hash"]),  # accepted as a 77th blob
        pytest.param(_set("blobs", 0, "raw_size", -5), ["raw_size is -5"], marks=SLOW),  # accepted
        (_set("files", 0, "path", "/etc/evil.pt"), ["refusing path '/etc/evil.pt'"]),  # exit 2 at checkout
        (_set("files", 0, "mode", 0o4755), ["mode 0o4755 is outside 0o777"]),  # checkout wrote a setuid file
        pytest.param(
            lambda d: d["manifest"].update(step=2**63), ["step 9223372036854775808"], marks=SLOW
        ),  # every command: OverflowError
        pytest.param(
            lambda d: d["manifest"].update(run="ft"), ["it says run 'ft'"], marks=SLOW
        ),  # "UNIQUE constraint failed"
        pytest.param(
            _set("blobs", 0, "pack_offset", 2**64), ["offset is 18446744073709551616"], marks=SLOW
        ),  # OverflowError
    ],
)
def test_a_damaged_manifest_object_is_named_and_nothing_of_it_is_indexed(
    small_store: Path, tmp_path: Path, change, words
) -> None:
    """Manifest objects are what the index is rebuilt from, and what every open imports from other
    hosts: a row of the wrong shape or type, a path leaving the checkpoint or a name that is no hash
    is damage to the store, refused in one line naming the object (exit 3), not a traceback, a
    wrong row in the index, or a bad-input error at the first checkout."""
    store = copy_tree(small_store, tmp_path / "store")
    (obj,) = (store / "manifests" / "main").iterdir()
    _rewritten(obj, change)
    key = f"manifests/main/{obj.name}"
    one_line(tailor_here("index", "rebuild", store=store), 3, key, "is damaged", *words)
    assert not list(store.glob("index.sqlite.rebuild*"))
    assert "exact" in tailor_here("log", store=store).stdout  # the old index, as it was: the rebuild replaced nothing
    another = obj.with_name(obj.name.replace("-00000000000000000003-", "-00000000000000000004-"))
    obj.rename(another)  # as if another host had committed it: the next open imports it
    one_line(tailor_here("log", store=store), 3, "is damaged", *words)
    another.unlink()
    assert tailor_here("log", store=store).stdout.count("exact") == 0  # step 3's object is gone, so is its row


def test_damaged_ref_objects_of_a_store(small_store: Path, tmp_path: Path) -> None:
    """refs/ objects are read by every open: a tag object whose bytes are not UTF-8 names no key and is
    ignored as a tag of a missing key is (it stopped every command on a UnicodeDecodeError
    traceback); a run object whose base is not a key is damage, named (it was taken as it was)."""
    store = copy_tree(small_store, tmp_path / "store")
    (store / "refs" / "tags").mkdir(parents=True, exist_ok=True)
    (store / "refs" / "tags" / "odd").write_bytes(b"\xff\xfe")
    listed = tailor_here("log", store=store)
    assert listed.returncode == 0 and "exact" in listed.stdout and "odd" not in listed.stdout, listed.stderr
    assert listed.stderr.strip() == (  # named once: gc refuses to run while it is there (test_planted_objects.py)
        "warning: tailorstore: tag object refs/tags/odd is damaged: it names no manifest object, so its tag keeps "
        "no step (gc refuses to run until it is set again or removed)"
    )
    (store / "refs" / "tags" / "odd").unlink()
    (store / "refs" / "runs").mkdir(parents=True, exist_ok=True)
    (store / "refs" / "runs" / "ft").write_text('{"created_at": 5, "base": 17}')
    one_line(tailor_here("log", store=store), 3, "run object refs/runs/ft is damaged", "RunRecord.base is 17")


@pytest.mark.parametrize(
    ("entry", "words"),
    [
        (["zz", 0, 10, 10, '{"id": "raw", "v": 1}'], ["entry 'zz'"]),
        (["0" * 32, -64, 10, 10, '{"id": "raw", "v": 1}'], ["at -64"]),
        (["0" * 32, 0, 1 << 40, 10, '{"id": "raw", "v": 1}'], ["past the body"]),
        (["0" * 32, float("inf"), 10, 10, '{"id": "raw", "v": 1}'], ["at inf"]),  # 1e999: OverflowError traceback
        (["0" * 32, 0, 10, 1.5, '{"id": "raw", "v": 1}'], ["entry"]),
    ],
)
def test_a_pack_trailer_naming_what_the_pack_cannot_hold_is_damage(
    small_store: Path, tmp_path: Path, entry, words
) -> None:
    """A pack's trailer is taken into the index as it is, by every host that meets the pack: an
    entry that is no hash, or that lies outside the pack's body, is refused as a damaged pack
    (it became a blob row that failed, or read bytes of another blob, only when used)."""
    store = copy_tree(small_store, tmp_path / "store")
    body = b"\0" * 4096
    trailer = zstandard.ZstdCompressor().compress(json.dumps({"blobs": [entry]}).encode())
    name = "ab" * 16
    pack = store / "packs" / name[:2] / name
    pack.parent.mkdir(parents=True, exist_ok=True)
    pack.write_bytes(body + trailer + struct.pack("<Q8s", len(trailer), b"TLRPACK1"))
    one_line(tailor_here("gc", store=store), 3, f"pack {name}: its trailer is damaged", *words)
    # a rebuild passes over the one damaged pack, naming it, rather than building nothing
    rebuilt = tailor_here("index", "rebuild", store=store)
    assert rebuilt.returncode == 0 and f"pack {name}: its trailer is damaged" in rebuilt.stderr, rebuilt.stderr
    assert "exact" in tailor_here("log", store=store).stdout


@pytest.mark.parametrize(
    ("folder", "global_step", "words"),
    [
        ("final", "-4", ["step -4 is out of range"]),  # was committed as an object no reader takes
        ("final", "1e400", ["global_step is inf, not a whole number"]),  # an OverflowError traceback
        ("final", '"7"', ["global_step is '7', not a whole number"]),  # was taken as step 7
        ("checkpoint-99999999999999999999999", "3", ["step 99999999999999999999999 is out of range"]),
    ],
)
def test_a_step_a_checkpoint_states_out_of_range_is_refused(
    small_store: Path, tmp_path: Path, folder: str, global_step: str, words: list[str]
) -> None:
    """An HF Trainer folder's step comes from its name or its trainer_state.json: one that is
    negative, too large for the index, or not a whole number is refused before anything is written."""
    store = copy_tree(small_store, tmp_path / "store")
    before = store_state(store)
    checkpoint = tmp_path / folder
    checkpoint.mkdir()
    (checkpoint / "trainer_state.json").write_text(f'{{"global_step": {global_step}}}')
    one_line(tailor_here("commit", str(checkpoint), store=store), 2, *words)
    assert store_state(store) == before


def test_a_setuid_mode_in_the_index_is_never_applied(small_store: Path, tmp_path: Path) -> None:
    """Checkout runs as root in most containers: a mode from the store (here a damaged index row, as
    a manifest object rewritten by anyone with bucket access would give) is masked to 0o777."""
    store = copy_tree(small_store, tmp_path / "store")
    conn = sqlite3.connect(store / "index.sqlite")
    conn.execute("UPDATE files SET mode = ?", (0o6755,))
    conn.commit()
    conn.close()
    out = tmp_path / "out"
    done = tailor_here("checkout", "latest", "--out", str(out), store=store)
    assert done.returncode == 0, done.stderr
    files = [p for p in out.rglob("*") if p.is_file()]
    assert files and all(p.stat().st_mode & 0o7000 == 0 for p in files)
    assert all(p.stat().st_mode & 0o777 == 0o755 for p in files if p.name != "latest")


def test_a_planted_pack_whose_trailer_names_another_packs_blobs_takes_nothing(
    small_store: Path, tmp_path: Path
) -> None:
    """Someone with write access plants a pack under any name, its body garbage and its trailer a
    copy of a real pack's: no row moves to it, gc deletes it as the orphan it is and keeps the real
    pack, and every step still checks out."""
    store = copy_tree(small_store, tmp_path / "store")
    (real,) = [p for p in (store / "packs").rglob("*") if p.is_file()]
    data = real.read_bytes()
    length = struct.unpack("<Q", data[-16:-8])[0]
    body = len(data) - 16 - length
    name = "f" * 32
    planted = store / "packs" / name[:2] / name
    planted.parent.mkdir(parents=True, exist_ok=True)
    planted.write_bytes(os.urandom(body) + data[body:])
    for command in (("commit", str(TEST_DATA / "format1" / "checkpoint"), "--step", "9"),
                    ("gc",), ("index", "rebuild"), ("gc",)):  # fmt: skip
        done = tailor_here(*command, store=store)
        assert done.returncode == 0, (command, done.stderr)
    assert real.is_file() and not planted.exists()
    assert tailor_here("checkout", "step=3", "--out", str(tmp_path / "out"), store=store).returncode == 0
    assert tailor_here("verify", "--deep", store=store).returncode == 0


def test_odd_keys_under_refs_and_locks_are_ignored(small_store: Path, tmp_path: Path) -> None:
    """Keys no tailorstore writes (a space, non-ASCII, a bad run name), put in the store by hand:
    every command goes on, as it does past a tag naming a missing key (they stopped every command
    with exit 2 or 3)."""
    store = copy_tree(small_store, tmp_path / "store")
    for folder, name in (("refs/tags", "a b"), ("refs/tags", "\u00e9t\u00e9"), ("refs/runs", "x y"),
                         ("refs/retention", "a b"), ("locks", "odd lock")):  # fmt: skip
        (store / folder).mkdir(parents=True, exist_ok=True)
        (store / folder / name).write_text("{}")
    for command in (("log",), ("gc", "--keep-last", "1"), ("verify",), ("run", "list")):
        done = tailor_here(*command, store=store)
        assert done.returncode == 0 and "Traceback" not in done.stderr, (command, done.stderr)
    assert "warning: tailorstore: ignoring 'refs/tags/a b'" in tailor_here("log", store=store).stderr
    assert "exact" in tailor_here("log", store=store).stdout


def test_numbers_from_the_store_out_of_range(small_store: Path, tmp_path: Path) -> None:
    """A retention a run carries of 1.5 steps (a TypeError traceback in gc) is damage, named; an
    averaging range past any step and kinds that are no names are refused as a spec (tracebacks)."""
    store = copy_tree(small_store, tmp_path / "store")
    (store / "refs" / "retention").mkdir(parents=True, exist_ok=True)
    (store / "refs" / "retention" / "main").write_text('{"tailorstore_retention": 1, "keep_last": 1.5}')
    one_line(tailor_here("gc", store=store), 3, "retention", "1.5")
    (store / "refs" / "retention" / "main").unlink()
    spec = tmp_path / "avg.yaml"
    for text, words in (
        ("method: sma\nsteps: {from: 0, to: 99999999999999999999999999, every: 1}\n", ["past the largest step"]),
        ("method: sma\nsteps: [1, 3]\nkinds: [[master]]\n", ["kinds is a list"]),
    ):
        spec.write_text(text)
        one_line(tailor_here("merge", str(spec), "--tag", "avg", store=store), 2, *words)


def test_a_folder_inside_a_tag_folder_is_named(small_store: Path, tmp_path: Path) -> None:
    """A link to a folder inside a DeepSpeed tag folder is refused, as links are elsewhere in a
    checkpoint; a plain folder there is left out with a warning (both were left out without a word)."""
    store = copy_tree(small_store, tmp_path / "store")
    checkpoint = copy_tree(TEST_DATA / "format1" / "checkpoint", tmp_path / "ckpt")
    (tmp_path / "elsewhere").mkdir()
    (checkpoint / "global_step3" / "linked").symlink_to(tmp_path / "elsewhere")
    one_line(tailor_here("commit", str(checkpoint), "--step", "4", store=store), 2, "linked", "symbolic link")
    (checkpoint / "global_step3" / "linked").unlink()
    (checkpoint / "global_step3" / "extra").mkdir()
    done = tailor_here("commit", str(checkpoint), "--step", "4", store=store)
    assert done.returncode == 0 and "extra is a folder inside a DeepSpeed tag folder" in done.stderr, done.stderr


# -- the hosts review's low findings: what each test keeps -------------------------------


def test_environment_and_selector_typos_are_one_line(small_store: Path, tmp_path: Path) -> None:
    """TAILOR_S3_TIMEOUT_SECONDS=0 made every request fail; `--store s3:/x` was taken for a local
    directory; a world size with fewer elements than ranks said '-5364 elements'."""
    store = copy_tree(small_store, tmp_path / "store")
    env = dict(os.environ, TAILOR_S3_TIMEOUT_SECONDS="0")
    done = subprocess.run(
        [sys.executable, "-m", "tailorstore.cli.app", "log", "--store", "s3://bucket/x"],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    one_line(done, 2, "TAILOR_S3_TIMEOUT_SECONDS='0' is not allowed")
    one_line(tailor_here("log", "--store", "s3:/x"), 2, "looks like an S3 location with a typo")
    out = tmp_path / "out"
    one_line(
        tailor_here("checkout", "latest", "--out", str(out), "--world-size", "5000", store=store),
        2,
        "Choose fewer ranks",
    )
    assert not out.exists()


def test_ctrl_c_says_what_it_leaves(small_store: Path, tmp_path: Path) -> None:
    store = copy_tree(small_store, tmp_path / "store")
    fd = os.open(store / "lock", os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)  # another process holds the store: gc waits
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tailorstore.cli.app", "gc", "--store", str(store)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert proc.stderr is not None
        waiting = proc.stderr.readline()  # started, and waiting for the lock
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        os.close(fd)
    assert "waiting for the exclusive store lock" in waiting
    assert proc.returncode == 130 and "interrupted: what this command had not finished is not in the store" in err


def test_merges_are_named_as_merges_in_diff(small_store: Path, tmp_path: Path) -> None:
    store = copy_tree(small_store, tmp_path / "store")
    spec = tmp_path / "mix.yaml"
    spec.write_text("base: {step: 3}\nslices:\n  - sources: [{step: 3, layer_range: [0, 1]}]\n")
    assert tailor_here("merge", str(spec), "--tag", "mix", store=store).returncode == 0
    done = tailor_here("diff", "step=3", "tag=mix", store=store)
    assert done.returncode == 0 and "relative change from step 3 to tag=mix (on step 3)" in done.stdout, done.stdout
    assert tailor_here("commit", str(TEST_DATA / "format1" / "checkpoint"), "--step", "6",
                  store=store).returncode == 0  # fmt: skip
    with Repository.open(store) as repo:  # the plot's columns: committed steps only, not the merge on step 3
        assert change_matrix(repo).columns == ["step 6"]


def test_du_after_thinning_counts_what_a_thinned_step_keeps(small_store: Path, tmp_path: Path) -> None:
    """du's raw figure of the files (skeletons, containers) was the whole save's raw size less the atoms
    a thinned step kept: 70 times too large after thinning to weights."""
    store = copy_tree(small_store, tmp_path / "store")
    checkpoint = TEST_DATA / "format1" / "checkpoint"
    assert tailor_here("commit", str(checkpoint), "--step", "6", store=store).returncode == 0
    before = json.loads(tailor_here("du", "--json", store=store).stdout)
    assert tailor_here("gc", "--keep-last", "1", "--thin", "weights", store=store).returncode == 0
    after = json.loads(tailor_here("du", "--json", store=store).stdout)
    assert after["kinds"]["files"]["raw_bytes"] <= before["kinds"]["files"]["raw_bytes"]
    thinned = next(s for s in after["steps"] if s["step"] == 3)
    assert thinned["raw_bytes"] < next(s for s in before["steps"] if s["step"] == 3)["raw_bytes"]
    assert after["raw_bytes"] == sum(s["raw_bytes"] for s in after["steps"])


def test_a_closed_store_says_so() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        store = Store.init(Path(tmp) / "store")
        store.close()
        with pytest.raises(StoreError, match="this store is closed"):
            store.log()


def _zstd_bomb(declared: int) -> bytes:
    """A zstd frame of 16 bytes whose header declares ``declared`` bytes of content (zstandard
    allocates what a frame declares, whatever ``max_output_size`` says)."""
    return bytes.fromhex("28b52ffd") + bytes([0xE0]) + struct.pack("<Q", declared) + bytes.fromhex("010000")


def test_objects_that_declare_a_terabyte_are_damage_not_an_allocation(small_store: Path, tmp_path: Path) -> None:
    """A manifest object or a pack trailer read from the store is a zstd frame another host (or
    anyone with bucket access) wrote: one that declares 1 TiB of content is refused in one line as
    damage before anything is allocated (it was a MemoryError traceback)."""
    store = copy_tree(small_store, tmp_path / "store")
    (obj,) = (store / "manifests" / "main").iterdir()
    kept = obj.read_bytes()
    obj.chmod(0o644)
    obj.write_bytes(_zstd_bomb(1 << 40))
    one_line(tailor_here("index", "rebuild", store=store), 3, "is damaged", "declares 1099511627776 bytes")
    obj.write_bytes(kept)
    trailer = _zstd_bomb(1 << 40)
    name = "cd" * 16
    pack = store / "packs" / name[:2] / name
    pack.parent.mkdir(parents=True, exist_ok=True)
    pack.write_bytes(b"\0" * 4096 + trailer + struct.pack("<Q8s", len(trailer), b"TLRPACK1"))
    one_line(tailor_here("gc", store=store), 3, f"pack {name}: its trailer is damaged", "declares 1099511627776 bytes")
