"""Named points where a test may stop or slow this process, to show what a stall does.

A host of a shared store can pause at any instruction for minutes (a VM freeze, a long GC
pause, a partition). The tests that show the store survives that need the pause to land at
the moment that matters, in a real process, so the code names those moments::

    TAILOR_FAILPOINTS="before-publish=stop"                 # SIGSTOP this process there
    TAILOR_FAILPOINTS="before-publish=sleep:0.5,gc-before-delete=stop"
    TAILOR_FAILPOINTS="before-part-publish=kill@2"          # SIGKILL at the second time it is reached
    TAILOR_FAILPOINTS="snapshot-file-written=enospc@2"      # the disk full there (OSError ENOSPC)

Every request a backend makes is a failpoint too, named ``OPERATION/KIND``: the operation this
thread runs (:func:`operation`: ``commit``, ``part``, ``finalize``, ``gc``, ``merge``, ``average``, ``run-create``,
``tag``, ``untag``, ``pin``, ``unpin``, ``rm``, ``metric``; ``any`` outside one)
and the request's kind (``put``, ``put-create``, ``get``, ``head``, ``list``, ``delete``,
``delete-many``). A pattern may put ``*`` for either half, and ``@N`` counts the requests that
pattern matched::

    TAILOR_FAILPOINTS="gc/delete-many=stop@2"               # stop gc before its second DeleteObjects
    TAILOR_FAILPOINTS="commit/put-create=kill"              # kill a commit at its manifest's put

:func:`requests_made` counts every request by name, reached or not, for a test or a simulation
to see what an operation sent.

Like etcd's gofail. Unknown names and malformed entries are ignored (the variable is input
from outside, read once, at most 1,000 characters); a sleep is at most :data:`LONGEST_SLEEP`.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import signal
import time
from collections import Counter
from collections.abc import Iterator
from contextvars import ContextVar
from functools import cache

from tailorstore.core.environment import FAILPOINTS_ENV

LONGEST_SLEEP = 600.0  # seconds: a failpoint that asks to sleep longer is malformed, and ignored

POINTS = (
    "before-publish",
    "after-publish",
    "before-part-publish",
    "gc-before-delete",
    "gc-repack-written",
    "before-lease-renewal",
    "snapshot-file-written",  # a staged file written in the background, not yet in its place
    "node-window-fetch",  # a window of a read shared by the node: its lock held, not fetched yet
    "ref-written",  # a tag's or pin's object written, the drop marks not read yet
)
REQUEST_KINDS = ("put", "put-create", "put-if", "get", "head", "list", "delete", "delete-many")
_REQUEST = re.compile(r"(\*|[a-z][a-z-]{0,30})/(\*|[a-z][a-z-]{0,30})")
_reached: dict[str, int] = {}
_requests: Counter[str] = Counter()
_operation: ContextVar[str] = ContextVar("tailor_operation", default="any")


@contextlib.contextmanager
def operation(name: str) -> Iterator[None]:
    """Name the operation this thread runs, for the requests it makes meanwhile."""
    token = _operation.set(name)
    try:
        yield
    finally:
        _operation.reset(token)


def requests_made() -> dict[str, int]:
    """Requests this process sent, by ``OPERATION/KIND``."""
    return dict(_requests)


def request(kind: str) -> None:
    """Called by a backend before each request it sends (``kind``: one of :data:`REQUEST_KINDS`)."""
    op = _operation.get()
    name = f"{op}/{kind}"
    _requests[name] += 1
    actions = _actions()
    if not actions:
        return
    for pattern in (name, f"*/{kind}", f"{op}/*", "*/*"):
        if pattern in actions:
            failpoint(pattern)


@cache
def _actions() -> dict[str, str]:
    text = os.environ.get(FAILPOINTS_ENV, "")[:1000]
    out = {}
    for entry in text.split(","):
        name, _, action = entry.strip().partition("=")
        known = name in POINTS or _REQUEST.fullmatch(name)
        if known and (action.partition("@")[0] in ("stop", "kill", "enospc") or action.startswith("sleep:")):
            out[name] = action
    return out


def failpoint(name: str) -> None:
    """Do what ``TAILOR_FAILPOINTS`` asks at ``name``; nothing, in any real use."""
    action = _actions().get(name)
    if action is None:
        return
    _reached[name] = _reached.get(name, 0) + 1
    action, _, nth = action.partition("@")
    if nth and nth != str(_reached[name]):
        return
    if action in ("stop", "kill"):
        os.kill(os.getpid(), signal.SIGSTOP if action == "stop" else signal.SIGKILL)
        return
    if action == "enospc":  # a full disk where the code writes, as the kernel says it
        raise OSError(errno.ENOSPC, f"No space left on device (TAILOR_FAILPOINTS at {name})")
    try:
        seconds = float(action[len("sleep:") :])
    except ValueError:
        return
    if 0 <= seconds <= LONGEST_SLEEP:
        time.sleep(seconds)
