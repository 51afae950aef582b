"""A training's head file (integrations/head.py) is input from outside: anything but a well-formed
head is ignored with a warning, as if the job had none."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from tailorstore.integrations.head import HEAD_FILE, Head, read_head, write_head


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
