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
from tailorstore.store.manifests.refs import PIN_TOMBSTONE, TOMBSTONE, named
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
    assert named(repo.backend.get("refs/tags/w")) == named(repo.backend.get("refs/tags/x"))
    assert repo.backend.get("refs/tags/w") != repo.backend.get("refs/tags/x"), "each write's own token"

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


def test_a_pin_is_a_write_of_its_own_and_a_failed_one_takes_back_only_itself(repo: Repository, tmp_path: Path) -> None:
    """Two pins of one step: each is its own write (a token), so the second pinner's take-back (its
    change failed) restores the first pinner's pin instead of deleting the pin the first reported
    set; where nothing was pinned before, a take-back leaves a tombstone, which pins nothing."""
    from tailorstore.store.manifests.keys import pin_key
    from tailorstore.store.manifests.refs import pin_live, put_pin

    _step(repo, tmp_path, 1)
    key = repo.manifest(repo.resolve("step=1")).object_key
    assert key is not None
    before = requests_made()
    pin(repo, "step=1")
    assert _writes("pin", before) == 1
    first = repo.backend.get(pin_key(key))
    second = put_pin(repo.backend, key)  # another pinner of the pinned step
    assert repo.backend.get(pin_key(key)) != first
    second.take_back(repo.backend)  # that pinner failed (a gc's mark): the first pin is back
    assert repo.backend.get(pin_key(key)) == first and pin_live(repo.backend, pin_key(key))
    untagged = _step(repo, tmp_path, 2) or repo.manifest(repo.resolve("step=2")).object_key
    assert untagged is not None
    lone = put_pin(repo.backend, untagged)
    lone.take_back(repo.backend)
    assert repo.backend.get(pin_key(untagged)) == PIN_TOMBSTONE and not pin_live(repo.backend, pin_key(untagged))
    repo.refresh()
    assert repo.manifest(repo.resolve("step=1")).pinned and not repo.manifest(repo.resolve("step=2")).pinned
