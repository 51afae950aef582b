"""Every operation that records a manifest goes through store/publish.py: when the index's COMMIT
fails after the manifest object went up, the object is taken back, so the step (or merge) that
was reported as failed does not reappear when the next open syncs objects into the index.

The failure is SQLite's own: the test adds a deferred foreign key to the real index (a trap
table and a trigger on new manifests), which SQLite checks at COMMIT, after the publish.
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest

from tailorstore.store.index.catalogue import Catalogue
from tests.conftest import TEST_DATA, copy_tree, tailor

CHECKPOINT = TEST_DATA / "format1" / "checkpoint"
TRAP = (
    "CREATE TABLE trap (manifest INTEGER REFERENCES manifests(id) DEFERRABLE INITIALLY DEFERRED)",
    "CREATE TRIGGER trap_new_manifests AFTER INSERT ON manifests BEGIN INSERT INTO trap VALUES (-1); END",
)


def set_trap(store: Path, armed: bool) -> None:
    conn = sqlite3.connect(store / "index.sqlite")
    try:
        for statement in TRAP if armed else ("DROP TRIGGER trap_new_manifests", "DROP TABLE trap"):
            conn.execute(statement)
        conn.commit()
    finally:
        conn.close()


def manifest_objects(store: Path) -> list[str]:
    return sorted(str(p.relative_to(store)) for p in (store / "manifests").rglob("*.json.zst") if p.is_file())


@pytest.mark.slow  # seconds: the fast tier keeps its minute
@pytest.mark.parametrize("operation", ["commit", "finalize", "merge", "average"])
def test_a_failed_index_commit_after_the_publish_leaves_nothing_behind(
    small_store: Path, tmp_path: Path, operation: str
) -> None:
    store = copy_tree(small_store, tmp_path / "store")
    assert tailor("commit", str(CHECKPOINT), "--step", "6", store=store).returncode == 0
    spec = tmp_path / "spec.yaml"
    if operation == "finalize":
        assert tailor("commit", str(CHECKPOINT / "global_step3"), "--part", "--step", "9", store=store).returncode == 0
        args: tuple[str, ...] = ("commit", "--finalize", "step=9")
    elif operation == "commit":
        args = ("commit", str(CHECKPOINT), "--step", "9")
    elif operation == "merge":
        spec.write_text("base: {step: 6}\nslices:\n  - sources: [{step: 3, layer_range: [0, 1]}]\n")
        args = ("merge", str(spec), "--tag", "mix")
    else:
        spec.write_text("method: sma\nsteps: [3, 6]\n")
        args = ("merge", str(spec), "--tag", "avg")
    before = manifest_objects(store)
    set_trap(store, True)
    failed = tailor(*args, store=store)
    assert failed.returncode == 3 and "FOREIGN KEY constraint failed" in failed.stderr, failed.stderr
    assert "Traceback" not in failed.stderr
    set_trap(store, False)
    assert manifest_objects(store) == before, "the manifest object was taken back"
    log = tailor("log", "--json", store=store)  # the next open syncs objects into the index
    assert log.returncode == 0 and [(s["step"], s["tag"]) for s in json.loads(log.stdout)] == [(3, None), (6, None)]
    done = tailor(*args, store=store)  # and the operation then succeeds as if it never ran
    assert done.returncode == 0, done.stderr
    assert len(manifest_objects(store)) == len(before) + 1
    assert tailor("verify", store=store).returncode == 0


def test_rows_read_from_a_step_replaced_meanwhile_are_refused_whole(small_store: Path, tmp_path: Path) -> None:
    """record_manifest takes a manifest's rows as a value, built before its transaction opens, so
    it checks that the manifests they were read from are still the versions read: a merge built
    from step 6 while another process replaced step 6 (``--force``) would record layers and atoms
    of a manifest that is gone. It is refused as the race it is (exit 4, run it again), and nothing
    is recorded or published; the same rows record once nothing changed under them."""
    from dataclasses import replace

    from tailorstore import Store
    from tailorstore.core.errors import StepChangedError
    from tailorstore.core.records import MERGE
    from tailorstore.curate.merge_spec import merge_record
    from tailorstore.store.publish import ManifestRows, record_manifest

    store = copy_tree(small_store, tmp_path / "store")
    assert tailor("commit", str(CHECKPOINT), "--step", "6", store=store).returncode == 0

    def rows_from_step_6(handle: Store) -> ManifestRows:
        repo = handle.repo
        base = repo.manifest(repo.resolve("step=6"))
        files, atoms, layers = (
            repo.view(Catalogue).files(base.id),
            repo.view(Catalogue).atoms(base.id),
            repo.view(Catalogue).layers(base.id),
        )
        record = merge_record(base, "copy", {"name": "merge", "spec": {}}, tmp_path / "spec.yaml")
        layers = [replace(x, stored=False, change=None) for x in layers]
        return ManifestRows(record, files, atoms, layers, derived_from=[base])

    with Store.open(store) as handle:
        rows = rows_from_step_6(handle)
        assert tailor("commit", str(CHECKPOINT), "--step", "6", "--force", store=store).returncode == 0
        before = manifest_objects(store)
        with pytest.raises(StepChangedError, match="step 6 was removed or replaced"):
            record_manifest(handle.repo, rows, fence=None)
        assert manifest_objects(store) == before
        assert handle.repo.view(Catalogue).tagged("copy") is None
        [merged] = record_manifest(handle.repo, rows_from_step_6(handle), fence=None)
        assert handle.repo.manifest(merged).origin == MERGE and handle.repo.view(Catalogue).tagged("copy").id == merged


def test_force_takes_a_tag_another_step_holds(small_store: Path, tmp_path: Path) -> None:
    """``commit --force --tag T`` moves T from the step that holds it, whether or not the step
    committed existed before (the publisher's rule; it once moved it only when replacing a step)."""
    from tests.conftest import tailor_here

    store = copy_tree(small_store, tmp_path / "store")
    assert tailor_here("tag", "step=3", "best", store=store).returncode == 0
    refused = tailor_here("commit", str(CHECKPOINT), "--step", "6", "--tag", "best", store=store)
    assert refused.returncode == 2 and "tag 'best' already names" in refused.stderr, refused.stderr
    done = tailor_here("commit", str(CHECKPOINT), "--step", "6", "--tag", "best", "--force", store=store)
    assert done.returncode == 0, done.stderr
    rows = {row["step"]: row["tag"] for row in json.loads(tailor_here("log", "--json", store=store).stdout)}
    assert rows == {3: None, 6: "best"}
