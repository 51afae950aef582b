"""Hosts that race and stall against one store on a real S3 server (moto), as separate
processes with their own caches: fencing of leases, and steps that only one host may create.

A stall lands where it matters through ``TAILOR_FAILPOINTS`` (tailorstore/core/failpoints.py): the
process sends itself SIGSTOP there, and the test resumes it with SIGCONT once another host
has acted. Every host is a real ``tailor`` process.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import boto3
import pytest

from tailorstore.store.backends.location import resolve
from testbed.local_s3 import BUCKET, LocalS3
from tests.conftest import CLI, one_line, tailor_process

TTL = "3"  # seconds: a stall of a few seconds outlives the lease


def host_env(cache: Path, **extra: str) -> dict[str, str]:
    env = dict(os.environ, TAILOR_CACHE=str(cache), TAILOR_LOCK_TTL=TTL)
    env.update(extra)
    return env


def start(env: dict[str, str], *args: str) -> subprocess.Popen[str]:
    return tailor_process(*args, env=env)


def run(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], env=env, capture_output=True, text=True, timeout=300)


def wait_stopped(proc: subprocess.Popen[str], limit: float = 120) -> None:
    """Until the process has sent itself SIGSTOP at its failpoint."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        state = Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        if state == "T":
            return
        time.sleep(0.05)
    proc.kill()
    raise AssertionError("the process never reached its failpoint")


def resume(proc: subprocess.Popen[str]) -> subprocess.CompletedProcess[str]:
    os.kill(proc.pid, signal.SIGCONT)
    out, err = proc.communicate(timeout=120)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def steps_seen_by_a_new_host(location: str, cache: Path) -> list[int]:
    done = run(host_env(cache), "log", "--json", "--store", location)
    assert done.returncode == 0, done.stderr
    return sorted(s["step"] for s in json.loads(done.stdout))


def checks_out_as(location: str, selector: str, save: Path, tmp_path: Path) -> None:
    """A new host finds the store whole (verify --deep) and the step byte for byte as ``save``."""
    fresh = host_env(tmp_path / "host-fresh")
    checked = run(fresh, "verify", "--deep", "--store", location)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    out = tmp_path / "out"
    assert run(fresh, "checkout", selector, "--out", str(out), "--store", location).returncode == 0
    for path in (save / "global_step3").iterdir():
        assert (out / "global_step3" / path.name).read_bytes() == path.read_bytes(), path.name


def step3_removed(location: str, saves: tuple[Path, Path], tmp_path: Path) -> tuple[dict[str, str], dict[str, str]]:
    """Hosts a and b of a store holding steps 3 and 6, step 3 then removed by a: its blobs are
    garbage, and host b's index still knows where they are (it listed the store before)."""
    a, b = host_env(tmp_path / "host-a"), host_env(tmp_path / "host-b")
    assert run(a, "init", location).returncode == 0
    for save in saves:
        assert run(a, "commit", str(save), "--store", location).returncode == 0
    assert run(b, "log", "--store", location).returncode == 0
    assert run(a, "rm", "step=3", "--store", location).returncode == 0
    return a, b


@pytest.mark.parametrize("stop", ["before-publish=stop", "*/put-create=stop@2"], ids=["named-point", "at-the-request"])
def test_a_commit_stalled_past_its_lease_while_gc_ran_publishes_nothing(
    s3_location: str, saves: tuple[Path, Path], tmp_path: Path, stop: str
) -> None:
    """Stopped at the named point before publishing, or at its manifest's request (its second
    create-only put; the first is its lease). The second was found by the simulation (a 'parts'
    schedule on S3): the fence was checked before the request's failpoint, so a commit stopped there
    past its lease published a step whose blobs gc had deleted. It is checked inside the put now,
    after the failpoint, as gc's deletions do."""
    at3, at6 = saves
    a, b = host_env(tmp_path / "host-a"), host_env(tmp_path / "host-b")
    assert run(b, "init", s3_location).returncode == 0
    assert run(b, "commit", str(at3), "--store", s3_location).returncode == 0

    # host a writes step 6's blobs, then stalls just before recording its manifest
    stalled = start({**a, "TAILOR_FAILPOINTS": stop}, "commit", str(at6), "--store", s3_location)
    wait_stopped(stalled)
    # host b's gc waits for a's lease, finds it stale once the lease time has passed, and deletes a's
    # blobs as orphans (no manifest names them)
    collected = run(b, "gc", "--lock-timeout", "60", "--store", s3_location)
    assert collected.returncode == 0, collected.stderr
    assert "removed a stale shared lock" in collected.stderr
    assert "freeing 0 B" not in collected.stdout, collected.stdout  # a's blobs went

    resumed = resume(stalled)
    one_line(resumed, 4, "stopped before publishing", "lease")
    assert "committed" not in resumed.stdout
    # nothing of step 6 is visible anywhere, and what is visible is whole
    assert steps_seen_by_a_new_host(s3_location, tmp_path / "host-c") == [3]
    checked = run(host_env(tmp_path / "host-c"), "verify", "--deep", "--store", s3_location)
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_a_gc_stalled_past_its_lease_while_a_commit_ran_deletes_nothing(
    s3_location: str, saves: tuple[Path, Path], tmp_path: Path
) -> None:
    at3, _ = saves
    a, b = step3_removed(s3_location, saves, tmp_path)

    # host a's gc plans to delete step 3's blobs, then stalls before its first deletion
    stalled = start({**a, "TAILOR_FAILPOINTS": "gc-before-delete=stop"}, "gc", "--store", s3_location)
    wait_stopped(stalled)
    # host b commits step 3's save again as step 30 once a's lease is stale: its blobs are
    # in b's index, so it writes none of them and names the ones gc is about to delete
    again = run(b, "commit", str(at3), "--step", "30", "--lock-timeout", "60", "--store", s3_location)
    assert again.returncode == 0, again.stderr
    assert "removed a stale exclusive lock" in again.stderr

    resumed = resume(stalled)
    one_line(resumed, 4, "gc stopped before", "lease")
    fresh = host_env(tmp_path / "host-c")
    assert steps_seen_by_a_new_host(s3_location, tmp_path / "host-c") == [6, 30]
    checked = run(fresh, "verify", "--store", s3_location)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    out = tmp_path / "out"
    assert run(fresh, "checkout", "step=30", "--out", str(out), "--store", s3_location).returncode == 0
    assert (out / "global_step3" / "mp_rank_00_model_states.pt").read_bytes() == (
        at3 / "global_step3" / "mp_rank_00_model_states.pt"
    ).read_bytes()


