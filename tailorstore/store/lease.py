"""Store locks as lease objects in the backend, so they hold across hosts (after restic).

``flock`` does not cross hosts, and S3 has no locks at all. A process that wants the lock
puts ``locks/<host>-<pid>-<random>.json`` create-only, saying shared or exclusive and
until when it holds (``expires``), then lists ``locks/``:

- a shared taker backs off while any live exclusive lock exists;
- an exclusive taker backs off while any other live lock exists.

Backing off deletes its own object and retries after a random pause, so two exclusive
takers that see each other do not both win, and cannot both lose forever. While held, a
thread renews the lease every third of its time to live. A lock is *stale* when its lease
has expired (its holder died or lost the network) or, on this host, when its process no
longer exists; stale locks are removed by whoever meets them, with a message naming them.
Clocks of the hosts must agree to well within the lease time (default 120 s).

Fencing. A lease alone cannot stop a holder that paused (Kleppmann, 2016): it wakes up
believing it still holds a lock that another host has already removed as stale. So a holder
checks before each step that publishes or deletes (:meth:`LeaseHandle.check`): the renewer
has not failed, the lease it last wrote still runs for at least ``margin`` (a third of the
lease time), and its object still exists. The renewer never brings a lease back: one that
lapsed, or whose object is gone, is lost for good. gc also checks, just before deleting, that
no other live lease appeared (:meth:`LeaseHandle.check_alone`), giving a taker that is backing
off a few seconds to delete its object. docs/FORMAT.md, section 8,
states the timing this relies on.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import re
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from tailorstore.core.env_seconds import seconds_from_env
from tailorstore.core.environment import TTL_ENV
from tailorstore.core.errors import LeaseLostError, LockTimeoutError, StoreError
from tailorstore.core.failpoints import failpoint
from tailorstore.core.progress import Progress
from tailorstore.store.backends.base import Backend

log = logging.getLogger("tailorstore")
LOCK_PREFIX = "locks/"
DEFAULT_TTL = 120.0
MAX_TTL = 86400.0  # a day: a lease that needs longer is a lease that never goes stale
MAX_PID = (1 << 31) - 1
SETTLE_SECONDS = 10.0  # a taker that saw our lease deletes its own within one listing
STAMP_RESOLUTION = 1.0  # seconds: how coarse a backend's object times may be (S3's Last-Modified)
SKEW_TOLD = 10.0  # seconds a host's clock may be off the server's before it is named (S3 times are whole seconds)
_LOCK_KEY = re.compile(r"locks/[A-Za-z0-9._-]+\.json")


@dataclass(frozen=True)
class Lease:
    key: str
    exclusive: bool
    host: str
    pid: int
    expires: float
    created: float = 0.0  # the holder's clock when it wrote the object
    stamp: float | None = None  # the object's Last-Modified: the server's clock when it was written

    @property
    def ttl(self) -> float:
        return self.expires - self.created

    def describe(self) -> str:
        kind = "exclusive" if self.exclusive else "shared"
        return f"{kind} lock of pid {self.pid} on {self.host}"


def lease_ttl() -> float:
    return seconds_from_env(TTL_ENV, DEFAULT_TTL, most=MAX_TTL, zero=False)  # 0 would never go stale


def _unreadable(key: str) -> Lease:
    """A lease no reader can trust, so it counts as expired and whoever meets it removes it."""
    return Lease(key, True, "?", -1, 0.0)


def _read(backend: Backend, key: str, stamp: float | None = None) -> Lease | None:
    """A lease object as a stranger may have written it: a field of the wrong type or out of
    range (a pid no process can have, an expiry beyond any lease time) makes it unreadable,
    and an unreadable lease counts as expired, so whoever meets it removes it."""
    try:
        doc = json.loads(backend.get(key))
        exclusive, host, pid, expires = doc["exclusive"], doc["host"], doc["pid"], doc["expires"]
        created = doc["created"]
    except FileNotFoundError:
        return None  # released while we listed
    except (ValueError, KeyError, TypeError, RecursionError):
        return _unreadable(key)
    readable = (
        isinstance(exclusive, bool)
        and names_a_process(host, pid)
        and isinstance(expires, int | float)
        and isinstance(created, int | float)
        and math.isfinite(expires)
        and math.isfinite(created)
        and 0 < expires - created <= MAX_TTL
    )
    if not readable:
        return _unreadable(key)
    return Lease(key, exclusive, host, pid, float(expires), float(created), stamp)


def names_a_process(host: object, pid: object) -> bool:
    """Whether a stranger's ``host`` and ``pid`` fields can name a process (a lease's, a gc notice's)."""
    return isinstance(host, str) and len(host) <= 255 and isinstance(pid, int) and 0 < pid <= MAX_PID


