"""Ref changes racing gc, revisions and each other across hosts, each a stall or kill that once broke
FORMAT.md 8.1 (I2, I3): a ref follows its step to its newest version, a take-back asks before it
deletes, no ref is deleted by name, follow-ups after a lapse run under a lease, a version taken back
stays reserved. Real ``tailor`` processes with their own caches on moto, as tests/system/test_hosts.py
does (its helpers); on SeaweedFS too with ``TAILOR_TEST_S3=both`` (left off CI's both-server list for
the suite's time: docs/benchmarks.md).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tailorstore.store.backends.location import resolve
from tests.system.test_hosts import (
    TTL,
    _a_save,
    _steps,
    _three_plain_steps,
    host_env,
    resume,
    run,
    start,
    wait_stopped,
)

# -- a ref change follows its step, a take-back asks first, and no ref is deleted by name ---------------


@pytest.mark.slow
@pytest.mark.parametrize("what", ["tag", "pin"])
def test_a_ref_written_on_a_version_gc_superseded_meanwhile_follows_the_step(
    s3_location: str, tmp_path: Path, what: str
) -> None:
    """Host a tags (or pins) step 1 and stalls between its put and its read of the drop marks, past
    its lease; step 1 is replaced (``--force``) and a gc supersedes the old version, carrying its
    refs and deleting it. Either a's change took (the ref on step 1) or it failed and the step is as
    it was; never a change reported failed that stays, or a ref lost with the old version. (A
    carry gave the tag a token of its own, so a's take-back did not know it, and the tag stayed
    moved while a said nothing was changed; gc then dropped the step the tag had named.)"""
    plain = host_env(tmp_path / "host-c", TAILOR_LOCK_TTL="3600")
    _three_plain_steps(tmp_path, plain, s3_location)
    assert run(plain, "tag", "step=2", "X", "--store", s3_location).returncode == 0
    change = ("tag", "step=1", "X", "--force") if what == "tag" else ("pin", "step=1")
    a = start(host_env(tmp_path / "host-a", TAILOR_FAILPOINTS="ref-written=stop"), *change, "--store", s3_location)
    wait_stopped(a)
    again = _a_save(tmp_path, "again-1", 9.0)
    replaced = run(plain, "commit", str(again), "--step", "1", "--force", "--store", s3_location)
    assert replaced.returncode == 0, replaced.stderr
    time.sleep(float(TTL) + 2)  # a's lease lapses
    collected = run(
        host_env(tmp_path / "host-g"), "gc", "--keep-last", "5", "--lock-timeout", "60", "--store", s3_location
    )
    assert collected.returncode == 0, collected.stderr
    done = resume(a)
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) <= 1, done.stderr
    steps = _steps(host_env(tmp_path / "host-fresh"), s3_location)
    if what == "tag":
        holder = next(step for step, s in steps.items() if "X" in s["tags"])
        assert (done.returncode, holder) in ((0, 1), (4, 2)), (done.returncode, holder, done.stderr)
        kept = run(host_env(tmp_path / "host-g2"), "gc", "--keep-last", "1", "--store", s3_location)
        assert kept.returncode == 0, kept.stderr
        assert holder in _steps(host_env(tmp_path / "host-fresh-2"), s3_location)
    else:
        assert (done.returncode, steps[1]["pinned"]) in ((0, True), (4, False)), (done.returncode, done.stderr)


@pytest.mark.slow
@pytest.mark.parametrize("what", ["pin", "tag"])
def test_a_ref_set_on_a_revision_that_then_fails_keeps_the_revision(
    s3_location: str, tmp_path: Path, what: str
) -> None:
    """Host x replaces step 2 (``--force``) and stalls after publishing the new version; host b pins
    (or tags) step 2, which is now that version, and is told so; x's lease lapses and its change
    fails. The version b's ref names stays with that ref, and gc keeps the step (taken back with its
    pin, the step lost b's ref and gc dropped it)."""
    plain = host_env(tmp_path / "host-c", TAILOR_LOCK_TTL="3600")
    _three_plain_steps(tmp_path, plain, s3_location)
    again = _a_save(tmp_path, "again-2", 8.0)
    x = start(host_env(tmp_path / "host-x", TAILOR_FAILPOINTS="after-publish=stop"),
              "commit", str(again), "--step", "2", "--force", "--tag", "TX", "--store", s3_location)  # fmt: skip
    wait_stopped(x)
    change = ("pin", "step=2") if what == "pin" else ("tag", "step=2", "keep")
    done_b = run(host_env(tmp_path / "host-b", TAILOR_LOCK_TTL="3600"), *change, "--store", s3_location)
    assert done_b.returncode == 0, done_b.stderr
    time.sleep(float(TTL) + 2)
    done = resume(x)
    assert done.returncode == 4 and "stays" in done.stderr, done.stderr
    steps = _steps(host_env(tmp_path / "host-fresh"), s3_location)
    assert steps[2]["pinned"] if what == "pin" else "keep" in steps[2]["tags"], steps[2]
    assert "TX" not in steps[2]["tags"]  # x's own tag was taken back
    collected = run(host_env(tmp_path / "host-g"), "gc", "--keep-last", "1", "--store", s3_location)
    assert collected.returncode == 0, collected.stderr
    assert 2 in _steps(host_env(tmp_path / "host-fresh-2"), s3_location)


