"""Thread pools are sized from the cores this process may use (its affinity mask), never from
this machine's constants; ``$TAILOR_THREADS`` and ``threads=`` override them, read as hostile
input; rank-parallel commits divide a node's cores among its ranks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

import tailorstore
from tailorstore.core.threads import compute_threads, decode_threads, sync_threads, usable_cores
from tests.conftest import TEST_DATA

CHECKPOINT = TEST_DATA / "format1" / "checkpoint"
PROBE = """
import json, os, sys
os.sched_setaffinity(0, {int(c) for c in sys.argv[1].split(",")})
from tailorstore.core.threads import compute_threads, decode_threads, sync_threads, usable_cores
print(json.dumps([usable_cores(), compute_threads(), decode_threads(), sync_threads(), compute_threads(share=2)]))
"""


def probe(cores: str, **env: str) -> list[int]:
    environ = {k: v for k, v in os.environ.items() if k != "TAILOR_THREADS"} | env
    done = subprocess.run([sys.executable, "-c", PROBE, cores], capture_output=True, text=True, env=environ, check=True)
    return json.loads(done.stdout)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two usable cores to narrow the mask")
def test_pools_follow_the_affinity_mask() -> None:
    mine = sorted(os.sched_getaffinity(0))
    assert probe(str(mine[0])) == [1, 1, 2, 8, 1]  # one core: one compressing thread
    both = ",".join(str(c) for c in mine[:2])
    assert probe(both) == [2, 2, 4, 16, 1]  # two ranks on two cores: one core each


def test_the_override_sets_the_pools_and_bad_values_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TAILOR_THREADS", "7")
    assert compute_threads() == 7 and decode_threads() == 7 and compute_threads(share=4) == 7
    assert compute_threads(2) == 2, "an argument beats the environment"
    assert sync_threads() == min(64, 8 * usable_cores())  # fsync threads only wait: not the override's business
    for bad in ("0", "-3", "many", "1e9", "99999"):
        monkeypatch.setenv("TAILOR_THREADS", bad)
        with pytest.raises(tailorstore.StoreError, match="TAILOR_THREADS"):
            compute_threads()
    monkeypatch.delenv("TAILOR_THREADS")
    with pytest.raises(tailorstore.StoreError, match="threads=0"):
        decode_threads(0)


def test_a_commit_and_a_checkout_run_the_threads_they_are_given(tmp_path: Path, thread_starts: list[str]) -> None:
    started = thread_starts
    with tailorstore.Store.init(tmp_path / "store") as store:
        store.commit(CHECKPOINT, threads=1)
        blob_threads = {n for n in started if n.startswith("tailor-blob")}
        started.clear()
        store.checkout("latest", tmp_path / "out", threads=1)
        checkout_threads = {n for n in started if n.startswith("tailor-checkout")}
    assert len(blob_threads) == 1, blob_threads
    assert len(checkout_threads) == 1, checkout_threads


class _GatedBatch:
    """The real POSIX batch, whose puts start only once the test opens the gate: the writer's
    threads stay busy through the store's public Backend interface, not a patched method."""

    def __init__(self, batch: object, gate: threading.Event, entered: threading.Semaphore) -> None:
        self._batch, self._gate, self._entered = batch, gate, entered

    def put(self, key: str, chunks: object, size_hint: int = 0) -> None:
        self._entered.release()
        assert self._gate.wait(30), "the test never opened the gate"
        self._batch.put(key, chunks, size_hint)  # type: ignore[attr-defined]

    def __getattr__(self, name: str) -> object:
        return getattr(self._batch, name)


class _GatedBackend:
    def __init__(self, backend: object, gate: threading.Event, entered: threading.Semaphore) -> None:
        self._backend, self._gate, self._entered = backend, gate, entered

    def batch(self) -> _GatedBatch:
        return _GatedBatch(self._backend.batch(), self._gate, self._entered)  # type: ignore[attr-defined]

    def __getattr__(self, name: str) -> object:
        return getattr(self._backend, name)


def test_the_commit_queue_holds_one_piece_beyond_its_threads(tmp_path: Path) -> None:
    """Every queued piece is private memory, fresh pages in a new process: the loop, which reads
    faster than the threads write, waits once the threads are busy and one piece waits. Pieces
    of 2 MiB are objects of their own, so each thread's write reaches the gated put."""
    from tailorstore.store.packs.writer import BlobWriter
    from tailorstore.store.repo import Repository

    repo = Repository.init(tmp_path / "store")
    gate, entered = threading.Event(), threading.Semaphore(0)
    repo.backend = _GatedBackend(repo.backend, gate, entered)  # type: ignore[assignment]
    writer = BlobWriter(repo, threads=2)
    added: list[str] = []

    def feed() -> None:
        for _ in range(6):
            added.append(writer.add(memoryview(os.urandom(2 << 20))))

    feeder = threading.Thread(target=feed)
    feeder.start()
    try:
        assert entered.acquire(timeout=30) and entered.acquire(timeout=30), "both threads reach their put"
        feeder.join(timeout=0.5)  # a bound for what must not happen: the fourth piece is not taken
        assert feeder.is_alive() and len(added) == 3, "two pieces writing and one waiting; the fourth waits for room"
    finally:
        gate.set()
        feeder.join(30)
    assert len(writer.finish()) == 6