def test_two_hosts_committing_one_step_at_once_never_both_win(
    s3_server: LocalS3, s3_location: str, saves: tuple[Path, Path], tmp_path: Path
) -> None:
    """Both hosts pass their local checks (each stops just before it publishes, and both go on only
    once both have stopped there), so only the create-only write of the manifest object can decide:
    20 rounds, one winner each. (A sleep before the publish let a host that started late on a loaded
    machine meet the other's step in its own checks.)"""
    at3, at6 = saves
    envs = [
        host_env(tmp_path / f"host-{h}", TAILOR_FAILPOINTS="before-publish=stop", TAILOR_LOCK_TTL="120") for h in "ab"
    ]
    assert run(envs[0], "init", s3_location).returncode == 0
    winners: dict[int, Path] = {}
    for round_ in range(20):
        step = str(100 + round_)
        procs = [
            start(env, "commit", str(save), "--step", step, "--store", s3_location)
            for env, save in zip(envs, (at3, at6), strict=True)
        ]
        _until_stopped(procs)
        for p in procs:
            os.kill(p.pid, signal.SIGCONT)
        done = [(p, *p.communicate(timeout=300)) for p in procs]
        codes = sorted(p.returncode for p, _, _ in done)
        assert codes == [0, 2], [(p.returncode, err) for p, _, err in done]
        for (p, _, err), save in zip(done, (at3, at6), strict=True):
            if p.returncode == 0:
                winners[int(step)] = save
            else:
                one_line(subprocess.CompletedProcess(p.args, p.returncode, "", err), 2, f"step {step}", "first")
    keys = [k for k in s3_server.keys(s3_location) if k.startswith("manifests/")]
    assert sorted(keys) == [f"manifests/main/step-{s:020d}-v1.json.zst" for s in range(100, 120)]
    assert not [k for k in s3_server.keys(s3_location) if k.startswith("refs/")]
    for step in (100, 119):  # every host sees the winner's save
        for h in "abc":
            out = tmp_path / f"out-{step}-{h}"
            env = host_env(tmp_path / f"host-{h}")
            assert run(env, "checkout", f"step={step}", "--out", str(out), "--store", s3_location).returncode == 0
            tag_dir = next(winners[step].glob("global_step*")).name
            name = "mp_rank_00_model_states.pt"
            assert (out / tag_dir / name).read_bytes() == (winners[step] / tag_dir / name).read_bytes()


def _until_stopped(procs: list[subprocess.Popen[str]], limit: float = 120.0) -> None:
    """Every process stopped at its failpoint (SIGSTOP: state T), or the test fails."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        states = []
        for p in procs:
            assert p.poll() is None, ("a host ended before its publish", p.communicate())
            states.append(Path(f"/proc/{p.pid}/stat").read_text().rsplit(")", 1)[1].split()[0])
        if all(state == "T" for state in states):
            return
        time.sleep(0.05)
    for p in procs:
        p.kill()
    raise AssertionError("the hosts never both reached their publish")


@contextlib.contextmanager
def moto_process(**env: str) -> Iterator[LocalS3]:
    """An S3 server in a process of its own (moto's servers in one process share their objects)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, **env},
    )
    server = LocalS3()
    server.port, server.endpoint = port, f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            with socket.socket() as knock:
                if knock.connect_ex(("127.0.0.1", port)) == 0:
                    break
            assert time.monotonic() < deadline, "the S3 server did not start"
            time.sleep(0.2)
        yield server
    finally:
        proc.kill()
        proc.wait()


@contextlib.contextmanager
def second_server() -> Iterator[LocalS3]:
    """Another S3 server with a bucket of the same name: the same s3://bucket/prefix there is
    another store."""
    with moto_process() as server:
        boto3.client("s3", **server._client_args()).create_bucket(Bucket=BUCKET)
        yield server


def test_one_location_on_two_servers_is_two_stores_with_two_caches(
    s3_server: LocalS3, saves: tuple[Path, Path], tmp_path: Path
) -> None:
    at3, at6 = saves
    location = s3_server.new_location()
    cache = tmp_path / "one-host"  # one host, one cache folder for everything it opens
    first = host_env(cache)
    with second_server() as other:
        second = host_env(cache, **other.environ())
        assert run(first, "init", location).returncode == 0
        assert run(second, "init", location).returncode == 0
        assert run(first, "commit", str(at3), "--store", location).returncode == 0
        assert run(second, "commit", str(at6), "--store", location).returncode == 0
        assert run(second, "gc", "--store", location).returncode == 0
        for env, steps in ((first, [3]), (second, [6])):
            done = run(env, "log", "--json", "--store", location)
            assert sorted(s["step"] for s in json.loads(done.stdout)) == steps, done.stderr
            checked = run(env, "verify", "--deep", "--store", location)
            assert checked.returncode == 0, checked.stdout + checked.stderr
        assert len([p for p in cache.iterdir() if p.is_dir()]) == 2


def test_a_cache_of_another_store_at_the_same_place_is_refused(
    s3_server: LocalS3, saves: tuple[Path, Path], tmp_path: Path
) -> None:
    at3, at6 = saves
    location = s3_server.new_location()
    a, b = host_env(tmp_path / "host-a"), host_env(tmp_path / "host-b")
    assert run(a, "init", location).returncode == 0
    assert run(a, "commit", str(at3), "--store", location).returncode == 0
    # the store is deleted and made again at the same place by another host, with another step
    client = boto3.client("s3", **s3_server._client_args())
    prefix = location.removeprefix(f"s3://{BUCKET}/")
    for key in s3_server.keys(location):
        client.delete_object(Bucket=BUCKET, Key=f"{prefix}/{key}")
    assert run(b, "init", location).returncode == 0
    assert run(b, "commit", str(at6), "--store", location).returncode == 0
    for args in (("log",), ("gc",), ("checkout", "step=3", "--out", str(tmp_path / "out"))):
        one_line(run(a, *args, "--store", location), 3, "another store", "index rebuild")
    assert run(a, "index", "rebuild", "--store", location).returncode == 0
    done = run(a, "log", "--json", "--store", location)
    assert [s["step"] for s in json.loads(done.stdout)] == [6]


