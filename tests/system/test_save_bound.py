"""A save publishes its step or fails within its bound (``TAILOR_SAVE_SECONDS``, core/save_bound.py),
never hangs: a relay in front of the server (moto and SeaweedFS) holds one upload part of a
multipart blob forever, or the PUT of the step's manifest forever, every try of it. The commit
ends with one line naming the request (exit 5), records nothing, and the same commit succeeds
once the server answers again. How long it takes against the bound is measured by
``python -m benchmarks.save_bound`` (docs/benchmarks.md), not asserted here."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from testbed.compare import same_tree
from testbed.local_s3 import LocalS3
from testbed.s3_relay import Relay, Rule
from tests.conftest import CLI, TEST_DATA, one_line

SMALL_SAVE = TEST_DATA / "format1" / "checkpoint"
BOUND = 8  # seconds: well under one request's own timeout (30 s), so only the bound can end the save
HELD = {
    "upload-part": r"/blobs/.*partNumber=2&",  # one part of a blob above the one-PUT limit (64 MiB)
    "manifest": r"/manifests/main/step-",  # the commit point: the manifest's create-only PUT
}


@pytest.fixture(scope="module")
def big_save(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A plain torch.save of one 96 MiB tensor of random values: a blob that goes up in 12 parts."""
    import torch

    folder = tmp_path_factory.mktemp("big") / "save"
    folder.mkdir()
    torch.save({"w": torch.randn(24 << 20, generator=torch.Generator().manual_seed(0))}, folder / "model.pt")
    return folder


def env_for(server: LocalS3, cache: Path, endpoint: str, **extra: str) -> dict[str, str]:
    env = {**os.environ, **server.environ(), "TAILOR_CACHE": str(cache), "AWS_ENDPOINT_URL": endpoint, **extra}
    env.pop("TAILOR_STORE", None)
    return env


@pytest.mark.slow  # real `tailor` processes, and a bound waited out
@pytest.mark.parametrize("held", sorted(HELD))
def test_a_save_whose_request_is_held_forever_fails_within_its_bound_and_records_nothing(
    s3_server: LocalS3, big_save: Path, tmp_path: Path, held: str
) -> None:
    location = s3_server.new_location()
    save = big_save if held == "upload-part" else SMALL_SAVE
    commit = [*CLI, "commit", str(save), "--step", "5", "--store", location, "--quiet"]
    with Relay(s3_server.port) as relay:
        env = env_for(s3_server, tmp_path / "cache", relay.endpoint, TAILOR_SAVE_SECONDS=str(BOUND))
        assert subprocess.run([*CLI, "init", location], env=env, capture_output=True).returncode == 0
        rule = relay.add(Rule("hold", method="PUT", target=HELD[held], times=None))
        proc = subprocess.Popen(commit, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        _, err = proc.communicate(timeout=BOUND + 240)  # it ends: a hang fails the test here
        assert rule.hits, f"the relay never saw the {held} request"
        one_line(subprocess.CompletedProcess(commit, proc.returncode, "", err), 5, "made no progress",
                 "TAILOR_SAVE_SECONDS", "blobs/" if held == "upload-part" else "manifests/main/step-")  # fmt: skip
        assert relay.endpoint in err, "the line names the server"
    assert not [k for k in s3_server.keys(location) if k.startswith("manifests/")], "nothing recorded"

    with Relay(s3_server.port) as answering:  # the server answers again: the same save goes in whole
        env = env_for(s3_server, tmp_path / "cache", answering.endpoint)
        again = subprocess.run(commit, env=env, capture_output=True, text=True, timeout=300)
        assert again.returncode == 0, again.stderr
        out = tmp_path / "out"
        checked = subprocess.run(
            [*CLI, "checkout", "step=5", "--out", str(out), "--store", location], env=env, capture_output=True
        )
        assert checked.returncode == 0, checked.stderr
    if held == "upload-part":
        assert same_tree(out / save.name, save)
    else:  # a DeepSpeed save: its tag folder
        assert same_tree(out / "global_step3", save / "global_step3")


def test_outside_a_save_nothing_is_bounded_and_inside_one_every_request_after_a_stall_fails_at_once(
    s3_server: LocalS3, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The save's other threads, cleanup and lock release end at once once one request stalled."""
    from tailorstore.core.errors import StalledRequestError
    from tailorstore.core.save_bound import bounded, current
    from tailorstore.store.backends.s3 import S3Backend

    monkeypatch.setenv("TAILOR_SAVE_SECONDS", "1")
    with Relay(s3_server.port) as relay:
        monkeypatch.setenv("AWS_ENDPOINT_URL", relay.endpoint)
        backend = S3Backend(s3_server.new_location())
        rule = relay.add(Rule("hold", method="PUT", target="/held", times=None))
        assert current() is None
        with bounded("commit of step 1"):
            backend.put("fine", b"x")
            with pytest.raises(StalledRequestError, match="writing held"):
                backend.put("held", b"x")
            began = time.monotonic()
            with pytest.raises(StalledRequestError, match="nothing more is sent"):
                backend.put("other", b"y")
            assert time.monotonic() - began < 1.0, "no second wait"
        assert current() is None
        backend.put("other", b"y")  # the next save starts afresh
        assert len(rule.hits) == 1, "the abandoned PUT was not sent again"
