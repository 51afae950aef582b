"""A training's head file (integrations/deepspeed/head.py) is input from outside: anything but a well-formed
head is ignored with a warning, as if the job had none."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from tailorstore.integrations.deepspeed.head import HEAD_FILE, Head, read_head, write_head


def test_a_head_written_reads_back(tmp_path: Path) -> None:
    write_head(tmp_path, Head("ab" * 16, "main-from-3", 9, 1700000000.5))
    assert read_head(tmp_path) == Head("ab" * 16, "main-from-3", 9, 1700000000.5)
    assert [p.name for p in tmp_path.iterdir()] == [HEAD_FILE]  # no temp file left


@pytest.mark.parametrize(
    "text",
    [
        b"not json",
        b"[]",
        json.dumps({"tailorstore_head": 2, "run": "main", "step": 1, "created_at": 1}).encode(),
        json.dumps({"tailorstore_head": 1, "run": "../etc", "step": 1, "created_at": 1}).encode(),
        json.dumps({"tailorstore_head": 1, "run": "main", "step": -1, "created_at": 1}).encode(),
        json.dumps({"tailorstore_head": 1, "run": "main", "step": True, "created_at": 1}).encode(),
        b'{"tailorstore_head": 1, "run": "main", "step": 1, "created_at": NaN}',
        json.dumps({"tailorstore_head": 1, "run": "main", "step": 1, "created_at": 1, "store": 7}).encode(),
        b"[" * 100_000,
        b" " * 5000,
    ],
)
def test_a_bad_head_is_ignored_with_a_warning(text: bytes, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / HEAD_FILE).write_bytes(text)
    with caplog.at_level(logging.WARNING, logger="tailorstore"):
        assert read_head(tmp_path) is None
    assert "ignoring" in caplog.text


def test_no_head_and_a_head_that_is_a_folder(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    assert read_head(tmp_path) is None
    assert read_head(tmp_path / "missing") is None
    (tmp_path / HEAD_FILE).mkdir()
    with caplog.at_level(logging.WARNING, logger="tailorstore"):
        assert read_head(tmp_path) is None


def test_a_link_planted_at_the_temp_name_is_never_written_through(tmp_path: Path) -> None:
    """High 9: the head's temp file had a predictable name (.tailorstore-head.json.PID.tmp) and was
    written with Path.write_text, which follows a link: whoever could create entries in a shared save
    folder made the training overwrite any file it could write. Now the temp file is created
    exclusively, without following links, under a name nobody can guess."""
    import os

    victim = tmp_path / "victim"
    victim.write_text("must stay")
    save = tmp_path / "save"
    save.mkdir()
    planted = save / f".{HEAD_FILE}.{os.getpid()}.tmp"
    planted.symlink_to(victim)
    (save / HEAD_FILE).symlink_to(victim)  # the head's own name a link too: replaced, not written through
    write_head(save, Head(None, "main", 4, 1700000000.0))
    assert victim.read_text() == "must stay"
    assert read_head(save) == Head(None, "main", 4, 1700000000.0)
    assert not (save / HEAD_FILE).is_symlink()
    assert planted.is_symlink()  # left where it was, never opened
    assert sorted(p.name for p in save.iterdir()) == sorted([HEAD_FILE, planted.name])


def test_a_fifo_for_a_head_is_refused_at_once(tmp_path: Path) -> None:
    """Medium 1: a FIFO under the head's name blocked read_head for good (a resume hung while the
    other ranks waited out the collective timeout). It is refused with one warning, as no head. Run
    in a child process so that the old code's hang ends at the child's limit instead of the suite's."""
    import os
    import subprocess
    import sys

    os.mkfifo(tmp_path / HEAD_FILE)
    script = (
        "import logging, sys; from pathlib import Path; logging.basicConfig(level=logging.WARNING);"
        "from tailorstore.integrations.deepspeed.head import read_head;"
        f"sys.exit(0 if read_head(Path({str(tmp_path)!r})) is None else 1)"
    )
    try:
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail("read_head waited on the FIFO")
    assert done.returncode == 0, done.stderr
    warnings = [line for line in done.stderr.splitlines() if "tailorstore" in line]
    assert len(warnings) == 1 and "named pipe" in warnings[0], done.stderr


def test_a_link_for_a_head_is_not_followed(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A head is ours to write; a link under its name (to a head elsewhere, or to /dev/zero) is not read."""
    other = tmp_path / "other"
    other.mkdir()
    write_head(other, Head(None, "main", 4, 1700000000.0))
    save = tmp_path / "save"
    save.mkdir()
    (save / HEAD_FILE).symlink_to(other / HEAD_FILE)
    with caplog.at_level(logging.WARNING, logger="tailorstore"):
        assert read_head(save) is None
    assert "symbolic link" in caplog.text