def test_ids_name_the_same_manifest_on_every_host(s3_server: LocalS3, saves: tuple[Path, Path], tmp_path: Path) -> None:
    at3, at6 = saves
    location = s3_server.new_location()
    a = host_env(tmp_path / "host-a")
    assert run(a, "init", location).returncode == 0
    for args in (("commit", str(at3)), ("commit", str(at6)), ("rm", "step=3"), ("commit", str(at3))):
        assert run(a, *args, "--store", location).returncode == 0  # host a numbers its rows 2 (step 6) and 3
    spec = tmp_path / "mix.yaml"
    spec.write_text("base: {step: 6}\nslices:\n  - sources: [{step: 3, layer_range: [0, 2]}]\n")
    merged = run(a, "merge", str(spec), "--tag", "mix", "--store", location)
    assert merged.returncode == 0, merged.stderr
    logs = [
        json.loads(run(host_env(tmp_path / f"host-{h}"), "log", "--json", "--store", location).stdout) for h in "abc"
    ]
    named = [{s["id"]: (s["step"], s["tag"]) for s in log} for log in logs]
    assert named[0] == named[1] == named[2] and len(named[0]) == 3
    # each host numbers its index rows its own way (a new host: 1 for step 6): no row number is printed
    assert not any("manifest" in s for log in logs for s in log)
    digests = [{s["id"]: s["digest"] for s in log} for log in logs]
    assert digests[0] == digests[1] == digests[2]  # the content digest too is the same on every host
    merge_id = next(i for i, (_, tag) in named[0].items() if tag == "mix")
    assert f"(id={merge_id})" in merged.stdout
    for h in "bc":
        shown = json.loads(
            run(host_env(tmp_path / f"host-{h}"), "show", f"id={merge_id[:6]}", "--json", "--store", location).stdout
        )
        assert shown["summary"]["tag"] == "mix" and shown["summary"]["id"] == merge_id


def test_leases_and_lease_times_from_strangers(s3_location: str, tmp_path: Path) -> None:
    """A lease of this host with a pid no process can have (os.kill overflowed), or an expiry that
    never comes (NaN, 1e300), is unreadable, so stale, and removed; a lease time of inf is refused
    in one line before anything is taken (a traceback in the lease thread, and exit 0)."""
    env = host_env(tmp_path / "host")
    assert run(env, "init", s3_location).returncode == 0
    backend = resolve(s3_location).backend
    here = socket.gethostname()
    for name, pid, expires in (("pid", 2**70, time.time() + 60), ("nan", 7, float("nan")), ("far", 7, 1e300)):
        body = {"exclusive": True, "host": here if name == "pid" else "far-away", "pid": pid, "expires": expires}
        backend.put(f"locks/{name}.json", json.dumps(body).encode())
    collected = run(env, "gc", "--lock-timeout", "5", "--store", s3_location)
    assert collected.returncode == 0, collected.stderr
    assert not list(backend.list("locks/"))
    one_line(run({**env, "TAILOR_LOCK_TTL": "inf"}, "gc", "--store", s3_location), 2, "TAILOR_LOCK_TTL='inf'")


def test_a_missing_bucket_is_named_as_such(s3_server: LocalS3, tmp_path: Path) -> None:
    """It said "no tailorstore here, create one with tailor init", and that init then failed with
    "check the server is reachable"."""
    env = host_env(tmp_path / "host")
    for args in (("log", "--store", "s3://no-such-bucket/x"), ("init", "s3://no-such-bucket/x")):
        one_line(run(env, *args), 5, "the bucket 'no-such-bucket' does not exist", "Create the bucket first")


def test_access_denied_is_named_as_such(tmp_path: Path) -> None:
    """A 403 got the advice to check that the server is reachable."""
    with moto_process(INITIAL_NO_AUTH_ACTION_COUNT="0") as strict:  # moto then checks every request's keys
        env = host_env(tmp_path / "host", **strict.environ(), TAILOR_S3_RETRY_SECONDS="0")
        one_line(run(env, "log", "--store", "s3://bucket/x"), 5, "access denied", "AWS_ACCESS_KEY_ID")


def _steps(env: dict[str, str], location: str) -> dict[int, dict]:
    done = run(env, "log", "--json", "--store", location)
    assert done.returncode == 0, done.stderr
    return {s["step"]: s for s in json.loads(done.stdout)}


def _racing_commits(envs: list[dict[str, str]], saves: tuple[Path, Path], location: str, *args: str) -> Path:
    """Both hosts commit at once (each stops just before it publishes, and both go on only once both
    have stopped there, so both pass their local checks whatever the machine's load): one wins, one
    is refused with exit 2; returns the winner's save. (A sleep before the publish let a host that
    started late meet the other's version in its own checks and replace it, both exiting 0.)"""
    envs = [{**env, "TAILOR_FAILPOINTS": "before-publish=stop"} for env in envs]
    procs = [start(env, "commit", str(save), *args, "--store", location) for env, save in zip(envs, saves, strict=True)]
    _until_stopped(procs)
    for p in procs:
        os.kill(p.pid, signal.SIGCONT)
    done = [(p, *p.communicate(timeout=300)) for p in procs]
    assert sorted(p.returncode for p, _, _ in done) == [0, 2], [(p.returncode, err) for p, _, err in done]
    return next(save for (p, _, _), save in zip(done, saves, strict=True) if p.returncode == 0)


