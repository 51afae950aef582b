"""Whether an S3 server honours conditional writes, checked before this host first writes to it.

The store's safety between writers rests on the server: a manifest, a lease, a part, a run and a
gc notice are put create-only (``If-None-Match: *``), so of two hosts publishing one key exactly
one wins (docs/FORMAT.md, section 8). Some S3-compatible servers ignore the header and take both
(``rclone serve s3``; MinIO before its fix answered 304), and then two commits of one step both
"win" and the later silently replaces the former. So before this host first takes a store's lock
on an endpoint, or creates a store there, it probes the server (three PUTs and a DELETE of one
``probe/`` object, past every failpoint: a test's stop at a commit's create-only put is for the
commit's own) and records the answer per endpoint in its cache (``$TAILOR_CACHE/server-*.json``).
A server that ignores ``If-None-Match`` or ``If-Match`` is refused in one line naming it, unless
``TAILOR_SINGLE_WRITER=1`` says that one process at a time writes the store, whose rule
docs/FORMAT.md states ("Servers without conditional writes").

A lost race may come back as 412 PreconditionFailed or as 409 ConditionalRequestConflict (as one
provider answers it); both are the create-only put's refusal (``ObjectExistsError``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Iterable
from pathlib import Path

from tailorstore.core.environment import SINGLE_WRITER_ENV
from tailorstore.core.errors import UnsafeServerError

log = logging.getLogger("tailorstore")
PROBE_PREFIX = "probe/"
PROBE_STALE = 3600.0  # seconds: a probe takes a few requests; one this old was killed before its DELETE


def stale_probes(stamps: Iterable[tuple[str, float]], now: float) -> list[str]:
    """Pure: the ``probe/`` objects written more than :data:`PROBE_STALE` seconds before ``now``,
    which gc takes as a killed commit's temp files (a probe in flight is far younger)."""
    return [key for key, written in stamps if key.startswith(PROBE_PREFIX) and now - written > PROBE_STALE]
_checked: set[str] = set()  # endpoints this process has checked (or was told to trust)


def record_path(cache: Path, endpoint: str) -> Path:
    """A file beside the stores' cache folders (one a location), not a folder of its own."""
    return cache / f"server-{hashlib.sha256(endpoint.encode()).hexdigest()[:16]}.json"


def single_writer() -> bool:
    return os.environ.get(SINGLE_WRITER_ENV, "").strip() == "1"


def check_conditional_writes(backend, cache: Path) -> None:  # type: ignore[no-untyped-def]
    """Refuse to write through a server that ignores conditional writes (its answer recorded once
    per endpoint), unless this process is the store's single writer."""
    endpoint = backend.endpoint or "AWS"
    if endpoint in _checked:
        return
    path = record_path(cache, endpoint)
    answers = _recorded(path, endpoint)
    if answers is None:
        answers = backend.conditional_writes(f"{PROBE_PREFIX}{os.getpid()}-{os.urandom(6).hex()}")
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"endpoint": endpoint, "probed_at": time.time(), **answers}))
        tmp.replace(path)
    ignored = [header for header, honoured in answers.items() if not honoured]
    if ignored and not single_writer():
        raise UnsafeServerError(
            f"{backend.location}: the S3 server at {endpoint} ignores {' and '.join(ignored)} (conditional "
            "writes), so two writers could both publish one step and one would silently replace the other; "
            f"use a server that honours them, or, if one process at a time writes this store, set "
            f"{SINGLE_WRITER_ENV}=1 (docs/FORMAT.md, servers without conditional writes)."
        )
    if ignored:
        log.warning(
            "tailorstore: %s ignores %s; writing anyway because %s=1: one process at a time may write %s",
            endpoint,
            " and ".join(ignored),
            SINGLE_WRITER_ENV,
            backend.location,
        )
    _checked.add(endpoint)


def _recorded(path: Path, endpoint: str) -> dict[str, bool] | None:
    """The answers recorded for ``endpoint``, or None (none, or a record that does not read back)."""
    try:
        doc = json.loads(path.read_text()[:4096])
        answers = {h: doc[h] for h in ("If-None-Match", "If-Match")}
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if doc.get("endpoint") != endpoint or not all(isinstance(v, bool) for v in answers.values()):
        return None
    return answers
