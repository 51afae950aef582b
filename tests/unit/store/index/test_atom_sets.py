"""Atoms as format 8 keeps them: a layout's rows once, each manifest's blobs beside them.

Two steps of a run with one layout (their files named by their own step folders) share its rows;
a step with another layout (one atom more, another offset) records its own; a layout goes with
the last manifest that has it; the rows read back are the rows written, blobs included; and the
writer refuses what format 7's table refused (two atoms at one place, an atom of no file).
"""

from __future__ import annotations

import json
import sqlite3
from dataclasses import replace
from pathlib import Path

import pytest
import xxhash

from tailorstore.core.errors import CorruptStoreError
from tailorstore.core.records import AtomRecord, BlobRecord, FileRecord, ManifestRecord
from tailorstore.store.index._index import Index
from tailorstore.store.index.atom_sets import SEGMENT

RAW = '{"id": "raw", "v": 1}'


def _hash(n: int) -> str:
    return f"{n:032x}"


def _step(index: Index, step: int, atoms_a_file: int = 300, files: int = 2, shift: int = 0) -> int:
    """A manifest of ``files`` files under ``step-N/``, each with ``atoms_a_file`` atoms whose
    blobs are new for this step (as a training step's are)."""
    blobs = [
        BlobRecord(_hash(step * 1_000_000 + i), 16, 16, RAW, None, None, 0.0)
        for i in range(files * atoms_a_file + files)
    ]
    index.add_blobs(blobs)
    manifest = index.insert_manifest(
        ManifestRecord(step, "commit", 0.0, "dcp", None, None, 2, "{}", True, 0, 0, "x", object_key=f"k{step}")
    )
    paths = [f"step-{step}/__{r}_0.distcp" for r in range(files)]
    index.insert_files(
        manifest,
        [FileRecord(p, p, "dcp", r, blobs[-1 - r].hash, 9, 0o644, False, None) for r, p in enumerate(paths)],
    )
    atoms = [
        AtomRecord(
            p,
            slot,
            0,
            4,
            "float32",
            "[1, 4]",
            f"w{slot}",
            "master",
            r,
            0,
            16,
            "block.0",
            blobs[r * atoms_a_file + slot].hash,
            None,
            16 * slot + shift,
        )
        for r, p in enumerate(paths)
        for slot in range(atoms_a_file)
    ]
    index.insert_atoms(manifest, reversed(atoms))  # any order in, (path, slot, offset) order out
    return manifest


def _count(index: Index, table: str) -> int:
    return index.conn.execute(f"SELECT count(*) FROM {table}").fetchone()[0]


@pytest.fixture
def index(tmp_path: Path) -> Index:
    index = Index.create(tmp_path / "index.sqlite")
    yield index
    index.close()


def test_steps_with_one_layout_share_its_rows_and_keep_their_own_blobs(index: Index) -> None:
    with index.transaction():
        first, second = _step(index, 1), _step(index, 2)
    assert _count(index, "atom_layouts") == 1
    assert _count(index, "layout_atoms") == 600  # once, not once a step
    for manifest, step in ((first, 1), (second, 2)):
        atoms = index.atoms(manifest)
        assert [a.path for a in atoms[:2]] == [f"step-{step}/__0_0.distcp"] * 2
        assert [a.slot for a in atoms[:3]] == [0, 1, 2]
        assert [a.blob for a in atoms] == [_hash(step * 1_000_000 + i) for i in range(600)]
        assert {a.file_key for a in atoms} == {f"step-{step}/__0_0.distcp", f"step-{step}/__1_0.distcp"}
        # the view of format 7's table reads the same rows
        through_view = index.conn.execute(
            "SELECT blob FROM atoms WHERE manifest=? ORDER BY path, slot, offset", (manifest,)
        ).fetchall()
        assert [r[0] for r in through_view] == [a.blob for a in atoms]
    assert _count(index, "atom_blobs") == 2 * -(-600 // SEGMENT)
    assert index.atoms(second, path="step-2/__1_0.distcp", kind="master")[0].blob == _hash(2_000_300)


def test_a_step_with_another_layout_records_its_own_and_the_last_user_takes_it_along(index: Index) -> None:
    with index.transaction():
        first = _step(index, 1)
        other = _step(index, 2, shift=1)  # every piece one byte further into its file
        bigger = _step(index, 3, atoms_a_file=301)
        same = _step(index, 4)
    assert _count(index, "atom_layouts") == 3
    with index.transaction():
        index.delete_manifests([first])
    assert _count(index, "atom_layouts") == 3, "step 4 still has step 1's layout"
    with index.transaction():
        index.delete_manifests([same, other])
    assert _count(index, "atom_layouts") == 1
    assert _count(index, "layout_atoms") == 602
    with index.transaction():
        index.replace_contents(bigger, index.files(bigger), index.atoms(bigger)[:10])  # thinned: a subset
    assert _count(index, "atom_layouts") == 1 and _count(index, "layout_atoms") == 10
    assert [a.slot for a in index.atoms(bigger)] == list(range(10))


def test_the_writer_refuses_what_format_7s_table_refused(index: Index) -> None:
    with index.transaction():
        manifest = _step(index, 1, atoms_a_file=3)
    atoms = index.atoms(manifest)
    with pytest.raises(CorruptStoreError, match="UNIQUE"), index.transaction():
        index.replace_contents(manifest, index.files(manifest), [*atoms, replace(atoms[0], blob=_hash(7))])
    with pytest.raises(CorruptStoreError, match="FOREIGN KEY"), index.transaction():
        index.replace_contents(manifest, index.files(manifest), [replace(atoms[0], path="elsewhere")])
    assert index.atoms(manifest) == atoms  # each refusal left the rows as they were


def test_files_added_after_atoms_keep_each_atom_on_its_own_file(index: Index) -> None:
    """A layout names files by their place in path order: a file added in front of the others
    moves them, and the atoms are set again over the new numbers."""
    with index.transaction():
        manifest = _step(index, 1, atoms_a_file=2)
        before = index.atoms(manifest)
        index.add_blobs([BlobRecord(_hash(99), 1, 1, RAW, None, None, 0.0)])
        index.insert_files(manifest, [FileRecord("a-first", "a-first", "raw", None, _hash(99), 1, 0o644, False, None)])
    assert index.atoms(manifest) == before
    ordinals = dict(index.conn.execute("SELECT path, ordinal FROM files WHERE manifest=?", (manifest,)).fetchall())
    assert ordinals == {"a-first": 0, "step-1/__0_0.distcp": 1, "step-1/__1_0.distcp": 2}


def test_a_layouts_name_is_the_digest_of_its_rows(index: Index) -> None:
    """FORMAT.md section 3: another implementation computes the same digest from the same rows."""
    with index.transaction():
        manifest = _step(index, 1, atoms_a_file=2, files=1)
    rows = [
        [0, slot, 0, 4, "float32", "[1, 4]", f"w{slot}", "master", 0, 0, 16, "block.0", None, 16 * slot]
        for slot in range(2)
    ]
    expected = xxhash.xxh3_128_hexdigest(json.dumps(rows, separators=(",", ":")).encode())
    layout = index.conn.execute("SELECT layout FROM atom_sets WHERE manifest=?", (manifest,)).fetchone()[0]
    assert index.conn.execute("SELECT digest FROM atom_layouts WHERE id=?", (layout,)).fetchone()[0] == expected
    assert isinstance(index.conn, sqlite3.Connection)
