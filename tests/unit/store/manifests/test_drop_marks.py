"""gc's drop marks against ref changes (store/manifests/drop_marks.py): a ref counts for the step it
names, so a tag or pin left on an older listed version of a step claims the step's current version
from a gc, and a ref written on an older version sees the marks of the newer. A real POSIX backend."""

from __future__ import annotations

from pathlib import Path

from tailorstore.store.backends.location import resolve
from tailorstore.store.manifests.drop_marks import being_dropped, claimed, drop_marker, mark_dropping
from tailorstore.store.manifests.keys import pin_key
from tailorstore.store.manifests.refs import put_pin, put_tag

V1 = "manifests/main/step-00000000000000000006-v1.json.zst"
V2 = "manifests/main/step-00000000000000000006-v2.json.zst"
OTHER = "manifests/main/step-00000000000000000009-v1.json.zst"


def test_a_ref_on_an_older_version_claims_the_steps_current_version(tmp_path: Path) -> None:
    backend = resolve(str(tmp_path / "store")).backend
    for key in (V1, V2, OTHER):
        backend.put(key, b"a manifest")
    assert claimed(backend, [V2, OTHER]) == []
    put_tag(backend, "t", V1)  # left on the version a revision replaced: it counts for v2
    assert claimed(backend, [V2, OTHER]) == [V2]
    backend.put("refs/tags/t", b"dropped\n")
    put_pin(backend, OTHER)
    assert claimed(backend, [V2, OTHER]) == [OTHER]
    backend.delete(pin_key(OTHER))
    put_pin(backend, V1)
    assert claimed(backend, [V2, OTHER]) == [V2]
    backend.delete(V1)  # gone: a ref naming it names nothing, and claims nothing
    assert claimed(backend, [V2, OTHER]) == []


def test_a_ref_written_on_an_older_version_sees_the_newer_versions_marks(tmp_path: Path) -> None:
    backend = resolve(str(tmp_path / "store")).backend
    for key in (V1, V2):
        backend.put(key, b"a manifest")
    assert not being_dropped(backend, V1)
    assert mark_dropping(backend, [V2]) == [drop_marker(V2)]
    assert being_dropped(backend, V1) and being_dropped(backend, V2)


def test_a_ref_on_a_version_claims_that_version_from_its_retirement(tmp_path: Path) -> None:
    """A revision under the shared lock leaves the step's refs on the version it replaces and then
    retires that version unless a ref names it: the ref must claim the version it names, not only
    the current one (mapped only to the current version, the retirement deleted v1 with its pin and
    left the tag naming nothing: the step lost both, and gc dropped it)."""
    backend = resolve(str(tmp_path / "store")).backend
    for key in (V1, V2):
        backend.put(key, b"a manifest")
    put_tag(backend, "keep", V1)
    assert claimed(backend, [V1]) == [V1] and claimed(backend, [V2]) == [V2]
    backend.put("refs/tags/keep", b"dropped\n")
    put_pin(backend, V1)
    assert claimed(backend, [V1]) == [V1] and claimed(backend, [V2]) == [V2]


def test_a_tag_naming_a_removed_version_holds_no_step_but_one_naming_a_superseded_one_does(tmp_path: Path) -> None:
    """A plain tag refuses a tag that names another step still stored. A tag left naming a version
    ``rm`` removed names nothing, though the step was committed again since (it once refused the
    tag as "set on another step meanwhile"); one naming a version gc superseded still holds."""
    import pytest

    from tailorstore.core.errors import StepExistsError
    from tailorstore.store.manifests.keys import SUPERSEDED, removed_marker

    backend = resolve(str(tmp_path / "store")).backend
    for key in (V1, OTHER):
        backend.put(key, b"a manifest")
    put_tag(backend, "x", V1)
    backend.delete(V1)
    backend.put(str(removed_marker(V1)), b"")  # as rm leaves it
    backend.put(V2, b"committed again")
    put_tag(backend, "x", OTHER, force=False)  # free: v1 was removed
    put_tag(backend, "y", V1)
    backend.put(str(removed_marker(V1)), SUPERSEDED)  # as gc leaves a version a newer one replaced
    with pytest.raises(StepExistsError, match="another step"):
        put_tag(backend, "y", OTHER, force=False)