def test_two_hosts_replacing_a_tagged_pinned_step_keep_its_tag_and_pin(
    s3_location: str, saves: tuple[Path, Path], tmp_path: Path
) -> None:
    """I2: the loser of two ``commit --force`` of one tagged, pinned step took back
    refs that named the key both had chosen, deleting the winner's pin and tag, and the next gc
    dropped the step. A loser now writes no ref at all."""
    envs = [host_env(tmp_path / f"host-{h}", TAILOR_LOCK_TTL="120") for h in "ab"]
    plain = host_env(tmp_path / "host-c")
    at3, at6 = saves
    assert run(plain, "init", s3_location).returncode == 0
    assert run(plain, "commit", str(at3), "--step", "5", "--tag", "keep", "--store", s3_location).returncode == 0
    assert run(plain, "pin", "step=5", "--store", s3_location).returncode == 0
    assert run(plain, "commit", str(at6), "--step", "9", "--store", s3_location).returncode == 0
    for round_ in range(3):
        winner = _racing_commits(envs, saves, s3_location, "--step", "5", "--force")
        seen = _steps(host_env(tmp_path / f"fresh-{round_}"), s3_location)
        assert seen[5]["tag"] == "keep" and seen[5]["pinned"], seen[5]
    # the next gc keeps the step its pin and tag protect, and it checks out as the last winner's save
    fresh = host_env(tmp_path / "fresh-gc")
    collected = run(fresh, "gc", "--keep-last", "1", "--store", s3_location)
    assert collected.returncode == 0, collected.stderr
    assert sorted(_steps(fresh, s3_location)) == [5, 9]
    out = tmp_path / "out"
    assert run(fresh, "checkout", "tag=keep", "--out", str(out), "--store", s3_location).returncode == 0
    tag_dir = next(winner.glob("global_step*")).name
    name = "mp_rank_00_model_states.pt"
    assert (out / tag_dir / name).read_bytes() == (winner / tag_dir / name).read_bytes()


def test_two_hosts_committing_a_new_step_with_one_tag_leave_it_tagged(
    s3_location: str, saves: tuple[Path, Path], tmp_path: Path
) -> None:
    """The same without --force: a new step committed by two hosts with the same ``--tag``."""
    envs = [host_env(tmp_path / f"host-{h}", TAILOR_LOCK_TTL="120") for h in "ab"]
    assert run(envs[0], "init", s3_location).returncode == 0
    for round_, step in enumerate((7, 8)):
        _racing_commits(envs, saves, s3_location, "--step", str(step), "--tag", f"best{step}")
        seen = _steps(host_env(tmp_path / f"fresh-{round_}"), s3_location)
        assert seen[step]["tag"] == f"best{step}", seen[step]


def test_a_gc_stalled_between_two_delete_requests_deletes_no_pack_a_commit_reused(
    s3_server: LocalS3, s3_location: str, saves: tuple[Path, Path], tmp_path: Path
) -> None:
    """I6: gc checked its lease once, then sent one DeleteObjects per 1,000 keys. Stalled
    after the first, its lease lapsed, another host's commit reused a pack gc had planned to delete,
    and gc's next request deleted it. Each request is now fenced: gc stops, and the step checks out.
    Since gc's notices (store/gc_notices.py), the commit that reuses what the stalled gc announced
    backs off too (exit 4, nothing visible): it cannot know that the gc's fence, not a late request,
    comes next. Once the gc has stopped and withdrawn its notice, the commit goes through."""
    at3, _ = saves
    a, b = step3_removed(s3_location, saves, tmp_path)
    # 1,000 orphan blob objects, which gc deletes before the packs: step 3's packs fall in its second request
    client = boto3.client("s3", **s3_server._client_args())
    prefix = s3_location.split(f"s3://{BUCKET}/", 1)[1]
    for i in range(1000):
        name = f"{i:032x}"
        client.put_object(Bucket=BUCKET, Key=f"{prefix}/blobs/{name[:2]}/{name}", Body=b"orphan")

    stalled = start({**a, "TAILOR_FAILPOINTS": "gc/delete-many=stop@2"}, "gc", "--store", s3_location)
    wait_stopped(stalled)
    packs_before = {k for k in s3_server.keys(s3_location) if k.startswith("packs/")}
    # host b commits step 3's save again as step 30 once a's lease is stale, naming the packs gc planned to delete
    again = run(b, "commit", str(at3), "--step", "30", "--lock-timeout", "60", "--store", s3_location)
    assert again.returncode == 4 and "removed a stale exclusive lock" in again.stderr, again.stderr
    assert "was taken back: a gc running meanwhile" in again.stderr
    assert steps_seen_by_a_new_host(s3_location, tmp_path / "host-d") == [6]

    resumed = resume(stalled)
    one_line(resumed, 4, "gc stopped before", "lease")
    assert packs_before <= {k for k in s3_server.keys(s3_location) if k.startswith("packs/")}
    assert not [k for k in s3_server.keys(s3_location) if k.startswith("gc/")], "the stopped gc withdrew its notice"
    again = run(b, "commit", str(at3), "--step", "30", "--lock-timeout", "60", "--store", s3_location)
    assert again.returncode == 0, again.stderr
    assert steps_seen_by_a_new_host(s3_location, tmp_path / "host-c") == [6, 30]
    checks_out_as(s3_location, "step=30", at3, tmp_path)


def test_a_step_removed_and_committed_again_is_a_new_manifest_to_every_cache(
    s3_location: str, saves: tuple[Path, Path], tmp_path: Path
) -> None:
    """Found by the simulation on S3: host b committed step 6, host a removed it and committed
    another save as step 6 under the same key (version 1 again). b's cache, which had never seen the
    step gone, took the new object for its own old one, and b's gc deleted the new step's blobs as
    unreferenced. A removed version is reserved now: the new commit is version 2."""
    at3, at6 = saves
    a, b = host_env(tmp_path / "host-a"), host_env(tmp_path / "host-b")
    assert run(a, "init", s3_location).returncode == 0
    assert run(b, "commit", str(at6), "--step", "6", "--store", s3_location).returncode == 0
    assert run(a, "rm", "step=6", "--store", s3_location).returncode == 0
    assert run(a, "commit", str(at3), "--step", "6", "--store", s3_location).returncode == 0
    collected = run(b, "gc", "--store", s3_location)
    assert collected.returncode == 0, collected.stderr
    checks_out_as(s3_location, "step=6", at3, tmp_path)


