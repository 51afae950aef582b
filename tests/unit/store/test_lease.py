"""Store locks as leases in the backend, on POSIX and on S3: shared with shared, exclusive
alone, stale leases removed, renewal, and mutual exclusion under contention. The two tests that
wait for lease times run on S3 in the slow tier only, to keep the fast tier under a minute."""

from __future__ import annotations

import json
import os
import re
import socket
import threading
import time

import pytest

from tailorstore.core.errors import LeaseLostError, LockTimeoutError
from tailorstore.core.progress import Silent
from tailorstore.store.backends.base import Backend
from tailorstore.store.backends.location import resolve
from tailorstore.store.backends.posix import PosixBackend
from tailorstore.store.lease import LOCK_PREFIX, lease_lock
from tailorstore.store.repo import Repository
from tests.conftest import tailor


class Heard(Silent):
    """A progress that keeps what the lock said while it waited or cleaned up."""

    def __init__(self, notes: list[str]) -> None:
        self.notes = notes

    def note(self, message: str) -> None:
        self.notes.append(message)


def plant(
    backend: Backend, name: str, *, exclusive: bool, host: str, pid: int, expires: float, created: float | None = None
) -> str:
    """A lease object as its holder writes it: ``created`` and ``expires`` by the holder's clock."""
    key = f"{LOCK_PREFIX}{name}.json"
    created = time.time() if created is None else created
    body = {"exclusive": exclusive, "host": host, "pid": pid, "created": created, "expires": expires}
    backend.put(key, json.dumps(body).encode())
    return key


def test_shared_leases_coexist_and_exclusive_waits_for_them(backend: Backend) -> None:
    waits: list[str] = []
    with lease_lock(backend, exclusive=False, timeout=1), lease_lock(backend, exclusive=False, timeout=1):
        assert len(list(backend.list(LOCK_PREFIX))) == 2
        with pytest.raises(LockTimeoutError, match=r"shared lock of pid \d+ on") as caught:
            with lease_lock(backend, exclusive=True, timeout=0.5, progress=Heard(waits)):
                pass
        assert "lease expires" in str(caught.value)
        assert waits and "waiting for the exclusive store lock" in waits[0]
    assert list(backend.list(LOCK_PREFIX)) == []
    with lease_lock(backend, exclusive=True, timeout=1):
        with pytest.raises(LockTimeoutError):
            with lease_lock(backend, exclusive=False, timeout=0.3):
                pass


@pytest.mark.parametrize("backend", ["posix", pytest.param("s3", marks=pytest.mark.slow)], indirect=True)
def test_stale_leases_are_removed_with_a_message(backend: Backend) -> None:
    # a holder that stopped renewing: its object, written more than its lease time ago (by the server's clock)
    expired = plant(backend, "far-1", exclusive=True, host="far-away", pid=1, expires=time.time() + 0.2)
    if isinstance(backend, PosixBackend):  # the file system's clock: the object written ten seconds ago
        os.utime(backend.path(expired), (time.time() - 10, time.time() - 10))
    else:
        time.sleep(1.3)  # past its 0.2 s lease, and past S3's whole-second Last-Modified
    live = plant(backend, "far-2", exclusive=False, host="far-away", pid=2, expires=time.time() + 60)
    gone_pid = 2**22 + 7  # above pid_max: no such process
    here = socket.gethostname()
    dead_here = plant(backend, "here", exclusive=True, host=here, pid=gone_pid, expires=time.time() + 60)
    notes: list[str] = []
    with lease_lock(backend, exclusive=False, timeout=1, progress=Heard(notes)):
        keys = set(backend.list(LOCK_PREFIX))
        assert expired not in keys and dead_here not in keys and live in keys
    assert any("stale exclusive lock of pid 1 on far-away" in n for n in notes)
    assert any(f"pid {gone_pid}" in n for n in notes)
    with pytest.raises(LockTimeoutError, match="far-away"):  # a live lease of another host is respected
        with lease_lock(backend, exclusive=True, timeout=0.3):
            pass


def test_a_live_lease_of_a_host_whose_clock_is_behind_is_respected_and_named(
    backend: Backend, caplog: pytest.LogCaptureFixture
) -> None:
    """Regression: a healthy host whose clock ran 10 minutes behind wrote leases whose
    ``expires`` had passed by everyone else's clock: gc removed its live lease as stale, and it was
    told that it had stalled. Leases are timed by the server's clock now, and the host is named."""
    import logging

    behind = time.time() - 600
    live = plant(backend, "slow-clock", exclusive=False, host="slow-clock-host", pid=7, created=behind,
                 expires=behind + 120)  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="tailorstore"):
        with pytest.raises(LockTimeoutError, match="slow-clock-host"):
            with lease_lock(backend, exclusive=True, timeout=0.3):
                pass
    assert live in set(backend.list(LOCK_PREFIX)), "its live lease was not removed"
    # (S3 gives Last-Modified in whole seconds)
    assert re.search(r"the clock of host 'slow-clock-host' is (599|600) s behind the store's server", caplog.text)


