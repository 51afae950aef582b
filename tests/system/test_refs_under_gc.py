"""I2 (docs/FORMAT.md section 8): a tag or pin reported set keeps its step through every gc. Attack
finding 6: ``tailor pin`` and ``tailor tag`` succeeded while a gc that had already planned to drop the
step waited before its deletes, and gc then dropped the step. A ref change now takes the store lock
shared, so it waits for gc (and then finds the step gone), or lands before gc plans."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.system.test_hosts import host_env, resume, run, start, steps_seen_by_a_new_host, wait_stopped


@pytest.mark.parametrize("where", ["posix", "s3"])
@pytest.mark.parametrize("change", [("pin", "step=3"), ("tag", "step=3", "keep")])
def test_a_ref_set_while_gc_waits_to_delete_never_outlives_its_step(
    where: str, change: tuple[str, ...], request: pytest.FixtureRequest, saves: tuple[Path, Path], tmp_path: Path
) -> None:
    location = request.getfixturevalue("s3_location") if where == "s3" else str(tmp_path / "store")
    at3, at6 = saves
    a = host_env(tmp_path / "host-a", TAILOR_LOCK_TTL="120")
    b = host_env(tmp_path / "host-b", TAILOR_LOCK_TTL="120")
    assert run(a, "init", location).returncode == 0
    for save in (at3, at6):
        assert run(a, "commit", str(save), "--store", location).returncode == 0

    gc = start({**a, "TAILOR_FAILPOINTS": "gc-before-delete=stop@1"}, "gc", "--keep-last", "1", "--store", location)
    wait_stopped(gc)  # gc has planned to drop step 3
    ref = start(b, *change, "--lock-timeout", "60", "--store", location)
    time.sleep(1.5)
    assert ref.poll() is None, ref.communicate()  # waits for gc: reporting success now would be a lie
    collected = resume(gc)
    assert collected.returncode == 0, collected.stderr
    out, err = ref.communicate(timeout=120)
    steps = steps_seen_by_a_new_host(location, tmp_path / "host-c")
    assert steps == [6]
    # reported failed, as step 3 is gone
    assert ref.returncode == 2 and "step 3 is not in the store" in err, (ref.returncode, out, err)


@pytest.mark.parametrize("where", ["posix", "s3"])
def test_each_side_writes_then_reads_the_other_so_one_backs_off(
    where: str, request: pytest.FixtureRequest, saves: tuple[Path, Path], tmp_path: Path
) -> None:
    """FORMAT 8.1, the rule that holds whatever either host's stalls: gc marks a step it drops, then
    reads its refs; a pin or tag writes its object, then reads the marker. Played here request by
    request, in the two orders that matter, through the real store objects and the real CLI."""
    from tailorstore import Store
    from tailorstore.store.manifests import drop_marks, keys, refs

    location = request.getfixturevalue("s3_location") if where == "s3" else str(tmp_path / "store")
    at3, at6 = saves
    a = host_env(tmp_path / "host-a")
    assert run(a, "init", location).returncode == 0
    for save in (at3, at6):
        assert run(a, "commit", str(save), "--store", location).returncode == 0
    assert run(a, "tag", "step=6", "best", "--store", location).returncode == 0
    with Store.open(location) as store:
        backend = store.repo.backend
        key3 = store.repo.manifest(store.repo.resolve("step=3")).object_key
        key6 = store.repo.manifest(store.repo.resolve("step=6")).object_key
        assert key3 and key6
        # 1. a ref written first: gc's read after its marker finds it, takes its marker back, drops nothing
        assert run(a, "pin", "step=3", "--store", location).returncode == 0
        assert drop_marks.mark_unless_claimed(backend, [key3]) == ([key3], [])
        assert not backend.exists(drop_marks.drop_marker(key3))
        assert run(a, "unpin", "step=3", "--store", location).returncode == 0
        # 2. gc's marker first: the ref's read after its write finds it, and the ref backs off
        assert drop_marks.mark_unless_claimed(backend, [key3]) == ([], [drop_marks.drop_marker(key3)])
        tag_before = backend.get(keys.tag_key("best"))
    pinned = run(a, "pin", "step=3", "--store", location)
    assert pinned.returncode == 4 and "being dropped by a gc" in pinned.stderr, pinned.stderr
    assert len(pinned.stderr.strip().splitlines()) == 1 and "Traceback" not in pinned.stderr
    moved = run(a, "tag", "step=3", "best", "--force", "--store", location)
    assert moved.returncode == 4 and "being dropped by a gc" in moved.stderr, moved.stderr
    with Store.open(location) as store:
        backend = store.repo.backend
        assert not refs.pin_live(backend, keys.pin_key(key3))  # the pin it wrote was taken back: a tombstone
        assert backend.get(keys.tag_key("best")) == tag_before  # the tag names step 6, as before
        assert drop_marks.claimed(backend, [key3, key6]) == [key6]
        # a drop stopped by its fence before its delete takes its own marker back: step 3 is pinnable again
        drop_marks.take_back_marks(backend, [key3], [drop_marks.drop_marker(key3)])
    assert run(a, "pin", "step=3", "--store", location).returncode == 0