@pytest.mark.slow
def test_a_new_main_step_keeps_the_plain_pin_another_host_set_on_it(s3_location: str, tmp_path: Path) -> None:
    """Run b has a pinned step 8; host x commits main's step 8 and, after publishing it, host b pins
    main's step 8 (the plain pin key). x's hand-over of a branch's legacy plain pin takes only an
    empty one (the form writers wrote before pins named their run), so b's pin stays."""
    plain = host_env(tmp_path / "host-c", TAILOR_LOCK_TTL="3600")
    assert run(plain, "init", s3_location).returncode == 0
    branch = run(
        plain, "commit", str(_a_save(tmp_path, "b8", 1.0)), "--step", "8", "--run", "b", "--store", s3_location
    )
    assert branch.returncode == 0, branch.stderr
    assert run(plain, "pin", "b:step=8", "--store", s3_location).returncode == 0
    x = start(host_env(tmp_path / "host-x", TAILOR_LOCK_TTL="3600", TAILOR_FAILPOINTS="after-publish=stop"),
              "commit", str(_a_save(tmp_path, "m8", 2.0)), "--step", "8", "--store", s3_location)  # fmt: skip
    wait_stopped(x)
    pinned = run(host_env(tmp_path / "host-b", TAILOR_LOCK_TTL="3600"), "pin", "step=8", "--store", s3_location)
    assert pinned.returncode == 0, pinned.stderr
    done = resume(x)
    assert done.returncode == 0, done.stderr
    fresh = host_env(tmp_path / "host-fresh")
    main = {
        s["step"]: s for s in json.loads(run(fresh, "log", "--json", "--run", "main", "--store", s3_location).stdout)
    }
    assert main[8]["pinned"], main
    assert (
        run(plain, "commit", str(_a_save(tmp_path, "m9", 3.0)), "--step", "9", "--store", s3_location).returncode == 0
    )
    assert run(host_env(tmp_path / "host-g"), "gc", "--keep-last", "1", "--store", s3_location).returncode == 0
    kept = json.loads(
        run(host_env(tmp_path / "host-fresh-2"), "log", "--json", "--run", "main", "--store", s3_location).stdout
    )
    assert 8 in {s["step"] for s in kept}


@pytest.mark.slow
def test_an_unpin_past_its_lease_leaves_a_pin_set_after_it(s3_location: str, tmp_path: Path) -> None:
    """An unpin stalled at its request past its lease: a pin another host set meanwhile stays, and
    the unpin fails (a delete by name, unfenced, took that pin and gc dropped the step)."""
    plain = host_env(tmp_path / "host-c", TAILOR_LOCK_TTL="3600")
    _three_plain_steps(tmp_path, plain, s3_location)
    assert run(plain, "pin", "step=2", "--store", s3_location).returncode == 0
    stalled = host_env(tmp_path / "host-a", TAILOR_FAILPOINTS="unpin/put-if=stop@1")
    a = start(stalled, "unpin", "step=2", "--store", s3_location)
    wait_stopped(a)
    time.sleep(float(TTL) + 2)
    again = run(host_env(tmp_path / "host-b", TAILOR_LOCK_TTL="3600"), "pin", "step=2", "--store", s3_location)
    assert again.returncode == 0, again.stderr
    done = resume(a)
    assert done.returncode == 4 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert _steps(host_env(tmp_path / "host-fresh"), s3_location)[2]["pinned"]
    assert run(host_env(tmp_path / "host-g"), "gc", "--keep-last", "1", "--store", s3_location).returncode == 0
    assert 2 in _steps(host_env(tmp_path / "host-fresh-2"), s3_location)


@pytest.mark.slow
def test_a_killed_gcs_drop_mark_on_a_step_kept_is_cleared_by_the_next_gc(s3_location: str, tmp_path: Path) -> None:
    """A gc killed after marking step 2 to drop leaves the mark; the next gc keeps the step and
    clears it, so the step can be pinned, tagged and given a metric again (the mark refused them
    all, for good)."""
    plain = host_env(tmp_path / "host-c", TAILOR_LOCK_TTL="3600")
    _three_plain_steps(tmp_path, plain, s3_location)
    killed = run(host_env(tmp_path / "host-g", TAILOR_FAILPOINTS="gc/delete-many=kill@1"), "gc", "--keep-last", "1",
                 "--store", s3_location)  # fmt: skip
    assert killed.returncode == -9
    refused = run(plain, "pin", "step=2", "--store", s3_location)
    assert refused.returncode == 4 and "the next" in refused.stderr and len(refused.stderr.strip().splitlines()) == 1
    assert run(plain, "gc", "--keep-last", "5", "--store", s3_location).returncode == 0
    for change in (("pin", "step=2"), ("tag", "step=2", "keep"), ("metric", "step=2", "loss=1")):
        done = run(plain, *change, "--store", s3_location)
        assert done.returncode == 0, (change, done.stderr)
    steps = _steps(host_env(tmp_path / "host-fresh"), s3_location)
    assert steps[2]["pinned"] and "keep" in steps[2]["tags"]


