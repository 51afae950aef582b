"""A store written in format 1 (no containers) is upgraded on open and still checks out exactly."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from conftest import Runs, as_of_step

from tailorstore.checkout import checkout_step
from tailorstore.commit import commit_checkpoint
from tailorstore.safe_load import load_torch_file
from tailorstore.store.repo import Store
from tailorstore.store.schema import FORMAT_VERSION, SCHEMA
from tailorstore.testing.compare import differences
from tailorstore.verify import verify

NEW_IN_2 = ("container TEXT", "file_offset INTEGER")


def rewrite_as_format_1(root: Path) -> None:
    """The same manifests and blobs under the format-1 schema, as tailorstore 0.1 wrote them."""
    v1_schema = "\n".join(line for line in SCHEMA.splitlines() if not line.strip().startswith(NEW_IN_2))
    old = root / "index.v1.sqlite"
    conn = sqlite3.connect(old)
    conn.executescript(v1_schema)
    conn.execute("ATTACH DATABASE ? AS cur", (str(root / "index.sqlite"),))
    conn.execute("INSERT INTO meta SELECT key, CASE key WHEN 'format_version' THEN '1' ELSE value END FROM cur.meta")
    for table in ("blobs", "manifests", "files", "atoms", "layers"):
        columns = [r[1] for r in conn.execute(f"PRAGMA main.table_info({table})")]
        names = ", ".join(columns)
        conn.execute(f"INSERT INTO main.{table} ({names}) SELECT {names} FROM cur.{table}")
    conn.commit()
    conn.close()
    for suffix in ("", "-wal", "-shm"):
        (root / f"index.sqlite{suffix}").unlink(missing_ok=True)
    old.rename(root / "index.sqlite")


def test_format_1_store_is_upgraded_and_checks_out(runs: Runs, tmp_path: Path) -> None:
    run = runs.get("zero2-bf16")
    at6 = as_of_step(run.save_dir, 6, tmp_path / "at6")
    with Store.init(tmp_path / "store") as store:
        commit_checkpoint(store, at6)
    rewrite_as_format_1(tmp_path / "store")
    probe = sqlite3.connect(tmp_path / "store" / "index.sqlite")
    assert probe.execute("SELECT value FROM meta WHERE key='format_version'").fetchone()[0] == "1"
    assert "container" not in [r[1] for r in probe.execute("PRAGMA table_info(files)")]
    probe.close()

    with Store.open(tmp_path / "store") as store:  # upgrades
        version = store.conn.execute("SELECT value FROM meta WHERE key='format_version'").fetchone()[0]
        assert int(version) == FORMAT_VERSION == 2
        assert store.conn.execute("SELECT count(*) FROM files WHERE container IS NOT NULL").fetchone()[0] == 0
        assert store.conn.execute("SELECT count(*) FROM atoms WHERE file_offset IS NOT NULL").fetchone()[0] == 0
        assert verify(store, deep=True).ok
        out = tmp_path / "out"
        checkout_step(store, "step=6", out)  # through the skeletons, as format 1 did
    for original in sorted((at6 / "global_step6").iterdir()):
        restored = out / "global_step6" / original.name
        assert not differences(load_torch_file(original)[0], load_torch_file(restored)[0]), original.name
    with Store.open(tmp_path / "store") as store:  # a second open finds nothing to do
        assert int(store.conn.execute("SELECT value FROM meta WHERE key='format_version'").fetchone()[0]) == 2
