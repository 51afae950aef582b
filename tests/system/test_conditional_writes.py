"""Conditional writes as real servers answer them: a lost create-only race answered 409
ConditionalRequestConflict (as one provider does) is the lost race 412 is, on moto and SeaweedFS
behind a relay that rewrites 412 to 409; a server that ignores the headers (``rclone serve s3``)
is found by the probe before the first write and refused in one line naming it, unless the
single-writer opt-in (docs/FORMAT.md) is given."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tailorstore.core.errors import ObjectExistsError
from tailorstore.store.backends.conditional import record_path
from tailorstore.store.backends.s3 import S3Backend
from testbed.local_s3 import LocalS3
from testbed.s3_relay import Relay, Rule
from tests.conftest import CLI, TEST_DATA, one_line

SMALL_SAVE = TEST_DATA / "format1" / "checkpoint"


def env_for(server: LocalS3, cache: Path, endpoint: str | None = None, **extra: str) -> dict[str, str]:
    env = {**os.environ, **server.environ(), "TAILOR_CACHE": str(cache), **extra}
    if endpoint:
        env["AWS_ENDPOINT_URL"] = endpoint
    env.pop("TAILOR_STORE", None)
    return env


def tailor_as(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], env=env, capture_output=True, text=True, timeout=300)


def test_a_create_only_put_refused_with_409_is_the_lost_race_412_is(
    s3_server: LocalS3, monkeypatch: pytest.MonkeyPatch
) -> None:
    with Relay(s3_server.port) as relay:
        rule = relay.add(Rule("status", method="PUT", times=None, rewrite=(412, 409)))
        monkeypatch.setenv("AWS_ENDPOINT_URL", relay.endpoint)
        backend = S3Backend(s3_server.new_location())
        backend.put("manifests/main/m", b"first", create_only=True)
        with pytest.raises(ObjectExistsError):
            backend.put("manifests/main/m", b"second", create_only=True)
        assert rule.rewritten == 1, "the server refused with 412, and the client saw 409"
        assert backend.get("manifests/main/m") == b"first"


@pytest.mark.slow  # real `tailor` processes, three rounds
def test_two_hosts_racing_for_one_step_through_409_answers_leave_one_winner(s3_server: LocalS3, tmp_path: Path) -> None:
    """Both hosts stop just before their manifest's create-only put and go on together, so only the
    server decides; every refusal reaches them as 409: one commit wins, the other exits 2, one line."""
    location = s3_server.new_location()
    with Relay(s3_server.port) as relay:
        rule = relay.add(Rule("status", method="PUT", times=None, rewrite=(412, 409)))
        envs = [env_for(s3_server, tmp_path / h, relay.endpoint, TAILOR_FAILPOINTS="before-publish=stop") for h in "ab"]
        assert tailor_as(envs[0], "init", location).returncode == 0
        for step in (7, 8, 9):
            commit = [*CLI, "commit", str(SMALL_SAVE), "--step", str(step), "--store", location, "--quiet"]
            procs = [
                subprocess.Popen(commit, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                for env in envs
            ]
            deadline = time.monotonic() + 120
            while not all(_stopped(p.pid) for p in procs):
                assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "no host reached its put"
                time.sleep(0.05)
            for p in procs:
                os.kill(p.pid, signal.SIGCONT)
            done = [(p.wait(timeout=300), p.stderr.read()) for p in procs]  # type: ignore[union-attr]
            assert sorted(code for code, _ in done) == [0, 2], done
            lost = next(err for code, err in done if code == 2)
            one_line(subprocess.CompletedProcess([], 2, "", lost), 2, f"step {step}")
        assert rule.rewritten >= 3
    keys = [k for k in s3_server.keys(location) if k.startswith("manifests/")]
    assert sorted(keys) == [f"manifests/main/step-{s:020d}-v1.json.zst" for s in (7, 8, 9)]


def _stopped(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"
    except OSError:
        return False


def test_servers_that_honour_conditional_writes_pass_the_probe_once_per_endpoint(
    s3_server: LocalS3, tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    with Relay(s3_server.port) as relay:
        env = env_for(s3_server, cache, relay.endpoint)
        location = s3_server.new_location()
        assert tailor_as(env, "init", location).returncode == 0
        probes = [t for m, t in relay.requests if m == "PUT" and "/probe/" in t]
        assert len(probes) == 3, relay.requests  # create, create again, replace under a wrong ETag
        probing = len([t for m, t in relay.requests if "/probe/" in t])
        record = json.loads(record_path(cache, relay.endpoint).read_text())
        assert record["If-None-Match"] is True and record["If-Match"] is True
        done = tailor_as(env, "commit", str(SMALL_SAVE), "--store", location, "--quiet")
        assert done.returncode == 0, done.stderr
        assert len([t for m, t in relay.requests if "/probe/" in t]) == probing, "the endpoint's record is used"
    assert not [k for k in s3_server.keys(location) if k.startswith("probe/")], "the probe object is deleted"


@pytest.mark.slow  # rclone and several `tailor` processes
def test_a_server_that_ignores_conditional_writes_is_refused_unless_one_writer_is_promised(
    rclone_server: LocalS3, tmp_path: Path
) -> None:
    location = rclone_server.new_location()
    env = env_for(rclone_server, tmp_path / "cache")
    refused = tailor_as(env, "init", location)
    one_line(refused, 5, rclone_server.endpoint, "If-None-Match", "If-Match", "TAILOR_SINGLE_WRITER=1")
    assert rclone_server.keys(location) == [], "nothing but the probe, deleted again, was written"

    alone = dict(env, TAILOR_SINGLE_WRITER="1")
    made = tailor_as(alone, "init", location)
    assert made.returncode == 0, made.stderr
    assert "one process at a time" in made.stderr
    committed = tailor_as(alone, "commit", str(SMALL_SAVE), "--store", location, "--quiet")
    assert committed.returncode == 0, committed.stderr

    again = tailor_as(env, "commit", str(SMALL_SAVE), "--step", "2", "--store", location, "--quiet")
    one_line(again, 5, rclone_server.endpoint, "If-None-Match")  # the record refuses, with no probe
    other_host = tailor_as(dict(env, TAILOR_CACHE=str(tmp_path / "other")), "commit", str(SMALL_SAVE), "--step",
                           "2", "--store", location, "--quiet")  # fmt: skip
    one_line(other_host, 5, rclone_server.endpoint, "If-None-Match")  # a host of its own probes, and refuses
    reading = tailor_as(env, "log", "--store", location)
    assert reading.returncode == 0 and "Traceback" not in reading.stderr, reading.stderr  # reading needs no probe


def test_a_probe_killed_before_its_delete_is_taken_by_gc_once_it_is_old() -> None:
    """A commit killed (or its link cut) between the probe's PUT and DELETE leaves a ``probe/``
    object; gc takes it as a killed commit's temp file once it is older than any probe in flight."""
    from tailorstore.store.backends.conditional import PROBE_STALE, stale_probes

    now = 1_000_000.0
    stamps = [
        ("probe/11-aa", now - PROBE_STALE - 1),  # killed long ago
        ("probe/12-bb", now - 5),  # a probe in flight
        ("blobs/ab/cd", now - 10 * PROBE_STALE),  # no probe
    ]
    assert stale_probes(stamps, now) == ["probe/11-aa"]
