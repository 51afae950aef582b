"""I2 (docs/FORMAT.md section 8): a tag or pin reported set keeps its step through every gc. Attack
finding 6: ``tailor pin`` and ``tailor tag`` succeeded while a gc that had already planned to drop the
step waited before its deletes, and gc then dropped the step. A ref change now takes the store lock
shared, so it waits for gc (and then finds the step gone), or lands before gc plans."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from test_hosts import host_env, resume, run, start, steps_seen_by_a_new_host, wait_stopped


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
