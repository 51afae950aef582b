"""A read that another process outruns: the step it reads is removed or replaced (and gc frees its
blobs) while the read is stopped. The case it keeps: the checkout once said a blob "was deleted
behind the store's back" and advised ``verify`` (exit 3, a damaged store), where the store was
whole. Now the reader looks again: when its manifest is gone, it says the step changed while it
was read (exit 4, run it again), and it keeps nothing of the read. A blob missing from a step that
is still recorded is still damage (exit 3)."""

from __future__ import annotations

import os
import shutil
import signal
from pathlib import Path

from tests.conftest import copy_tree, one_line, tailor
from tests.system.test_hosts import start, wait_stopped


def _step(store: Path) -> str:
    rows = tailor("log", store=store).stdout.strip().splitlines()[1:]
    return rows[-1].split()[2]  # id, digest, step


def _stopped_checkout(store: Path, out: Path):
    env = {**os.environ, "TAILOR_STORE": str(store), "TAILOR_FAILPOINTS": "any/get=stop@3"}
    proc = start(env, "checkout", _step(store), "--out", str(out))
    wait_stopped(proc)  # the checkout has read its manifest and begun on the blobs
    return proc


def test_a_step_removed_while_it_is_checked_out_is_reported_as_changed_not_damaged(
    small_store: Path, tmp_path: Path
) -> None:
    store = copy_tree(small_store, tmp_path / "store")
    out = tmp_path / "out"
    reader = _stopped_checkout(store, out)
    assert tailor("rm", _step(store), "--force", store=store).returncode == 0
    assert tailor("gc", store=store).returncode == 0
    reader.send_signal(signal.SIGCONT)
    _, err = reader.communicate(timeout=120)
    assert reader.returncode == 4, err
    assert "was removed or replaced by another process while it was read" in err and "verify" not in err
    assert len(err.strip().splitlines()) == 1 and not out.exists()


def test_a_blob_missing_from_a_step_still_recorded_is_damage(small_store: Path, tmp_path: Path) -> None:
    store = copy_tree(small_store, tmp_path / "store")
    for folder in ("packs", "blobs"):
        shutil.rmtree(store / folder, ignore_errors=True)
        (store / folder).mkdir()
    done = tailor("checkout", _step(store), "--out", str(tmp_path / "out"), store=store)
    one_line(done, 3, "is missing from", "verify")
