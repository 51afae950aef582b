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
"""

from __future__ import annotations

import json
import os
import random
import secrets
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from ..environment import TTL_ENV
from ..errors import LockTimeoutError, StoreError
from .backend import Backend

LOCK_PREFIX = "locks/"
DEFAULT_TTL = 120.0


@dataclass(frozen=True)
class Lease:
    key: str
    exclusive: bool
    host: str
    pid: int
    expires: float

    def describe(self) -> str:
        kind = "exclusive" if self.exclusive else "shared"
        return f"{kind} lock of pid {self.pid} on {self.host}"


def lease_ttl() -> float:
    try:
        ttl = float(os.environ.get(TTL_ENV, DEFAULT_TTL))
    except ValueError:
        raise StoreError(f"{TTL_ENV}={os.environ[TTL_ENV]!r} is not a number of seconds") from None
    if not ttl > 0:
        raise StoreError(f"{TTL_ENV} must be more than 0 seconds")
    return ttl


def _read(backend: Backend, key: str) -> Lease | None:
    try:
        doc = json.loads(backend.get(key))
        return Lease(key, bool(doc["exclusive"]), str(doc["host"]), int(doc["pid"]), float(doc["expires"]))
    except FileNotFoundError:
        return None  # released while we listed
    except (ValueError, KeyError, TypeError):
        return Lease(key, True, "?", -1, 0.0)  # unreadable: treated as expired, so removed


def _alive_here(lease: Lease) -> bool:
    if lease.host != socket.gethostname():
        return True  # another host: only its lease time tells
    try:
        os.kill(lease.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _stale(lease: Lease, now: float) -> bool:
    return lease.expires < now or not _alive_here(lease)


class _Renewer(threading.Thread):
    def __init__(self, backend: Backend, key: str, body: Callable[[], bytes], ttl: float) -> None:
        super().__init__(name="tailor-lease", daemon=True)
        self._backend, self._key, self._body, self._ttl = backend, key, body, ttl
        self._halt = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        while not self._halt.wait(self._ttl / 3):
            try:
                self._backend.put(self._key, self._body())
            except BaseException as exc:  # noted; the holder finds out when it checks
                self.error = exc

    def stop(self) -> None:
        self._halt.set()
        self.join()


class LeaseHandle:
    """A held lease; ``try_exclusive`` turns a shared one exclusive if nobody else holds any."""

    def __init__(self, backend: Backend, key: str, exclusive: bool, ttl: float) -> None:
        self.backend, self.key, self.exclusive, self.ttl = backend, key, exclusive, ttl
        self.host, self.pid = socket.gethostname(), os.getpid()

    def body(self) -> bytes:
        now = time.time()
        doc = {
            "exclusive": self.exclusive,
            "host": self.host,
            "pid": self.pid,
            "created": now,
            "expires": now + self.ttl,
        }
        return json.dumps(doc).encode()

    def others(self, on_stale: Callable[[str], None] | None = None) -> list[Lease]:
        """Live leases of other holders that conflict with ours; stale ones are removed."""
        found = []
        for other_key in self.backend.list(LOCK_PREFIX):
            if other_key == self.key:
                continue
            other = _read(self.backend, other_key)
            if other is None:
                continue
            if _stale(other, time.time()):
                self.backend.delete(other_key)
                if on_stale:
                    on_stale(f"removed a stale {other.describe()} ({other_key})")
                continue
            if self.exclusive or other.exclusive:
                found.append(other)
        return found

    def try_exclusive(self) -> bool:
        """Write our lease as exclusive, then look: anyone who listed before sees us on their
        next look, anyone after backs off. Reverts to shared when someone else holds a lease."""
        if self.exclusive:
            return True
        self.exclusive = True
        self.backend.put(self.key, self.body())
        if self.others():
            self.exclusive = False
            self.backend.put(self.key, self.body())
            return False
        return True


@contextmanager
def lease_lock(
    backend: Backend,
    *,
    exclusive: bool,
    timeout: float,
    on_wait: Callable[[str], None] | None = None,
    on_stale: Callable[[str], None] | None = None,
) -> Iterator[LeaseHandle]:
    if not (timeout >= 0 and timeout != float("inf")):
        raise StoreError(f"lock timeout {timeout!r} is not allowed: give a number of seconds, 0 or more.")
    ttl = lease_ttl()
    safe_host = "".join(c if c.isalnum() or c in "._-" else "_" for c in socket.gethostname())[:64] or "host"
    handle = LeaseHandle(backend, f"{LOCK_PREFIX}{safe_host}-{os.getpid()}-{secrets.token_hex(4)}.json", exclusive, ttl)
    deadline = time.monotonic() + timeout
    told = False
    while True:
        backend.put(handle.key, handle.body(), create_only=True)
        blockers = handle.others(on_stale)
        if not blockers:
            break
        backend.delete(handle.key)
        what = "; ".join(b.describe() for b in blockers[:3])
        if not told and on_wait is not None:
            on_wait(f"waiting for the {'exclusive' if exclusive else 'shared'} store lock ({what} holds it)...")
            told = True
        if time.monotonic() >= deadline:
            raise LockTimeoutError(
                f"{backend.location}: could not take the store lock within {timeout:g} s: {what}. Wait for it; a "
                f"holder that died is released when its lease expires (at most {ttl:g} s after it stopped)."
            )
        time.sleep(random.uniform(0.05, 0.3))
    renewer = _Renewer(backend, handle.key, handle.body, ttl)
    renewer.start()
    try:
        yield handle
    finally:
        renewer.stop()
        backend.delete(handle.key)