def process_may_run(host: str, pid: int) -> bool:
    """False only when the process is certainly gone: it ran on this host and its pid is free now.
    A process of another host may always still run (only its lease time tells); a reused pid reads
    as alive, which errs on the safe side."""
    if host != socket.gethostname():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _stale(lease: Lease, server_now: float) -> bool:
    """Timed by the server's clock, never by the holder's: a lease object is rewritten every TTL/3,
    so one the server last wrote more than its TTL ago is stale. Judged by the ``expires`` its
    holder wrote, a healthy host whose clock ran behind would lose its lease to every other host
    (tests/unit/store/test_lease.py, ``test_a_live_lease_of_a_host_whose_clock_is_behind_is_respected_and_named``)."""
    if not process_may_run(lease.host, lease.pid):
        return True
    if lease.stamp is None:  # a backend that gives no times: the holder's own word
        return lease.expires < time.time()
    # S3 gives Last-Modified in whole seconds: a lease renewed a moment ago may read as a second older
    return server_now - lease.stamp > lease.ttl + STAMP_RESOLUTION


class _Renewer(threading.Thread):
    def __init__(self, handle: LeaseHandle) -> None:
        super().__init__(name="tailor-lease", daemon=True)
        self._handle = handle
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.wait(self._handle.ttl / 3):
            failpoint("before-lease-renewal")
            try:
                self._handle.renew()
            except BaseException as exc:  # noted; the holder stops at its next check
                self._handle.renew_error = exc

    def stop(self) -> None:
        self._halt.set()
        self.join()


class LeaseHandle:
    """A held lease; ``try_exclusive`` turns a shared one exclusive if nobody else holds any."""

    by_time = True  # held only while renewed: a stall can outlast it (lock.Fence)

    def __init__(self, backend: Backend, key: str, exclusive: bool, ttl: float) -> None:
        self.backend, self.key, self.exclusive, self.ttl = backend, key, exclusive, ttl
        self.host, self.pid = socket.gethostname(), os.getpid()
        self.margin = ttl / 3  # what must be left of the lease to publish or delete
        self.settle = min(ttl / 12, SETTLE_SECONDS)  # how long a taker backing off may take to go
        self.valid_until = 0.0  # the expiry of the lease object this process last wrote
        # this host's clock just before and after each of its last two writes of its object (a renewal on
        # the renewer's thread may fall between a listing and its reading)
        self.written: tuple[tuple[float, float], ...] = ()
        self.skew: float | None = None  # the server's clock less this host's, from its own object's time
        self._told: set[str] = set()  # hosts whose clock this process has warned about
        self.lost: str | None = None  # why the lease is no longer ours, once it is not
        self.renew_error: BaseException | None = None

    def body(self, now: float | None = None) -> bytes:
        now = time.time() if now is None else now
        doc = {
            "exclusive": self.exclusive,
            "host": self.host,
            "pid": self.pid,
            "created": now,
            "expires": now + self.ttl,
        }
        return json.dumps(doc).encode()

    def write(self, *, create_only: bool = False) -> None:
        """Put the lease object; it runs from the moment before the request was sent."""
        started = time.time()
        self.backend.put(self.key, self.body(started), create_only=create_only)
        self.valid_until = started + self.ttl
        self._wrote(started)

    def _wrote(self, started: float) -> None:
        self.written = (*self.written[-1:], (started, time.time()))

    def renew(self) -> None:
        """One renewal. A lease that lapsed, or whose object another host removed as stale, is
        never brought back: that host may be deleting by now, so the lease is lost."""
        if self.lost is not None:
            return
        started = time.time()
        if started >= self.valid_until:
            self.lost = f"its lease lapsed {started - self.valid_until:.1f} s before it could be renewed"
            return
        if not self.backend.exists(self.key):
            self.lost = "another process removed its lease as stale"
            return
        self.backend.put(self.key, self.body(started))
        self.valid_until = started + self.ttl
        self._wrote(started)

    def check(self, what: str) -> None:
        """Fencing, before ``what`` publishes or deletes: raise :class:`LeaseLostError` unless the
        lease surely holds for ``margin`` more seconds and its object is still in the store."""
        now = time.time()
        why = self.lost
        if why is None and self.renew_error is not None:
            why = f"renewing its lease failed ({self.renew_error})"
        if why is None and now + self.margin > self.valid_until:
            left = self.valid_until - now
            why = f"its lease runs out in {left:.1f} s, less than the {self.margin:g} s it must have left"
        if why is None and not self.backend.exists(self.key):
            why = "another process removed its lease as stale"
        if why is not None:
            self.lost = why
            raise LeaseLostError(
                f"{self.backend.location}: {what} stopped before publishing or deleting anything more: {why} "
                "(this process stalled or lost the store). Nothing it did is visible; run it again."
            )

    def check_alone(self, what: str) -> None:
        """:meth:`check`, and that no other live lease appeared (for gc, before it deletes).

        A taker puts its lease object first and looks second, so for a moment a lease can stand
        beside ours that is only on its way out: it will see ours and delete itself. Each lease is
        given ``settle`` seconds from when it was first seen to go (takers keep coming, so each
        has its own clock); one still there after that is a real holder (ours was taken from us),
        and gc stops. Past three settle times of looking, any lease still there stops it too."""
        self.check(what)
        started = time.monotonic()
        first_seen: dict[str, float] = {}
        while True:
            blockers = self.others()
            now = time.monotonic()
            for lease in blockers:
                first_seen.setdefault(lease.key, now)
            held = [b for b in blockers if now - first_seen[b.key] >= self.settle]
            if held or not blockers or now - started >= 3 * self.settle:
                blockers = held or blockers
                break
            time.sleep(random.uniform(0.05, 0.25))
            self.check(what)
        if blockers:
            self.lost = f"{blockers[0].describe()} took the store lock"
            raise LeaseLostError(
                f"{self.backend.location}: {what} stopped before deleting anything more: {self.lost} while this "
                "process stalled past its lease. Run it again."
            )

    def others(self, progress: Progress | None = None) -> list[Lease]:
        """Live leases of other holders that conflict with ours; stale ones are removed. Each is
        timed by the server's clock (its object's Last-Modified), this host's offset from it
        measured on its own lease object, and a host whose clock is far off is named once."""
        found = []
        listed = dict(self.backend.stamps(LOCK_PREFIX))
        if self.key in listed and self.written:  # the write the listed time is nearest to is the one it saw
            self.skew = min((listed[self.key] - (a + b) / 2 for a, b in self.written), key=abs)
            self._tell_skew(self.host, self.skew, "this host")
        server_now = time.time() + (self.skew or 0.0)
        for other_key, stamp in listed.items():
            if other_key == self.key or not _LOCK_KEY.fullmatch(other_key):
                continue  # a key no lease has (put there by hand) is no lock
            other = _read(self.backend, other_key, stamp)
            if other is None:
                continue
            if other.created:
                self._tell_skew(other.host, stamp - other.created, f"host {other.host!r}")
            if _stale(other, server_now):
                self.backend.delete(other_key)
                if progress is not None:
                    progress.note(f"removed a stale {other.describe()} ({other_key})")
                continue
            if self.exclusive or other.exclusive:
                found.append(other)
        return found

    def _tell_skew(self, host: str, skew: float, whose: str) -> None:
        """One warning per host whose clock is off the server's by more than leases allow for."""
        if abs(skew) <= max(self.margin, SKEW_TOLD) or host in self._told:
            return
        self._told.add(host)
        log.warning(
            "tailorstore: the clock of %s is %.0f s %s the store's server (measured on its lease object); leases "
            "are timed by the server's clock, but fencing needs the hosts' clocks close: set up NTP there",
            whose,
            abs(skew),
            "behind" if skew > 0 else "ahead of",
        )

    def try_exclusive(self) -> bool:
        """Write our lease as exclusive, then look: anyone who listed before sees us on their
        next look, anyone after backs off. Reverts to shared when someone else holds a lease."""
        if self.exclusive:
            return True
        if self.lost is not None:
            return False
        self.exclusive = True
        self.write()
        if self.others():
            self.exclusive = False
            self.write()
            return False
        return True