@pytest.mark.parametrize("backend", ["posix", pytest.param("s3", marks=pytest.mark.slow)], indirect=True)
def test_a_held_lease_is_renewed(backend: Backend, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TAILOR_LOCK_TTL", "0.6")
    with lease_lock(backend, exclusive=True, timeout=1) as handle:
        first = json.loads(backend.get(handle.key))["expires"]
        time.sleep(1.5)  # more than two lease times
        assert json.loads(backend.get(handle.key))["expires"] > first + 0.5
        with pytest.raises(LockTimeoutError):  # still held: not taken for stale
            with lease_lock(backend, exclusive=False, timeout=0.3):
                pass


def test_try_exclusive_only_when_alone(backend: Backend) -> None:
    with lease_lock(backend, exclusive=False, timeout=1) as mine:
        with lease_lock(backend, exclusive=False, timeout=1):
            assert not mine.try_exclusive()
            assert json.loads(backend.get(mine.key))["exclusive"] is False
        assert mine.try_exclusive()
        with pytest.raises(LockTimeoutError):
            with lease_lock(backend, exclusive=False, timeout=0.3):
                pass


@pytest.mark.parametrize("backend", ["posix", pytest.param("s3", marks=pytest.mark.slow)], indirect=True)
def test_gc_fence_lets_takers_back_off_and_stops_for_a_holder(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A shared taker's object stands beside gc's lease between its put and its look; the fence
    must not take it for a holder (CI saw a gc stop so), but must stop for one that stays."""
    monkeypatch.setenv("TAILOR_LOCK_TTL", "6")  # settle = 0.5 s
    stop = threading.Event()
    tries = 0

    def keep_trying() -> None:
        nonlocal tries
        while not stop.is_set():
            tries += 1
            with pytest.raises(LockTimeoutError):  # it retries as a commit does, every 50-300 ms
                with lease_lock(backend, exclusive=False, timeout=0.2):
                    pass

    with lease_lock(backend, exclusive=True, timeout=1) as gc_lease:
        taker = threading.Thread(target=keep_trying)
        taker.start()
        try:
            checks = 0
            deadline = time.monotonic() + 20
            while (checks < 20 or tries < 4) and time.monotonic() < deadline:
                gc_lease.check_alone("gc")
                checks += 1
        finally:
            stop.set()
            taker.join()
        assert tries >= 4
        holder = plant(backend, "far-3", exclusive=False, host="far-away", pid=3, expires=time.time() + 60)
        started = time.monotonic()
        with pytest.raises(LeaseLostError, match="shared lock of pid 3 on far-away took the store lock"):
            gc_lease.check_alone("gc")
        assert 0.5 <= time.monotonic() - started < 5
        backend.delete(holder)


def test_exclusive_leases_exclude_each_other_under_contention(backend: Backend) -> None:
    inside = 0
    most = 0
    entries = 0
    guard = threading.Lock()

    def worker() -> None:
        nonlocal inside, most, entries
        for _ in range(3):
            with lease_lock(backend, exclusive=True, timeout=60):
                with guard:
                    inside += 1
                    entries += 1
                    most = max(most, inside)
                time.sleep(0.02)
                with guard:
                    inside -= 1

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert entries == 12 and most == 1
    assert list(backend.list(LOCK_PREFIX)) == []


@pytest.mark.slow  # seconds: the fast tier keeps its minute
def test_gc_on_s3_waits_for_a_commit_of_another_host(s3_location: str) -> None:
    """A commit in flight on another host holds a shared lease: gc there must not run."""
    Repository.init(s3_location).close()
    backend = resolve(s3_location).backend
    plant(backend, "trainer-7", exclusive=False, host="trainer-7", pid=4242, expires=time.time() + 60)
    proc = tailor("gc", "--lock-timeout", "1", "--store", s3_location)
    assert proc.returncode == 4, proc.stderr
    assert "shared lock of pid 4242 on trainer-7" in proc.stderr and "Traceback" not in proc.stderr
    assert tailor("log", "--store", s3_location).returncode == 0  # readers take no lock


@pytest.mark.parametrize("backend", ["posix"], indirect=True)  # file times are exact; S3's are whole seconds
def test_a_renewed_lease_measures_no_skew_of_its_own_host(
    backend: Backend, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The offset from the server's clock is measured on the write the listed time belongs to, a
    renewal's too: measured against the first write, a healthy host would be told its clock is off."""
    import logging

    from tailorstore.store import lease as lease_module

    monkeypatch.setattr(lease_module, "SKEW_TOLD", 0.3)
    monkeypatch.setenv("TAILOR_LOCK_TTL", "0.9")
    with caplog.at_level(logging.WARNING, logger="tailorstore"):
        with lease_lock(backend, exclusive=False, timeout=1) as handle:
            time.sleep(1.0)  # three renewals
            handle.others()
            assert handle.skew is not None and abs(handle.skew) < 0.2, handle.skew
    assert "the clock of this host" not in caplog.text
