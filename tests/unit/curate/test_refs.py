"""Tags as names (curate/refs.py): a step holds any number of tags, a tag names one step, and
every ref change writes exactly one object (docs/FORMAT.md 3.3 and 8.1, I3)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tailorstore.core.errors import StoreError
from tailorstore.core.failpoints import REQUEST_KINDS, requests_made
from tailorstore.curate.refs import RefEdits, pin, remove, tag, untag
from tailorstore.ingest.commit import commit_checkpoint
from tailorstore.ingest.commit_options import CommitOptions
from tailorstore.store.manifests.refs import TOMBSTONE
from tailorstore.store.repo import Repository

WRITES = tuple(kind for kind in REQUEST_KINDS if kind.startswith(("put", "delete")))


def _step(repo: Repository, tmp_path: Path, step: int, tag_name: str | None = None) -> None:
    folder = tmp_path / f"save-{step}"
    folder.mkdir()
    torch.save({"w": torch.full((4,), float(step))}, folder / "model.pt")
    commit_checkpoint(repo, folder, CommitOptions(step=step, tag=tag_name))


def _writes(operation: str, before: dict[str, int]) -> int:
    now = requests_made()
    return sum(now.get(f"{operation}/{kind}", 0) - before.get(f"{operation}/{kind}", 0) for kind in WRITES)


def _tags(repo: Repository) -> dict[int, tuple[str, ...]]:
    repo.refresh()
    return {m.step: m.tags for m in repo.view(RefEdits).manifests()}


def test_a_second_tag_on_a_step_is_one_object_and_leaves_the_first(repo: Repository, tmp_path: Path) -> None:
    """A retag was two objects (the new tag's put, then the former tag's drop): stopped between them
    past its lease it failed with the put in effect, and a gc meanwhile could drop a step a moved tag
    had left (FORMAT.md 8.1, format 6). Now the step keeps ``w`` and gains ``x`` by one put."""
    _step(repo, tmp_path, 1, "w")
    _step(repo, tmp_path, 2)
    before = requests_made()
    tag(repo, "step=1", "x")
    assert _writes("tag", before) == 1
    assert _tags(repo) == {1: ("w", "x"), 2: ()}
    assert repo.backend.get("refs/tags/w") == repo.backend.get("refs/tags/x")

    before = requests_made()
    tag(repo, "step=2", "w", force=True)  # a move: the one object overwritten; step 1 keeps x
    assert _writes("tag", before) == 1
    assert _tags(repo) == {1: ("x",), 2: ("w",)}

    before = requests_made()
    untag(repo, "x")  # one conditional replace: a tombstone
    assert _writes("untag", before) == 1
    assert repo.backend.get("refs/tags/x") == TOMBSTONE
    assert _tags(repo) == {1: (), 2: ("w",)}


def test_a_tag_names_one_step_and_a_step_holds_many(repo: Repository, tmp_path: Path) -> None:
    _step(repo, tmp_path, 1, "a")
    _step(repo, tmp_path, 2)
    for name in ("b", "c"):
        tag(repo, "step=1", name)
    tag(repo, "step=1", "b")  # again on its own step: nothing changes
    with pytest.raises(StoreError, match="already names another manifest"):
        tag(repo, "step=2", "a")
    assert _tags(repo) == {1: ("a", "b", "c"), 2: ()}
    assert repo.resolve("tag=c") == repo.resolve("step=1")
    with pytest.raises(StoreError, match=r"tagged 'a', 'b', 'c'"):
        remove(repo, "step=1")
    before = requests_made()
    remove(repo, "step=1", force=True)  # every tag of the step goes with it
    assert all(repo.backend.get(f"refs/tags/{name}") == TOMBSTONE for name in "abc")
    assert _writes("rm", before) >= 3
    assert _tags(repo) == {2: ()}


def test_a_fresh_index_reads_every_tag_of_a_step_from_the_ref_objects(repo: Repository, tmp_path: Path) -> None:
    """The ref objects are the truth: an index rebuilt from them has every tag of every step (one of
    two tags naming one step was invisible when a step held one)."""
    _step(repo, tmp_path, 1, "a")
    tag(repo, "step=1", "b")
    _step(repo, tmp_path, 2, "c")
    root = Path(repo.location)
    repo.close()
    for f in root.glob("index.sqlite*"):
        f.unlink()
    Repository.rebuild_index(root)
    with Repository.open(root) as again:
        assert _tags(again) == {1: ("a", "b"), 2: ("c",)}


def test_pinning_a_pinned_step_writes_nothing(repo: Repository, tmp_path: Path) -> None:
    """A second ``pin`` put the pin object again: landing after an ``rm`` beside it had deleted the
    step's pins, it left a pin naming a removed step, which a plain-form pin's reading rule gives to
    a branch's step of that name (an attack round's finding). It writes nothing now."""
    _step(repo, tmp_path, 1)
    before = requests_made()
    pin(repo, "step=1")
    assert _writes("pin", before) == 1
    before = requests_made()
    pin(repo, "step=1")
    assert _writes("pin", before) == 0
    repo.refresh()
    assert repo.manifest(repo.resolve("step=1")).pinned