@contextmanager
def lease_lock(
    backend: Backend,
    *,
    exclusive: bool,
    timeout: float,
    progress: Progress | None = None,
) -> Iterator[LeaseHandle]:
    if not (timeout >= 0 and timeout != float("inf")):
        raise StoreError(f"lock timeout {timeout!r} is not allowed: give a number of seconds, 0 or more.")
    ttl = lease_ttl()
    safe_host = "".join(c if c.isalnum() or c in "._-" else "_" for c in socket.gethostname())[:64] or "host"
    handle = LeaseHandle(backend, f"{LOCK_PREFIX}{safe_host}-{os.getpid()}-{os.urandom(4).hex()}.json", exclusive, ttl)
    deadline = time.monotonic() + timeout
    told = False
    while True:
        handle.write(create_only=True)
        blockers = handle.others(progress)
        if not blockers:
            break
        backend.delete(handle.key)
        what = "; ".join(b.describe() for b in blockers[:3])
        if not told and progress is not None:
            progress.note(f"waiting for the {'exclusive' if exclusive else 'shared'} store lock ({what} holds it)...")
            told = True
        if time.monotonic() >= deadline:
            raise LockTimeoutError(
                f"{backend.location}: could not take the store lock within {timeout:g} s: {what}. Wait for it; a "
                f"holder that died is released when its lease expires (at most {ttl:g} s after it stopped)."
            )
        time.sleep(random.uniform(0.05, 0.3))
    renewer = _Renewer(handle)
    renewer.start()
    try:
        yield handle
    finally:
        renewer.stop()
        backend.delete(handle.key)