@pytest.mark.slow
def test_tombstones_are_known_by_their_size_and_cost_no_read(s3_location: str, tmp_path: Path) -> None:
    """Untagged tags and unpinned pins leave tombstones that stay; reading the refs (every open,
    every gc) takes them from the listing, one request however many there are."""
    plain = host_env(tmp_path / "host-c", TAILOR_LOCK_TTL="3600")
    _three_plain_steps(tmp_path, plain, s3_location)
    backend = resolve(s3_location).backend
    for n in range(40):
        backend.put(f"refs/tags/gone{n}", b"dropped\n")
        backend.put(f"refs/pins/step-{n:020d}-v1.json.zst", b"unpinned\n")
    steps = _steps(host_env(tmp_path / "host-fresh"), s3_location)
    assert steps[1]["tags"] == ["w"] and not any(s["pinned"] for s in steps.values())
    before = _gets_of_one_open(tmp_path / "host-fresh", s3_location)
    for n in range(40, 140):
        backend.put(f"refs/tags/gone{n}", b"dropped\n")
        backend.put(f"refs/pins/step-{n:020d}-v1.json.zst", b"unpinned\n")
    after = _gets_of_one_open(tmp_path / "host-fresh", s3_location)
    assert after == before, (before, after)  # 200 more tombstones, not one request more


_COUNT_GETS = """
import json, sys
from tailorstore import Store
from tailorstore.core.failpoints import requests_made
with Store.open(sys.argv[1]) as store:
    store.log()
print(json.dumps(sum(n for name, n in requests_made().items() if name.endswith("/get"))))
"""