def test_an_unreachable_server_is_its_own_exit_code(tmp_path: Path) -> None:
    """An unreachable server exited 2, like a typo in a step's name; a script that retries
    on a server's failure could not tell them apart. It is exit 5 now (a backend's failure)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed once the block ends: nothing listens there
    env = host_env(
        tmp_path / "host",
        AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}",
        AWS_ACCESS_KEY_ID="x",
        AWS_SECRET_ACCESS_KEY="x",
        AWS_REGION="us-east-1",
        TAILOR_S3_RETRY_SECONDS="0",
    )
    one_line(run(env, "log", "--store", "s3://bucket/x"), 5, "Check that the server is reachable")
    typo = run(env, "log", "--store", "s3://bucket/../x")
    one_line(typo, 2, "s3://bucket/prefix")


def test_a_failed_commit_takes_back_no_blob_another_hosts_commit_named(
    s3_location: str, saves: tuple[Path, Path], tmp_path: Path
) -> None:
    """Found by the simulation's soak (seed 321 on S3): host b wrote its pack and stopped before its
    manifest's put; host a committed the same save as the same step, naming the blobs of b's pack
    (its sync took the pack's trailer); b resumed, lost the create-only put, and, alone on the store,
    deleted the blobs its own index recorded nowhere: a's reported step lost them. b now brings its
    index up to date under the exclusive lock before it takes anything back."""
    _, at6 = saves
    a, b = host_env(tmp_path / "host-a"), host_env(tmp_path / "host-b")
    assert run(a, "init", s3_location).returncode == 0
    stopped = {**b, "TAILOR_FAILPOINTS": "*/put-create=stop@2", "TAILOR_LOCK_TTL": "120"}  # outlives a's commit
    stalled = start(stopped, "commit", str(at6), "--step", "9", "--store", s3_location)
    wait_stopped(stalled)
    won = run(a, "commit", str(at6), "--step", "9", "--store", s3_location)
    assert won.returncode == 0, won.stderr
    lost = resume(stalled)
    one_line(lost, 2, "already in the store")
    fresh = host_env(tmp_path / "host-fresh")
    checked = run(fresh, "verify", "--deep", "--store", s3_location)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    out = tmp_path / "out"
    assert run(fresh, "checkout", "step=9", "--out", str(out), "--store", s3_location).returncode == 0
    for path in (at6 / "global_step6").iterdir():
        assert (out / "global_step6" / path.name).read_bytes() == path.read_bytes(), path.name


def _three_plain_steps(tmp_path: Path, env: dict[str, str], location: str) -> None:
    """Steps 1, 2 and 3 of a small plain torch save each, step 1 tagged ``w``."""
    import torch

    assert run(env, "init", location).returncode == 0
    for step in (1, 2, 3):
        folder = tmp_path / f"save-{step}"
        folder.mkdir()
        torch.save({"model": {"w": torch.full((64, 64), float(step))}}, folder / "model.pt")
        assert run(env, "commit", str(folder), "--step", str(step), "--store", location).returncode == 0
    assert run(env, "tag", "step=1", "w", "--store", location).returncode == 0


def _tags_and_steps_after_gc(tmp_path: Path, location: str) -> tuple[dict[int, str | None], list[int]]:
    """What a fresh host sees (each step's tag), then the steps a ``gc --keep-last 1`` leaves."""
    fresh = host_env(tmp_path / "host-fresh")
    tags = {step: s["tag"] for step, s in _steps(fresh, location).items()}
    collected = run(fresh, "gc", "--keep-last", "1", "--store", location)
    assert collected.returncode == 0, collected.stderr
    return tags, sorted(_steps(fresh, location))


@pytest.mark.slow  # three hosts' processes a case: seconds the fast tier's minute cannot spare
@pytest.mark.parametrize(
    ("failpoint", "command"),
    [
        ("tag/put-create=stop@2", ("tag", "step=1", "x")),  # a second tag: touches no other
        ("untag/put-if=stop", ("untag", "w")),
        ("rm/put-create=stop@2", ("remove", "step=1", "--force")),  # its lease, then its first drop mark
    ],
    ids=["retag", "untag", "remove"],
)
def test_a_tag_another_host_moved_meanwhile_stays_where_it_was_moved(
    s3_location: str, tmp_path: Path, failpoint: str, command: tuple[str, ...]
) -> None:
    """I2 across hosts: host A drops step 1's tag ``w`` (a retag, an untag, a forced remove) and
    stalls after reading where ``w`` was; host B moves ``w`` to step 2 (``tag --force``, exit 0);
    A goes on. A deleted ``refs/tags/w`` by name, B's reported move was undone, and gc dropped
    step 2. A tag is now dropped only while its object still names the step (FORMAT.md 3.3)."""
    plain = host_env(tmp_path / "host-c", TAILOR_LOCK_TTL="3600")
    _three_plain_steps(tmp_path, plain, s3_location)
    stalled = host_env(tmp_path / "host-a", TAILOR_LOCK_TTL="3600", TAILOR_FAILPOINTS=failpoint)
    a = start(stalled, *command, "--store", s3_location)
    wait_stopped(a)
    other = host_env(tmp_path / "host-b", TAILOR_LOCK_TTL="3600")
    moved = run(other, "tag", "--force", "step=2", "w", "--store", s3_location)
    assert moved.returncode == 0, moved.stderr
    done = resume(a)
    assert done.returncode == 0, done.stderr
    tags, kept = _tags_and_steps_after_gc(tmp_path, s3_location)
    assert tags[2] == "w", tags
    assert 2 in kept and 3 in kept, kept
    if command[0] == "tag":
        assert tags[1] == "x" and 1 in kept, (tags, kept)
    checks = run(host_env(tmp_path / "host-fresh"), "verify", "--store", s3_location)
    assert checks.returncode == 0, checks.stdout + checks.stderr


@pytest.mark.slow
def test_two_hosts_tagging_one_step_at_once_both_keep_their_tag(s3_location: str, tmp_path: Path) -> None:
    """Attack finding M1: host A tags step 1 ``a`` and stalls at its put; host B tags step 1 ``b``
    (exit 0); A goes on (exit 0). Both were reported set, so both must be there: when a step held
    one tag, one of the two objects naming step 1 was invisible, and untagging the other left a
    step that the user thought tagged for gc to drop. Now a step holds any number of tags."""
    plain = host_env(tmp_path / "host-c", TAILOR_LOCK_TTL="3600")
    _three_plain_steps(tmp_path, plain, s3_location)
    stalled = host_env(tmp_path / "host-a", TAILOR_LOCK_TTL="3600", TAILOR_FAILPOINTS="tag/put-create=stop@2")
    a = start(stalled, "tag", "step=1", "a", "--store", s3_location)
    wait_stopped(a)
    other = host_env(tmp_path / "host-b", TAILOR_LOCK_TTL="3600")
    tagged = run(other, "tag", "step=1", "b", "--store", s3_location)
    assert tagged.returncode == 0, tagged.stderr
    done = resume(a)
    assert done.returncode == 0, done.stderr
    fresh = _steps(host_env(tmp_path / "host-fresh"), s3_location)
    assert fresh[1]["tags"] == ["a", "b", "w"], fresh[1]
    for name in ("w", "b"):  # untagging two of them leaves the step tagged by the third
        assert run(plain, "untag", name, "--store", s3_location).returncode == 0
    _, kept = _tags_and_steps_after_gc(tmp_path, s3_location)
    assert kept == [1, 3], kept


@pytest.mark.slow
def test_a_dropped_tag_leaves_a_tombstone_that_tags_nothing_and_stays(s3_location: str, tmp_path: Path) -> None:
    """The tombstone a drop leaves (FORMAT.md 3.3) names no step, is no damage (gc runs), and stays
    until the tag is set again over it: deleted by name (gc did), a delete that landed late took a
    tag another host had just written over the tombstone with it (the third round's finding B)."""
    env = host_env(tmp_path / "host", TAILOR_LOCK_TTL="3600")
    _three_plain_steps(tmp_path, env, s3_location)
    assert run(env, "untag", "w", "--store", s3_location).returncode == 0
    backend = resolve(s3_location).backend
    assert backend.get("refs/tags/w") == b"dropped\n"
    assert all(not s["tags"] for s in _steps(host_env(tmp_path / "fresh"), s3_location).values())
    collected = run(env, "gc", "--store", s3_location)
    assert collected.returncode == 0, collected.stderr
    assert backend.get("refs/tags/w") == b"dropped\n"
    assert run(env, "tag", "step=2", "w", "--store", s3_location).returncode == 0  # over the tombstone
    assert _tag_holders(tmp_path, s3_location)["w"] == 2


@pytest.mark.slow
def test_a_forced_remove_that_loses_its_lease_before_deleting_the_step_leaves_its_tag(
    s3_location: str, tmp_path: Path
) -> None:
    """I2 with I3's removal exception: ``rm --force`` of tagged step 1, stalled past its lease at its
    manifest's deletion, fails; step 1 is still there, so its tag must be too (it dropped the tag
    first, and the next gc dropped the step the reported tag protected)."""
    plain = host_env(tmp_path / "host-c", TAILOR_LOCK_TTL="3600")
    _three_plain_steps(tmp_path, plain, s3_location)
    stalled = host_env(tmp_path / "host-a", TAILOR_FAILPOINTS="rm/delete-many=stop@1")
    a = start(stalled, "remove", "step=1", "--force", "--store", s3_location)
    wait_stopped(a)
    time.sleep(float(TTL) + 2)  # its lease runs out while it is stopped
    done = resume(a)
    assert done.returncode == 4, done.stderr
    tags, kept = _tags_and_steps_after_gc(tmp_path, s3_location)
    assert tags[1] == "w" and 1 in kept, (tags, kept)


def _tag_holders(tmp_path: Path, location: str) -> dict[str, int]:
    """Tag -> the step a fresh host sees it on."""
    fresh = host_env(tmp_path / f"host-fresh-{time.monotonic_ns()}")
    return {tag: step for step, s in _steps(fresh, location).items() for tag in s["tags"]}


def _a_save(tmp_path: Path, name: str, value: float) -> Path:
    import torch

    folder = tmp_path / name
    folder.mkdir()
    torch.save({"model": {"w": torch.full((64, 64), value)}}, folder / "model.pt")
    return folder


def _gc_stopped_at_its_first_delete(tmp_path: Path, location: str) -> subprocess.Popen[str]:
    """A ``gc --keep-last 1`` on host g, stopped once it has marked what it drops and checked their
    refs, at the request that deletes the dropped manifests."""
    g = start(host_env(tmp_path / "host-g", TAILOR_FAILPOINTS="gc/delete-many=stop@1"), "gc", "--keep-last", "1",
              "--store", location)  # fmt: skip
    wait_stopped(g)
    return g


@pytest.mark.slow
def test_a_tag_taken_back_after_a_drop_mark_leaves_another_hosts_move(s3_location: str, tmp_path: Path) -> None:
    """Attack finding F1: host A moves tag X to step 1 and stalls before its put; host C replaces
    step 1 (``commit --force``: the retire mark on its version A names); host B moves X to step 3
    (exit 0). A's put lands, it sees the mark, and takes its write back: it put back what it had
    read before (X on step 2), undoing B's reported move. Its put and its take-back are now
    exactly one swap each: X ends where B put it, or on step 1 only if A reports success."""
    plain = host_env(tmp_path / "host-c", TAILOR_LOCK_TTL="3600")
    _three_plain_steps(tmp_path, plain, s3_location)
    assert run(plain, "tag", "step=2", "X", "--store", s3_location).returncode == 0
    stalled = host_env(tmp_path / "host-a", TAILOR_LOCK_TTL="3600", TAILOR_FAILPOINTS="tag/put-if=stop@1")
    a = start(stalled, "tag", "step=1", "X", "--force", "--store", s3_location)
    wait_stopped(a)
    replaced = run(
        plain, "commit", str(_a_save(tmp_path, "again-1", 9.0)), "--step", "1", "--force", "--store", s3_location
    )
    assert replaced.returncode == 0, replaced.stderr
    moved = run(
        host_env(tmp_path / "host-b", TAILOR_LOCK_TTL="3600"), "tag", "step=3", "X", "--force", "--store", s3_location
    )
    assert moved.returncode == 0, moved.stderr
    done = resume(a)
    holders = _tag_holders(tmp_path, s3_location)
    assert (done.returncode, holders["X"]) in ((0, 1), (4, 3)), (done.returncode, holders, done.stderr)


@pytest.mark.slow
def test_a_pin_reported_set_beside_another_pinners_failure_is_kept(s3_location: str, tmp_path: Path) -> None:
    """Attack finding F2: a gc marks step 2 to drop and stalls; host A pins step 2 and stalls after its
    put, before it reads the marks; host B pins step 2 too. B saw the pin there and wrote and read
    nothing (exit 0); A then saw the mark and deleted the pin, and the next gc dropped the step B
    pinned. Now each pin is a write of its own followed by the read of the marks: whatever each
    reports, a pin reported set is there, and its step survives the next gc."""
    plain = host_env(tmp_path / "host-c", TAILOR_LOCK_TTL="3600")
    _three_plain_steps(tmp_path, plain, s3_location)
    g = _gc_stopped_at_its_first_delete(tmp_path, s3_location)
    a = start(
        host_env(tmp_path / "host-a", TAILOR_LOCK_TTL="3600", TAILOR_FAILPOINTS="ref-written=stop"),
        "pin",
        "step=2",
        "--store",
        s3_location,
    )
    wait_stopped(a)
    b = run(host_env(tmp_path / "host-b", TAILOR_LOCK_TTL="3600"), "pin", "step=2", "--store", s3_location)
    done_a = resume(a)
    time.sleep(float(TTL) + 1)  # the stalled gc's lease runs out: it stops at its fence
    resume(g)
    reported = [r.returncode for r in (done_a, b)]
    fresh = host_env(tmp_path / "host-fresh")
    pinned = 2 in _steps(fresh, s3_location) and _steps(fresh, s3_location)[2]["pinned"]
    assert pinned or 0 not in reported, (reported, b.stderr, done_a.stderr)
    _, kept = _tags_and_steps_after_gc(tmp_path, s3_location)
    assert 2 in kept or 0 not in reported, (reported, kept)


@pytest.mark.slow
def test_a_failed_forced_commit_leaves_a_tag_another_host_moved(s3_location: str, tmp_path: Path) -> None:
    """Attack finding F3: ``commit --force --tag X`` of step 1 published, stalled, and then failed at
    its tag's put (a full disk stands for any failed request) while host B moved X to step 2
    (exit 0). Its take-back wrote X back from its rolled-back index (step 3), undoing B's move. Now
    a take-back touches only what this change wrote: X stays on step 2."""
    plain = host_env(tmp_path / "host-c", TAILOR_LOCK_TTL="3600")
    _three_plain_steps(tmp_path, plain, s3_location)
    assert run(plain, "tag", "step=3", "X", "--store", s3_location).returncode == 0
    stalled = host_env(
        tmp_path / "host-a", TAILOR_LOCK_TTL="3600", TAILOR_FAILPOINTS="after-publish=stop,commit/put-if=enospc@1"
    )
    save = _a_save(tmp_path, "again-1", 7.0)
    a = start(stalled, "commit", str(save), "--step", "1", "--force", "--tag", "X", "--store", s3_location)
    wait_stopped(a)
    moved = run(
        host_env(tmp_path / "host-b", TAILOR_LOCK_TTL="3600"), "tag", "step=2", "X", "--force", "--store", s3_location
    )
    assert moved.returncode == 0, moved.stderr
    done = resume(a)
    assert done.returncode != 0, done.stdout
    assert _tag_holders(tmp_path, s3_location)["X"] == 2


@pytest.mark.slow
def test_a_commit_past_its_lease_gives_no_tag_to_a_step_gc_drops(s3_location: str, tmp_path: Path) -> None:
    """Attack finding F4: ``commit --tag Y`` of step 0 published and stalled past its lease; a gc took
    the lock and planned to drop step 0 (not tagged yet) and stalled before its notices; the commit
    went on, put its tag without a fence or a read of the marks, and reported success; the gc then
    deleted step 0. The tag's put is fenced now, and the marks are read after it. (The gc stops
    here after its marks and their check, at the request that deletes the dropped manifests.)"""
    plain = host_env(tmp_path / "host-c", TAILOR_LOCK_TTL="3600")
    _three_plain_steps(tmp_path, plain, s3_location)
    a = start(
        host_env(tmp_path / "host-a", TAILOR_FAILPOINTS="after-publish=stop"),
        "commit",
        str(_a_save(tmp_path, "zero", 5.0)),
        "--step",
        "0",
        "--tag",
        "Y",
        "--store",
        s3_location,
    )
    wait_stopped(a)
    time.sleep(float(TTL) + 2)  # past the commit's lease
    g = _gc_stopped_at_its_first_delete(tmp_path, s3_location)
    done = resume(a)
    collected = resume(g)
    steps = _steps(host_env(tmp_path / "host-fresh"), s3_location)
    if done.returncode == 0:  # reported committed and tagged: it must be there, tagged
        assert 0 in steps and steps[0]["tags"] == ["Y"], (steps, collected.stderr)
    else:
        assert done.returncode == 4, done.stderr
        assert "Y" not in _tag_holders(tmp_path, s3_location)


@pytest.mark.slow
def test_a_plain_tag_never_overwrites_one_another_host_set_meanwhile(s3_location: str, tmp_path: Path) -> None:
    """Attack finding F5: host A tags step 2 ``X`` (no ``--force``) and stalls before its put; host B
    tags step 3 ``X`` (exit 0); A went on and overwrote it (exit 0). A's put is create-only where
    it read nothing, so it finds B's tag and is refused (exit 2): X stays where B reported it.
    (A stops at its second create-only put: its lease's is the first.)"""
    plain = host_env(tmp_path / "host-c", TAILOR_LOCK_TTL="3600")
    _three_plain_steps(tmp_path, plain, s3_location)
    a = start(
        host_env(tmp_path / "host-a", TAILOR_LOCK_TTL="3600", TAILOR_FAILPOINTS="tag/put-create=stop@2"),
        "tag",
        "step=2",
        "X",
        "--store",
        s3_location,
    )
    wait_stopped(a)
    b = run(host_env(tmp_path / "host-b", TAILOR_LOCK_TTL="3600"), "tag", "step=3", "X", "--store", s3_location)
    assert b.returncode == 0, b.stderr
    done = resume(a)
    assert done.returncode == 2 and "another" in done.stderr, (done.returncode, done.stderr)
    assert _tag_holders(tmp_path, s3_location)["X"] == 3


@pytest.mark.slow
def test_a_gc_past_its_lease_carries_no_ref_over_another_hosts_move(s3_location: str, tmp_path: Path) -> None:
    """The second round's finding B: a ``commit --force`` killed inside its retirement leaves step 1's
    older version holding its tag T; a gc stops at its carry of T to the current version, its lease
    lapses, and host B moves T to step 2 (exit 0); the gc goes on. Carried from its index, it wrote
    T back onto step 1 and then reported failure. It now carries a tag only while the tag's object
    still names the version it carries from."""
    plain = host_env(tmp_path / "host-c", TAILOR_LOCK_TTL="3600")
    _three_plain_steps(tmp_path, plain, s3_location)
    assert run(plain, "tag", "step=1", "T", "--store", s3_location).returncode == 0
    killed = run(
        host_env(tmp_path / "host-k", TAILOR_LOCK_TTL="3600", TAILOR_FAILPOINTS="commit/delete-many=kill@1"),
        "commit", str(_a_save(tmp_path, "again-1", 4.0)), "--step", "1", "--force", "--store", s3_location,
    )  # fmt: skip
    assert killed.returncode == -9, (killed.returncode, killed.stderr)
    assert _tag_holders(tmp_path, s3_location)["T"] == 1
    g = start(
        host_env(tmp_path / "host-g", TAILOR_FAILPOINTS="gc/put-if=stop@1"),
        "gc",
        "--keep-last",
        "5",
        "--store",
        s3_location,
    )
    wait_stopped(g)
    time.sleep(float(TTL) + 1)  # its lease lapses
    moved = run(
        host_env(tmp_path / "host-b", TAILOR_LOCK_TTL="3600"), "tag", "step=2", "T", "--force", "--store", s3_location
    )
    assert moved.returncode == 0, moved.stderr
    resume(g)
    assert _tag_holders(tmp_path, s3_location)["T"] == 2


@pytest.mark.slow
def test_a_pin_written_empty_by_an_older_writer_still_pins(s3_location: str, tmp_path: Path) -> None:
    """The third round's finding C: pins before the tokens were empty objects, and reading a pin with
    a range made every command of such a store fail (a ranged GET of an empty object is 416 on S3
    and SeaweedFS alike). An empty pin pins its step, unpins, and keeps its step from gc."""
    plain = host_env(tmp_path / "host-c", TAILOR_LOCK_TTL="3600")
    _three_plain_steps(tmp_path, plain, s3_location)
    backend = resolve(s3_location).backend
    (two,) = [k for k in backend.list("manifests/main/") if "-00000000000000000002-" in k]
    backend.put("refs/pins/" + two.rsplit("/", 1)[1], b"")  # as the writers before the tokens pinned it
    steps = _steps(host_env(tmp_path / "host-fresh"), s3_location)
    assert steps[2]["pinned"] and not steps[3]["pinned"]
    _, kept = _tags_and_steps_after_gc(tmp_path, s3_location)
    assert kept == [1, 2, 3]
    assert run(plain, "unpin", "step=2", "--store", s3_location).returncode == 0
    assert not _steps(host_env(tmp_path / "host-fresh-2"), s3_location)[2]["pinned"]


@pytest.mark.slow
def test_a_revision_a_gc_adopted_while_it_stalled_is_never_taken_back(s3_location: str, tmp_path: Path) -> None:
    """The third round's finding A: ``commit --force --tag TX`` of tagged, pinned step 1 published its
    new version and stalled past its lease; a gc took that version for the step's current one,
    carried T1 and the pin onto it and deleted the version it replaced; the commit then failed and
    took its version back: step 1 was gone, with its tag and pin. The version stays now."""
    plain = host_env(tmp_path / "host-c", TAILOR_LOCK_TTL="3600")
    _three_plain_steps(tmp_path, plain, s3_location)
    assert run(plain, "tag", "step=1", "T1", "--store", s3_location).returncode == 0
    assert run(plain, "pin", "step=1", "--store", s3_location).returncode == 0
    save = _a_save(tmp_path, "again-1", 8.0)
    x = start(
        host_env(tmp_path / "host-x", TAILOR_FAILPOINTS="after-publish=stop"),
        "commit", str(save), "--step", "1", "--force", "--tag", "TX", "--store", s3_location,
    )  # fmt: skip
    wait_stopped(x)
    time.sleep(float(TTL) + 2)  # past its lease
    collected = run(host_env(tmp_path / "host-g"), "gc", "--keep-last", "5", "--store", s3_location)
    assert collected.returncode == 0, collected.stderr
    done = resume(x)
    steps = _steps(host_env(tmp_path / "host-fresh"), s3_location)
    assert 1 in steps and "T1" in steps[1]["tags"] and steps[1]["pinned"], (done.returncode, done.stderr, steps)
    if done.returncode != 0:
        assert done.returncode == 4 and "stays" in done.stderr, done.stderr
    checks = run(host_env(tmp_path / "host-fresh-2"), "verify", "--store", s3_location)
    assert checks.returncode == 0, checks.stdout + checks.stderr

