"""The ranks of one node fetch what they read of an S3 store once (store/packs/node_windows.py).

Each rank is a real process loading a stored DCP step through ``TailorStorageReader`` under
``dcp.load``, as a resume does, with the node's cache folder (``TAILOR_CACHE``) shared and
``LOCAL_WORLD_SIZE`` set as ``torchrun`` sets it; a relay in front of the local S3 server counts
the bytes of every answer.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from testbed.local_s3 import LocalS3
from testbed.s3_relay import Relay
from tests.conftest import CLI, REPO_ROOT

pytestmark = pytest.mark.slow  # real processes on a local S3 server

LOAD = """
import sys, torch, torch.distributed.checkpoint as dcp
from tailorstore.integrations.dcp.reader import TailorStorageReader
saved = torch.load(sys.argv[2])
state = {name: torch.empty_like(t) for name, t in saved.items()}
dcp.load(state, storage_reader=TailorStorageReader(sys.argv[1]))
assert all(torch.equal(state[n], saved[n]) for n in saved), "loaded != saved"
print("loaded", len(state))
"""


def _stored_step(tmp_path: Path, server: LocalS3, endpoint: str) -> tuple[str, Path, dict[str, str]]:
    """A DCP save of 6 MB of random tensors committed to a new S3 store; (location, the tensors, env)."""
    import torch.distributed.checkpoint as dcp

    state = {f"layer{i}.weight": torch.randn(512, 512) for i in range(6)}  # 1 MiB each: several windows
    save = tmp_path / "save"
    dcp.save(state, checkpoint_id=str(save))
    torch.save(state, tmp_path / "saved.pt")
    location = server.new_location()
    env = {**os.environ, **server.environ(), "AWS_ENDPOINT_URL": endpoint, "TAILOR_CACHE": str(tmp_path / "node")}
    env.pop("TAILOR_STORE", None)
    for args in (("init", location), ("commit", str(save), "--step", "1", "--store", location, "--quiet")):
        done = subprocess.run([*CLI, *args], env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
    return location, tmp_path / "saved.pt", env


def _object_bytes(relay: Relay, since: int) -> int:
    """Bytes of the blob and pack objects the server sent after answer ``since``."""
    answered = relay.answered[since:]
    return sum(n for method, target, n in answered if method == "GET" and ("/packs/" in target or "/blobs/" in target))


def _stored_bytes(server: LocalS3, location: str) -> int:
    import boto3

    bucket, prefix = location.removeprefix("s3://").split("/", 1)
    client = boto3.client("s3", **server._client_args())
    listed = client.list_objects_v2(Bucket=bucket, Prefix=prefix + "/")
    return sum(o["Size"] for o in listed.get("Contents", []) if "/packs/" in o["Key"] or "/blobs/" in o["Key"])


def _ranks(env: dict[str, str], location: str, saved: Path, count: int, **extra: str) -> list[subprocess.Popen[str]]:
    return [
        subprocess.Popen(
            [sys.executable, "-c", LOAD, location, str(saved)],
            env={**env, "LOCAL_RANK": str(r), **extra},
            cwd=REPO_ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(count)
    ]


def _finished(procs: list[subprocess.Popen[str]]) -> None:
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0 and "loaded 6" in out, err[-2000:]


@pytest.mark.parametrize("ranks", [2, 4])
def test_the_ranks_of_a_node_fetch_each_stored_byte_once(s3_server: LocalS3, tmp_path: Path, ranks: int) -> None:
    """Every rank loads the whole step (each needs every blob): fetched on their own, the node
    fetches it ``ranks`` times; sharing the node's windows, at most 1.05x the stored bytes once."""
    with Relay(s3_server.port) as relay:
        location, saved, env = _stored_step(tmp_path, s3_server, relay.endpoint)
        stored = _stored_bytes(s3_server, location)
        node = {**env, "LOCAL_WORLD_SIZE": str(ranks)}
        alone = {**env, "TAILOR_CACHE": str(tmp_path / "alone"), "LOCAL_WORLD_SIZE": "1"}

        before = len(relay.answered)
        _finished(_ranks(alone, location, saved, ranks))
        each_alone = _object_bytes(relay, before)

        before = len(relay.answered)
        _finished(_ranks(node, location, saved, ranks))
        shared = _object_bytes(relay, before)
    assert stored > 4 << 20  # several windows of 4 MiB
    assert each_alone >= 0.95 * ranks * stored, (each_alone, stored)  # what the node paid before
    assert shared <= 1.05 * stored, (shared, stored, ranks)
    windows = list((tmp_path / "node").rglob("node-windows/*"))
    assert any(p.suffix == ".lock" for p in windows) and any(p.suffix != ".lock" for p in windows)


def test_a_rank_that_dies_fetching_a_window_leaves_the_others_to_fetch_it(s3_server: LocalS3, tmp_path: Path) -> None:
    """Rank 0 stops holding a window's lock (before its fetch) and is killed; rank 1, waiting on
    that lock, goes on once the dead rank's lock is gone with it, fetches the window itself and
    loads the step whole: a rank waiting on another's fetch never waits on a dead one."""
    with Relay(s3_server.port) as relay:
        location, saved, env = _stored_step(tmp_path, s3_server, relay.endpoint)
        node = {**env, "LOCAL_WORLD_SIZE": "2"}
        (stopped,) = _ranks(node, location, saved, 1, TAILOR_FAILPOINTS="node-window-fetch=stop@1")
        deadline = time.monotonic() + 120
        while Path(f"/proc/{stopped.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "T":
            assert stopped.poll() is None and time.monotonic() < deadline, stopped.communicate()
            time.sleep(0.05)
        (waiting,) = _ranks(node, location, saved, 1)
        time.sleep(3)
        assert waiting.poll() is None, "the second rank should be waiting on the first one's window"
        os.kill(stopped.pid, signal.SIGKILL)
        stopped.wait(timeout=60)
        _finished([waiting])