def _gets_of_one_open(cache: Path, location: str) -> int:
    done = subprocess.run([sys.executable, "-c", _COUNT_GETS, location], env=host_env(cache), capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr
    return int(done.stdout.strip().splitlines()[-1])


# -- follow-ups after a lapse run under a lease; a version taken back stays reserved -------------------


def _listed(location: str, prefix: str) -> list[str]:
    folder = prefix.rsplit("/", 1)[0] + "/"
    return sorted(k.rsplit("/", 1)[-1] for k in resolve(location).backend.list(folder) if k.startswith(prefix))


@pytest.mark.slow
def test_a_failed_revision_stalled_in_its_take_back_while_gc_runs_keeps_the_step(
    s3_location: str, tmp_path: Path
) -> None:
    """x: commit --force of step 2, stalled after publishing v2 past its lease; resumed, it fails and
    takes v2 back, stalled again at its delete. A gc run then (sent unfenced, x's take-back had its
    marker cleared as stale by this gc, which adopted v2 and deleted v1, and then deleted v2: step 2
    was gone). The take-back runs under a lease: the step stays, whichever version holds it."""
    plain = host_env(tmp_path / "host-c", TAILOR_LOCK_TTL="3600")
    _three_plain_steps(tmp_path, plain, s3_location)
    again = _a_save(tmp_path, "again-2", 8.0)
    x = start(
        host_env(tmp_path / "host-x", TAILOR_FAILPOINTS="after-publish=stop,commit/delete-many=stop@1"),
        "commit", str(again), "--step", "2", "--force", "--tag", "TX", "--store", s3_location,
    )  # fmt: skip
    wait_stopped(x)
    time.sleep(float(TTL) + 2)  # past its lease
    os.kill(x.pid, signal.SIGCONT)
    wait_stopped(x)  # in its take-back, at the delete of v2
    collected = run(host_env(tmp_path / "host-g"), "gc", "--keep-last", "5", "--lock-timeout", "60",
                    "--store", s3_location)  # fmt: skip
    assert collected.returncode == 0, collected.stderr
    done = resume(x)
    steps = _steps(host_env(tmp_path / "host-fresh"), s3_location)
    assert 2 in steps, (done.returncode, done.stderr, sorted(steps))


def _take_back_stalled_while_gc_runs(tmp_path: Path, location: str) -> tuple[dict[str, str], dict[str, str]]:
    plain = host_env(tmp_path / "host-c", TAILOR_LOCK_TTL="3600")
    _three_plain_steps(tmp_path, plain, location)
    again = _a_save(tmp_path, "again-2", 8.0)
    x = start(
        host_env(tmp_path / "host-x", TAILOR_FAILPOINTS="after-publish=stop,commit/delete-many=stop@1"),
        "commit", str(again), "--step", "2", "--force", "--tag", "TX", "--store", location,
    )  # fmt: skip
    wait_stopped(x)
    time.sleep(float(TTL) + 2)
    os.kill(x.pid, signal.SIGCONT)
    wait_stopped(x)
    g = host_env(tmp_path / "host-g")
    assert run(g, "gc", "--keep-last", "5", "--lock-timeout", "60", "--store", location).returncode == 0
    done = resume(x)
    assert done.returncode == 4, done.stderr
    return plain, g


@pytest.mark.slow
def test_a_version_taken_back_stays_reserved_and_a_new_commit_of_the_step_checks_out(
    s3_location: str, tmp_path: Path
) -> None:
    """After a take-back stalled beside a gc, a new commit of the step takes a key of its own (a
    version taken back stays reserved: its marker is put again with its delete): one that took the
    key again was read by another host's index as the old rows, and that host's gc deleted the new
    commit's blobs. Checked by that host's gc, then a deep verify and a checkout elsewhere."""
    plain, g = _take_back_stalled_while_gc_runs(tmp_path, s3_location)
    new = _a_save(tmp_path, "new-2", 11.0)
    committed = run(plain, "commit", str(new), "--step", "2", "--force", "--store", s3_location)
    assert committed.returncode == 0, committed.stderr
    collected = run(g, "gc", "--keep-last", "5", "--store", s3_location)
    assert collected.returncode == 0, collected.stderr
    fresh = host_env(tmp_path / "host-fresh")
    checked = run(fresh, "verify", "--deep", "--store", s3_location)
    out = tmp_path / "out"
    got = run(fresh, "checkout", "step=2", "--out", str(out), "--store", s3_location)
    assert checked.returncode == 0 and got.returncode == 0
    assert (out / "new-2" / "model.pt").read_bytes() == (new / "model.pt").read_bytes()


@pytest.mark.slow
def test_a_pin_set_beside_a_stalled_take_back_keeps_its_step(s3_location: str, tmp_path: Path) -> None:
    """x commits new step 4 and fails past its lease, its take-back stalled at its delete; a gc runs,
    then host b pins step 4 and is told so. Step 4 stays pinned (an unfenced take-back's marker was
    cleared by the gc, b found nothing to back off from, and x then deleted step 4 with b's pin)."""
    plain = host_env(tmp_path / "host-c", TAILOR_LOCK_TTL="3600")
    _three_plain_steps(tmp_path, plain, s3_location)
    x = start(
        host_env(tmp_path / "host-x", TAILOR_FAILPOINTS="after-publish=stop,commit/delete-many=stop@1"),
        "commit", str(_a_save(tmp_path, "s4", 4.0)), "--step", "4", "--tag", "TX", "--store", s3_location,
    )  # fmt: skip
    wait_stopped(x)
    time.sleep(float(TTL) + 2)
    os.kill(x.pid, signal.SIGCONT)
    wait_stopped(x)
    g = host_env(tmp_path / "host-g")
    assert run(g, "gc", "--keep-last", "5", "--lock-timeout", "60", "--store", s3_location).returncode == 0
    pinned = run(host_env(tmp_path / "host-b", TAILOR_LOCK_TTL="3600"), "pin", "step=4", "--store", s3_location)
    assert pinned.returncode == 0, pinned.stderr
    done = resume(x)
    assert done.returncode == 4 and len(done.stderr.strip().splitlines()) <= 2, done.stderr
    steps = _steps(host_env(tmp_path / "host-fresh"), s3_location)
    assert 4 in steps and steps[4]["pinned"], sorted(steps)


@pytest.mark.slow
@pytest.mark.parametrize("what", ["tag", "pin"])
def test_a_ref_change_whose_lease_lapses_before_it_follows_settles_under_a_new_lease(
    s3_location: str, tmp_path: Path, what: str
) -> None:
    """Host a: ``tag step=1 X --force`` (X on step 2), or ``pin step=1``, stalled at ref-written past
    its lease; step 1 is replaced (``--force``: v2). a resumes and must follow to v2, fenced: it
    takes a new lease and settles (its follow's lease error once left the write on v1 while a
    reported failure, and gc then dropped step 2)."""
    plain = host_env(tmp_path / "host-c", TAILOR_LOCK_TTL="3600")
    _three_plain_steps(tmp_path, plain, s3_location)
    assert run(plain, "tag", "step=2", "X", "--store", s3_location).returncode == 0
    change = ("tag", "step=1", "X", "--force") if what == "tag" else ("pin", "step=1")
    a = start(host_env(tmp_path / "host-a", TAILOR_FAILPOINTS="ref-written=stop"), *change, "--store", s3_location)
    wait_stopped(a)
    replaced = run(plain, "commit", str(_a_save(tmp_path, "again-1", 9.0)), "--step", "1", "--force",
                   "--store", s3_location)  # fmt: skip
    assert replaced.returncode == 0, replaced.stderr
    time.sleep(float(TTL) + 2)  # a's lease lapses
    done = resume(a)
    steps = _steps(host_env(tmp_path / "host-fresh"), s3_location)
    if what == "tag":
        holder = next(step for step, s in steps.items() if "X" in s["tags"])
        assert (done.returncode, holder) in ((0, 1), (4, 2)), (done.returncode, holder, done.stderr)
    else:
        assert (done.returncode, steps[1]["pinned"]) in ((0, True), (4, False)), (done.returncode, done.stderr)


@pytest.mark.slow
def test_a_tag_move_stalled_while_gc_drops_its_old_step_ends_on_the_new_one(s3_location: str, tmp_path: Path) -> None:
    """a: ``tag step=1 X --force`` (X on step 2), stalled at ref-written past its lease; a gc sees X on
    step 1 and drops step 2; step 1 is replaced (v2). a resumes under a new lease and settles on v2:
    the move is done, and X names step 1 (it said nothing was changed, step 2 being gone)."""
    plain = host_env(tmp_path / "host-c", TAILOR_LOCK_TTL="3600")
    _three_plain_steps(tmp_path, plain, s3_location)
    assert run(plain, "tag", "step=2", "X", "--store", s3_location).returncode == 0
    a = start(host_env(tmp_path / "host-a", TAILOR_FAILPOINTS="ref-written=stop"),
              "tag", "step=1", "X", "--force", "--store", s3_location)  # fmt: skip
    wait_stopped(a)
    time.sleep(float(TTL) + 2)
    collected = run(host_env(tmp_path / "host-g"), "gc", "--keep-last", "1", "--lock-timeout", "60",
                    "--store", s3_location)  # fmt: skip
    assert collected.returncode == 0 and 2 not in _steps(host_env(tmp_path / "host-look"), s3_location)
    replaced = run(plain, "commit", str(_a_save(tmp_path, "again-1", 9.0)), "--step", "1", "--force",
                   "--store", s3_location)  # fmt: skip
    assert replaced.returncode == 0, replaced.stderr
    done = resume(a)
    steps = _steps(host_env(tmp_path / "host-fresh"), s3_location)
    assert done.returncode == 0 and "X" in steps[1]["tags"], (done.returncode, done.stderr, sorted(steps))


def _a_gc_killed_after_its_marks(tmp_path: Path, location: str) -> None:
    """A ``gc --keep-last 1`` killed at its first delete: its drop marks stay on the steps it meant to drop."""
    killed = run(host_env(tmp_path / "host-k", TAILOR_FAILPOINTS="gc/delete-many=kill@1"), "gc", "--keep-last", "1",
                 "--store", location)  # fmt: skip
    assert killed.returncode == -9


def _x_on_step_2_beside_a_killed_gcs_mark(tmp_path: Path, location: str) -> dict[str, str]:
    """Steps 1 to 4, step 1 tagged ``w`` and step 2 ``X``, and a killed gc's marks on steps 2 and 3;
    returns the plain host's environment."""
    plain = host_env(tmp_path / "host-c", TAILOR_LOCK_TTL="3600")
    _three_plain_steps(tmp_path, plain, location)
    assert run(plain, "commit", str(_a_save(tmp_path, "s4", 4.0)), "--step", "4", "--store", location).returncode == 0
    assert run(plain, "tag", "step=2", "X", "--store", location).returncode == 0
    _a_gc_killed_after_its_marks(tmp_path, location)
    return plain


# -- the sixth round: late deletes, second lapses, stale take-backs ----------------------------------


STEP2 = "manifests/main/step-00000000000000000002-"


@pytest.mark.slow
def test_a_claimed_take_backs_late_marker_delete_frees_no_reserved_version(s3_location: str, tmp_path: Path) -> None:
    """x: commit --force of step 2, stalled after publishing v2 past its lease; b pins step 2 (v2).
    x resumes, fails, takes back under a NEW lease: marks v2, finds b's pin, and deletes its marker
    (mark_unless_claimed's delete_many(mine), sent with no fence) - stalled there. b unpins; a gc
    drops step 2 (v2 deleted, its marker reserving v2). x's late delete lands: v2's reservation is
    gone, and a new commit of step 2 takes v2 again."""
    plain = host_env(tmp_path / "host-c", TAILOR_LOCK_TTL="3600")
    _three_plain_steps(tmp_path, plain, s3_location)
    x = start(
        host_env(tmp_path / "host-x", TAILOR_FAILPOINTS="after-publish=stop,commit/delete-many=stop@1"),
        "commit", str(_a_save(tmp_path, "again-2", 8.0)), "--step", "2", "--force", "--tag", "TX",
        "--store", s3_location,
    )  # fmt: skip
    wait_stopped(x)
    b = host_env(tmp_path / "host-b", TAILOR_LOCK_TTL="3600")
    pinned = run(b, "pin", "step=2", "--store", s3_location)
    assert pinned.returncode == 0, pinned.stderr
    time.sleep(float(TTL) + 2)  # x's lease lapses
    os.kill(x.pid, signal.SIGCONT)
    wait_stopped(x)  # in its take-back: v2 marked, b's pin found, at the delete of its own marker
    unpinned = run(b, "unpin", "step=2", "--store", s3_location)
    assert unpinned.returncode == 0, unpinned.stderr
    g = host_env(tmp_path / "host-g")
    collected = run(g, "gc", "--keep-last", "1", "--lock-timeout", "60", "--store", s3_location)
    assert collected.returncode == 0, collected.stderr
    resume(x)
    new = _a_save(tmp_path, "new-2", 11.0)
    committed = run(plain, "commit", str(new), "--step", "2", "--store", s3_location)
    assert committed.returncode == 0, committed.stderr
    now = _listed(s3_location, STEP2)
    # what that does: host b's index knew v2 as x's rows; b's checkout and b's gc go by them
    out_b = tmp_path / "out-b"
    got_b = run(b, "checkout", "step=2", "--out", str(out_b), "--store", s3_location)
    assert got_b.returncode == 0 and (out_b / "new-2" / "model.pt").exists(), got_b.stderr
    collected_b = run(b, "gc", "--keep-last", "5", "--store", s3_location)
    assert collected_b.returncode == 0, collected_b.stderr
    fresh = host_env(tmp_path / "host-fresh")
    checked = run(fresh, "verify", "--deep", "--store", s3_location)
    assert checked.returncode == 0, checked.stdout[-600:]
    out = tmp_path / "out"
    got = run(fresh, "checkout", "step=2", "--out", str(out), "--store", s3_location)
    assert got.returncode == 0 and (out / "new-2" / "model.pt").read_bytes() == (new / "model.pt").read_bytes()
    assert "step-00000000000000000002-v2.json.zst" not in now, "version 2 of step 2 was used again"


def _stop_again(proc, pause: float = 0.0) -> None:
    if pause:
        time.sleep(pause)
    os.kill(proc.pid, signal.SIGCONT)
    wait_stopped(proc)


def _run_out(proc) -> subprocess.CompletedProcess[str]:
    """Resume a process that stops at every match of its failpoint until it ends, without pausing:
    a lease it takes now holds."""
    deadline = time.monotonic() + 120
    while proc.poll() is None and time.monotonic() < deadline:
        os.kill(proc.pid, signal.SIGCONT)
        time.sleep(0.2)
    out, err = proc.communicate(timeout=30)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.mark.slow
def test_a_tag_move_whose_new_lease_lapses_too_says_what_stays(s3_location: str, tmp_path: Path) -> None:
    """a: tag step=1 X --force (X on step 2). It writes X on step 1 (v1), stalls at ref-written; step 1
    is replaced (v2); a's lease lapses; its follow is refused by its fence; it takes a new lease and
    settles again, and stalls at the follow's put past the NEW lease too (that went out as 'Nothing it
    did is visible', X left on step 1, and a gc then dropped step 2). It takes another lease and
    settles: done, or what stays said."""
    plain = host_env(tmp_path / "host-c", TAILOR_LOCK_TTL="3600")
    _three_plain_steps(tmp_path, plain, s3_location)
    assert run(plain, "tag", "step=2", "X", "--store", s3_location).returncode == 0
    a = start(host_env(tmp_path / "host-a", TAILOR_FAILPOINTS="ref-written=stop,tag/put-if=stop"),
              "tag", "step=1", "X", "--force", "--store", s3_location)  # fmt: skip
    wait_stopped(a)  # put-if 1: the tag's own write
    _stop_again(a)  # ref-written
    replaced = run(plain, "commit", str(_a_save(tmp_path, "again-1", 9.0)), "--step", "1", "--force",
                   "--store", s3_location)  # fmt: skip
    assert replaced.returncode == 0, replaced.stderr
    _stop_again(a, float(TTL) + 2)  # lease lapsed; at the first follow's put-if (its old fence fails next)
    _stop_again(a)  # a new lease taken; at the second follow's put-if
    time.sleep(float(TTL) + 2)  # the new lease lapses too
    done = _run_out(a)  # a third lease holds: it settles
    holder = {t: s for s, st in _steps(host_env(tmp_path / "host-fresh"), s3_location).items() for t in st["tags"]}
    collected = run(host_env(tmp_path / "host-g"), "gc", "--keep-last", "1", "--store", s3_location)
    assert collected.returncode == 0, collected.stderr
    assert (done.returncode, holder.get("X")) in ((0, 1), (4, 2)) or "visible" not in done.stderr, (
        done.returncode,
        holder,
        done.stderr,
    )


@pytest.mark.slow
def test_a_failed_replacement_of_a_step_a_killed_gc_marked_keeps_the_step(s3_location: str, tmp_path: Path) -> None:
    """A gc killed after marking step 2 to drop leaves v1's marker (empty). x: commit --force --tag TX
    of step 2 publishes v2 and stalls past its lease; a gc (keep-last 5) takes v2 for the step's
    current version and deletes v1 as superseded (its SUPERSEDED marker is refused: the killed
    gc's empty one is there). x fails and takes back: _adopted_by_gc reads v1's marker, finds it
    empty, not SUPERSEDED, and deletes v2. Step 2 is gone."""
    plain = host_env(tmp_path / "host-c", TAILOR_LOCK_TTL="3600")
    _three_plain_steps(tmp_path, plain, s3_location)
    _a_gc_killed_after_its_marks(tmp_path, s3_location)
    x = start(host_env(tmp_path / "host-x", TAILOR_FAILPOINTS="after-publish=stop"),
              "commit", str(_a_save(tmp_path, "again-2", 8.0)), "--step", "2", "--force", "--tag", "TX",
              "--store", s3_location)  # fmt: skip
    wait_stopped(x)
    time.sleep(float(TTL) + 2)
    collected = run(host_env(tmp_path / "host-g"), "gc", "--keep-last", "5", "--lock-timeout", "60",
                    "--store", s3_location)  # fmt: skip
    assert collected.returncode == 0, collected.stderr
    done = resume(x)
    assert done.returncode == 4 and "stays" in done.stderr, done.stderr
    steps = sorted(_steps(host_env(tmp_path / "host-fresh"), s3_location))
    assert 2 in steps


@pytest.mark.slow
def test_a_tag_move_that_cannot_get_a_new_lease_says_what_stays(s3_location: str, tmp_path: Path) -> None:
    """As above, but the new lease cannot be had (a gc holds the store): fence_for_follow_up raises
    LockTimeoutError out of _settle, X left on step 1, the message only 'could not take the lock'."""
    plain = host_env(tmp_path / "host-c", TAILOR_LOCK_TTL="3600")
    _three_plain_steps(tmp_path, plain, s3_location)
    assert run(plain, "tag", "step=2", "X", "--store", s3_location).returncode == 0
    a = start(host_env(tmp_path / "host-a", TAILOR_FAILPOINTS="ref-written=stop"),
              "tag", "step=1", "X", "--force", "--lock-timeout", "5", "--store", s3_location)  # fmt: skip
    wait_stopped(a)
    replaced = run(plain, "commit", str(_a_save(tmp_path, "again-1", 9.0)), "--step", "1", "--force",
                   "--store", s3_location)  # fmt: skip
    assert replaced.returncode == 0, replaced.stderr
    time.sleep(float(TTL) + 2)
    g = start(host_env(tmp_path / "host-g", TAILOR_LOCK_TTL="3600", TAILOR_FAILPOINTS="gc-before-delete=stop"),
              "gc", "--keep-last", "5", "--lock-timeout", "60", "--store", s3_location)  # fmt: skip
    wait_stopped(g)
    done = resume(a)
    holder = {t: s for s, st in _steps(host_env(tmp_path / "host-fresh"), s3_location).items() for t in st["tags"]}
    g.kill()
    g.communicate()
    assert (done.returncode, holder.get("X")) in ((0, 1), (4, 2)) or "stays" in done.stderr, (done.returncode, holder)


@pytest.mark.slow
def test_a_failed_replacement_revised_by_another_host_meanwhile_says_it_stays(s3_location: str, tmp_path: Path) -> None:
    """x: commit --force --tag TX of step 2 (new weights), stalled after publishing v2; host y gives
    step 2 a metric (a revision of v2: v3, its rows x's). x fails past its lease and takes v2
    back, reporting that nothing it did is visible; step 2 now holds x's weights (v3)."""
    plain = host_env(tmp_path / "host-c", TAILOR_LOCK_TTL="3600")
    _three_plain_steps(tmp_path, plain, s3_location)
    new = _a_save(tmp_path, "again-2", 8.0)
    x = start(host_env(tmp_path / "host-x", TAILOR_FAILPOINTS="after-publish=stop"),
              "commit", str(new), "--step", "2", "--force", "--tag", "TX", "--store", s3_location)  # fmt: skip
    wait_stopped(x)
    y = run(host_env(tmp_path / "host-y", TAILOR_LOCK_TTL="3600"), "metric", "step=2", "loss=1", "--store", s3_location)
    assert y.returncode == 0, y.stderr
    time.sleep(float(TTL) + 2)
    done = resume(x)
    fresh = host_env(tmp_path / "host-fresh")
    out = tmp_path / "out"
    got = run(fresh, "checkout", "step=2", "--out", str(out), "--store", s3_location)
    assert got.returncode == 0, got.stderr
    holds_x = (out / "again-2" / "model.pt").exists()
    assert done.returncode == 0 or not holds_x or "stays" in done.stderr, "x reported failure, step 2 holds x's save"


@pytest.mark.slow
def test_a_tag_taken_back_names_its_steps_standing_version(s3_location: str, tmp_path: Path) -> None:
    """X on step 2 (host c). A killed gc left its mark on step 3. a: tag step=3 X --force writes X on
    step 3, stalls at ref-written. c replaces step 2 (--force: v2; v1 retired, no ref names it now).
    a reads the mark, fails ('nothing was changed') and takes back: X put back to the bytes it read,
    naming step 2's v1, which is gone. X tags nothing; a gc drops step 2."""
    plain = _x_on_step_2_beside_a_killed_gcs_mark(tmp_path, s3_location)
    a = start(host_env(tmp_path / "host-a", TAILOR_LOCK_TTL="3600", TAILOR_FAILPOINTS="ref-written=stop"),
              "tag", "step=3", "X", "--force", "--store", s3_location)  # fmt: skip
    wait_stopped(a)
    replaced = run(plain, "commit", str(_a_save(tmp_path, "again-2", 9.0)), "--step", "2", "--force",
                   "--store", s3_location)  # fmt: skip
    assert replaced.returncode == 0, replaced.stderr
    done = resume(a)
    holder = {t: s for s, st in _steps(host_env(tmp_path / "host-fresh"), s3_location).items() for t in st["tags"]}
    collected = run(host_env(tmp_path / "host-g"), "gc", "--keep-last", "1", "--store", s3_location)
    assert collected.returncode == 0, collected.stderr
    left = sorted(_steps(host_env(tmp_path / "host-fresh-2"), s3_location))
    assert done.returncode != 0 and holder.get("X") == 2 and 2 in left


@pytest.mark.slow
@pytest.mark.parametrize("gc_between", [False, True], ids=["no-gc", "gc"])
def test_a_retire_stalled_at_its_delete_keeps_a_pin_set_meanwhile(
    s3_location: str, tmp_path: Path, gc_between: bool
) -> None:
    """m: metric step=2 (a revision: v2), its retire of v1 stalled at its delete past its lease; b
    pins step 2 meanwhile (and a gc runs); m's late, unfenced delete of v1 and v1's pin lands. The
    pin b was told of stays, and step 2 survives a gc --keep-last 1."""
    plain = host_env(tmp_path / "host-c", TAILOR_LOCK_TTL="3600")
    _three_plain_steps(tmp_path, plain, s3_location)
    b = host_env(tmp_path / "host-b", TAILOR_LOCK_TTL="3600")
    assert run(b, "log", "--store", s3_location).returncode == 0  # b's index knows v1
    m = start(host_env(tmp_path / "host-m", TAILOR_FAILPOINTS="metric/delete-many=stop@1"),
              "metric", "step=2", "loss=1", "--store", s3_location)  # fmt: skip
    wait_stopped(m)
    time.sleep(float(TTL) + 2)
    pinned = run(b, "pin", "step=2", "--store", s3_location)
    assert pinned.returncode == 0, pinned.stderr
    if gc_between:
        g = run(host_env(tmp_path / "host-g"), "gc", "--keep-last", "5", "--lock-timeout", "60", "--store", s3_location)
        assert g.returncode == 0, g.stderr
    done = resume(m)
    assert done.returncode == 0, done.stderr
    assert _steps(host_env(tmp_path / "host-fresh"), s3_location)[2]["pinned"]
    assert run(host_env(tmp_path / "host-g2"), "gc", "--keep-last", "1", "--store", s3_location).returncode == 0
    assert 2 in _steps(host_env(tmp_path / "host-fresh-2"), s3_location)


# -- the seventh round: a tag put back is a ref write like any other ---------------------------------


@pytest.mark.slow
def test_a_tag_taken_back_where_rm_removed_its_step_meanwhile_stays_and_says_so(
    s3_location: str, tmp_path: Path
) -> None:
    """X on step 2. A killed gc left its mark on step 3. a: tag step=3 X --force writes X on step 3,
    stalls at ref-written. b: rm step=2 (not tagged now: X is on step 3) succeeds. a reads step 3's
    mark and fails; put back to step 2's v1, which rm deleted, X tagged nothing (though rm would have
    refused step 2 had X been on it), and a said nothing was changed. Now X stays on step 3, said."""
    _x_on_step_2_beside_a_killed_gcs_mark(tmp_path, s3_location)
    a = start(host_env(tmp_path / "host-a", TAILOR_LOCK_TTL="3600", TAILOR_FAILPOINTS="ref-written=stop"),
              "tag", "step=3", "X", "--force", "--store", s3_location)  # fmt: skip
    wait_stopped(a)
    removed = run(host_env(tmp_path / "host-b", TAILOR_LOCK_TTL="3600"), "rm", "step=2", "--store", s3_location)
    done = resume(a)
    fresh = host_env(tmp_path / "host-fresh")
    steps = _steps(fresh, s3_location)
    holder = {t: s for s, st in steps.items() for t in st["tags"]}
    assert removed.returncode == 0
    said = done.returncode == 4 and "stays" in done.stderr and len(done.stderr.strip().splitlines()) == 1
    assert said and holder.get("X") == 3, (done.returncode, done.stderr, holder, sorted(steps))


@pytest.mark.slow
def test_a_tag_taken_back_onto_a_version_withdrawn_meanwhile_follows_to_the_one_standing(
    s3_location: str, tmp_path: Path
) -> None:
    """X on step 2 (v1). A killed gc left its mark on step 3. a: tag step=3 X --force, stalled at
    ref-written. z: commit --force of step 2 publishes v2, stalled after-publish. a resumes, finds
    step 3 marked, takes back: _restored reads step 2's standing version (z's v2) and stalls at
    its put. z's lease lapses, z fails and withdraws v2 (X names step 3: unclaimed), deletes it.
    a's put lands (it named the deleted v2, and gc dropped step 2): read again, it follows to v1."""
    _x_on_step_2_beside_a_killed_gcs_mark(tmp_path, s3_location)
    stops = "ref-written=stop,tag/put-if=stop@2"
    a = start(host_env(tmp_path / "host-a", TAILOR_LOCK_TTL="3600", TAILOR_FAILPOINTS=stops),
              "tag", "step=3", "X", "--force", "--store", s3_location)  # fmt: skip
    wait_stopped(a)  # ref-written
    z = start(host_env(tmp_path / "host-z", TAILOR_FAILPOINTS="after-publish=stop"),
              "commit", str(_a_save(tmp_path, "z-2", 8.0)), "--step", "2", "--force", "--tag", "TZ",
              "--store", s3_location)  # fmt: skip
    wait_stopped(z)
    os.kill(a.pid, signal.SIGCONT)
    wait_stopped(a)  # at the take-back's put of X, computed to name z's v2
    time.sleep(float(TTL) + 2)
    done_z = resume(z)
    done = resume(a)
    steps = _steps(host_env(tmp_path / "host-fresh"), s3_location)
    holder = {t: s for s, st in steps.items() for t in st["tags"]}
    collected = run(host_env(tmp_path / "host-g"), "gc", "--keep-last", "1", "--store", s3_location)
    assert collected.returncode == 0, collected.stderr
    left = sorted(_steps(host_env(tmp_path / "host-fresh-2"), s3_location))
    assert holder.get("X") == 2 and 2 in left, (done.returncode, done_z.returncode, holder, left)
