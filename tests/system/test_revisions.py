"""A revision (``tailor metric``, ``commit --force``) stalled while other hosts change its step.

I7 (docs/FORMAT.md 8.1): a revision read the step's tag and pin, stalled before its create-only put, and
after the put wrote back the refs it had read, undoing another host's ``tag --force`` and ``unpin``
(both reported done); and a metric stalled before its publish brought back a step another host
had removed (both reported done, an outcome of neither order). Now a revision writes no ref it
carries over (a ref on an older version counts for the newest, FORMAT.md 8.1, I7), and a revision
and a removal of one step each write, then read the other side, so one of them fails.

Every host is a real ``tailor`` process with its own cache; the stall is a failpoint's SIGSTOP.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import CLI, TEST_DATA, one_line, tailor_process

pytestmark = pytest.mark.slow  # real tailor processes stalled at failpoints: seconds each

CHECKPOINT = TEST_DATA / "format1" / "checkpoint"


def _env(tmp_path: Path, host: str, **extra: str) -> dict[str, str]:
    return dict(os.environ, TAILOR_CACHE=str(tmp_path / f"cache-{host}"), TAILOR_LOCK_TTL="120", **extra)


def _run(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], env=env, capture_output=True, text=True, timeout=300)


def _ok(env: dict[str, str], *args: str) -> str:
    done = _run(env, *args)
    assert done.returncode == 0, (args, done.stderr)
    return done.stdout


def _stopped(env: dict[str, str], *args: str) -> subprocess.Popen[str]:
    proc = tailor_process(*args, env=env)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        if Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T":
            return proc
        time.sleep(0.05)
    proc.kill()
    raise AssertionError("the process never reached its failpoint")


def _resume(proc: subprocess.Popen[str]) -> subprocess.CompletedProcess[str]:
    os.kill(proc.pid, signal.SIGCONT)
    out, err = proc.communicate(timeout=300)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _store(request: pytest.FixtureRequest, tmp_path: Path, kind: str) -> str:
    if kind == "posix":
        return str(tmp_path / "store")
    return request.getfixturevalue("s3_server").new_location()


def _steps(tmp_path: Path, location: str, fresh: str) -> dict[int, dict]:
    out = _ok(_env(tmp_path, fresh), "log", "--json", "--store", location)
    return {s["step"]: s for s in json.loads(out)}


def _tagged_pinned_step3(tmp_path: Path, location: str) -> None:
    """Steps 3 (tagged golden, pinned) and 6; host b has seen them."""
    a = _env(tmp_path, "a")
    _ok(a, "init", location)
    _ok(a, "commit", str(CHECKPOINT), "--step", "3", "--tag", "golden", "--store", location)
    _ok(a, "commit", str(CHECKPOINT), "--step", "6", "--store", location)
    _ok(a, "pin", "step=3", "--store", location)
    _ok(_env(tmp_path, "b"), "log", "--store", location)


METRIC = ("metric", "step=3", "loss=1.5")
REVISIONS = {
    "metric": ("metric", "step=3", "loss=1.5"),
    "force": ("commit", str(CHECKPOINT), "--step", "3", "--force"),
}


@pytest.mark.parametrize("revision", sorted(REVISIONS))
def test_a_stalled_revision_keeps_the_refs_other_hosts_moved_meanwhile(
    request: pytest.FixtureRequest, tmp_path: Path, revision: str
) -> None:
    """On S3 (each host its own index): host a's revision stops just before its put; host b moves
    the tag to step 6 and unpins step 3, both reported done. After a resumes, step 6 keeps the tag
    and step 3 stays unpinned (before the fix: the tag was back on step 3, and it was pinned)."""
    location = _store(request, tmp_path, "s3")
    _tagged_pinned_step3(tmp_path, location)
    stalled = _stopped(
        _env(tmp_path, "a", TAILOR_FAILPOINTS="before-publish=stop"), *REVISIONS[revision], "--store", location
    )
    b = _env(tmp_path, "b")
    _ok(b, "tag", "step=6", "golden", "--force", "--store", location)
    _ok(b, "unpin", "step=3", "--store", location)
    resumed = _resume(stalled)
    assert resumed.returncode == 0, resumed.stderr
    for fresh in ("fresh", "a", "b"):  # a new host, and each host's own cache
        seen = _steps(tmp_path, location, fresh)
        assert seen[6]["tag"] == "golden" and not seen[3]["tag"], (fresh, seen)
        assert not seen[3]["pinned"], (fresh, seen)
    if revision == "metric":
        assert _steps(tmp_path, location, "fresh")[3]["metrics"] == {"loss": 1.5}
    # and a gc (which carries refs left on older versions over) changes none of this
    _ok(_env(tmp_path, "c"), "gc", "--store", location)
    seen = _steps(tmp_path, location, "fresh-after-gc")
    assert seen[6]["tag"] == "golden" and not seen[3]["tag"] and not seen[3]["pinned"], seen


@pytest.mark.parametrize("revision", sorted(REVISIONS))
def test_a_stalled_revision_keeps_the_refs_it_carries_over(
    request: pytest.FixtureRequest, tmp_path: Path, revision: str
) -> None:
    """The same with nobody else changing anything: the step keeps its tag and pin through the
    revision and a gc after it (the refs stay on the older version until gc carries them over)."""
    location = _store(request, tmp_path, "s3")
    _tagged_pinned_step3(tmp_path, location)
    _ok(_env(tmp_path, "a"), *REVISIONS[revision], "--store", location)
    for fresh in ("fresh", "a", "b"):
        seen = _steps(tmp_path, location, fresh)
        assert seen[3]["tag"] == "golden" and seen[3]["pinned"], (fresh, seen)
    _ok(_env(tmp_path, "c"), "gc", "--keep-last", "1", "--store", location)
    seen = _steps(tmp_path, location, "fresh-after-gc")
    assert sorted(seen) == [3, 6] and seen[3]["tag"] == "golden" and seen[3]["pinned"], seen
    _ok(_env(tmp_path, "b"), "unpin", "step=3", "--store", location)
    _ok(_env(tmp_path, "b"), "untag", "golden", "--store", location)
    seen = _steps(tmp_path, location, "fresh-after-unpin")
    assert not seen[3]["tag"] and not seen[3]["pinned"], seen


def test_an_unpin_on_a_revised_step_unpins_it(request: pytest.FixtureRequest, tmp_path: Path) -> None:
    """A revision leaves the pin on the version it replaced (a ref another host moved meanwhile is
    never written over); an unpin from a host that knows only the new version removes that pin too."""
    location = _store(request, tmp_path, "s3")
    _tagged_pinned_step3(tmp_path, location)
    _ok(_env(tmp_path, "a"), "metric", "step=3", "loss=2", "--store", location)
    _ok(_env(tmp_path, "b"), "unpin", "step=3", "--store", location)
    assert not _steps(tmp_path, location, "fresh")[3]["pinned"]


@pytest.mark.parametrize("kind", ["posix", "s3"])
def test_a_metric_stalled_while_its_step_was_removed_never_brings_it_back(
    request: pytest.FixtureRequest, tmp_path: Path, kind: str
) -> None:
    """Host a's metric stops just before its put; host b removes the step. Before the fix both
    reported done and the step was back (``latest`` again). Now at most one of them is reported
    done unless the removal came after the metric, and the store shows the effect: the step gone
    (the metric failed, one line, exit 4) or kept with the metric (the removal failed).

    On POSIX the hosts share the index, so b's ``rm`` waits for a's transaction, having read the
    step before: its own check is what sees the newer version."""
    location = _store(request, tmp_path, kind)
    a = _env(tmp_path, "a")
    _ok(a, "init", location)
    _ok(a, "commit", str(CHECKPOINT), "--step", "3", "--store", location)
    _ok(a, "commit", str(CHECKPOINT), "--step", "6", "--store", location)
    _ok(_env(tmp_path, "b"), "log", "--store", location)
    stalled = _stopped(_env(tmp_path, "a", TAILOR_FAILPOINTS="before-publish=stop"), *METRIC, "--store", location)
    remover = tailor_process("rm", "step=3", "--force", "--store", location, env=_env(tmp_path, "b"))
    if kind == "s3":
        removed = subprocess.CompletedProcess(remover.args, remover.wait(timeout=300), *remover.communicate())
        assert removed.returncode == 0, removed.stderr
    else:
        time.sleep(3)  # let it read the step and queue behind a's index transaction
    metric = _resume(stalled)
    if kind == "posix":
        removed = subprocess.CompletedProcess(remover.args, remover.wait(timeout=300), *remover.communicate())
    seen = _steps(tmp_path, location, "fresh")
    if removed.returncode == 0:  # the removal counts: the step is gone, whatever the metric said
        assert sorted(seen) == [6], (metric.stderr, seen)
        if kind == "s3" or metric.returncode != 0:  # on POSIX the rm may have come after the metric
            one_line(metric, 4, "step 3", "removed or replaced by another host")
        latest = _ok(_env(tmp_path, "fresh"), "log", "--json", "--store", location)
        assert max(s["step"] for s in json.loads(latest)) == 6
    else:
        one_line(removed, 4, "step 3", "removed or replaced by another host")
        assert metric.returncode == 0, metric.stderr
        assert seen[3]["metrics"] == {"loss": 1.5}, seen


def test_a_metric_on_a_step_removed_and_committed_again_since_it_read_it_fails(
    request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """On S3: a metric whose step another host removed and committed again meanwhile is refused, as
    its put comes after: it was read from a version that is gone."""
    location = _store(request, tmp_path, "s3")
    a, b = _env(tmp_path, "a"), _env(tmp_path, "b")
    _ok(a, "init", location)
    _ok(a, "commit", str(CHECKPOINT), "--step", "3", "--store", location)
    stalled = _stopped(_env(tmp_path, "a", TAILOR_FAILPOINTS="before-publish=stop"), *METRIC, "--store", location)
    _ok(b, "rm", "step=3", "--store", location)
    _ok(b, "commit", str(CHECKPOINT), "--step", "3", "--store", location)
    one_line(_resume(stalled), 4, "removed or replaced by another host")
    seen = _steps(tmp_path, location, "fresh")
    assert not seen[3].get("metrics"), seen


def test_a_metric_that_loses_its_put_says_so_without_naming_a_force_it_has_not(
    request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """Low finding 1: two hosts record a metric of one step at once; the one whose create-only put
    loses was told to "pass --force", which ``metric`` has not. It now says the step changed."""
    location = _store(request, tmp_path, "s3")
    _ok(_env(tmp_path, "a"), "init", location)
    _ok(_env(tmp_path, "a"), "commit", str(CHECKPOINT), "--step", "3", "--store", location)
    first, second = (
        _stopped(_env(tmp_path, h, TAILOR_FAILPOINTS="before-publish=stop"), *METRIC, "--store", location) for h in "ab"
    )
    assert _resume(first).returncode == 0
    lost = _resume(second)
    one_line(lost, 4, "step 3", "removed or replaced by another host")
    assert "--force" not in lost.stderr


def test_a_tag_given_by_a_revision_holds_its_step_after_a_later_revision_and_gc(tmp_path: Path) -> None:
    """Simulation seed 150: step 6 tagged t2, revised with ``--tag t1``, revised again untagged. The
    old t2 object still named the first version and t1 the second; ranking tags only by "names the
    current version" let t2 take the step back, and gc then deleted the version t1 named: t1 was
    on no step though nothing had moved it. The tag naming the newest version holds the step."""
    location = str(tmp_path / "store")
    a = _env(tmp_path, "a")
    _ok(a, "init", location)
    _ok(a, "commit", str(CHECKPOINT), "--step", "6", "--tag", "t2", "--store", location)
    _ok(a, "commit", str(CHECKPOINT), "--step", "6", "--force", "--tag", "t1", "--store", location)
    _ok(a, "commit", str(CHECKPOINT), "--step", "6", "--force", "--store", location)
    _ok(_env(tmp_path, "b"), "gc", "--store", location)
    assert _steps(tmp_path, location, "fresh")[6]["tag"] == "t1"
    assert "step 6" in _ok(_env(tmp_path, "fresh2"), "show", "tag=t1", "--store", location).lower()
