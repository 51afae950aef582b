"""Named points where a test may stop or slow this process, to show what a stall does.

A host of a shared store can pause at any instruction for minutes (a VM freeze, a long GC
pause, a partition). The tests that show the store survives that need the pause to land at
the moment that matters, in a real process, so the code names those moments::

    TAILOR_FAILPOINTS="before-publish=stop"                 # SIGSTOP this process there
    TAILOR_FAILPOINTS="before-publish=sleep:0.5,gc-before-delete=stop"

Like etcd's gofail. Unknown names and malformed entries are ignored (the variable is input
from outside, read once, at most 1,000 characters); a sleep is at most 600 seconds.
"""

from __future__ import annotations

import os
import signal
import time
from functools import cache

from tailorstore.core.environment import FAILPOINTS_ENV

POINTS = ("before-publish", "gc-before-delete", "gc-repack-written", "before-lease-renewal")


@cache
def _actions() -> dict[str, str]:
    text = os.environ.get(FAILPOINTS_ENV, "")[:1000]
    out = {}
    for entry in text.split(","):
        name, _, action = entry.strip().partition("=")
        if name in POINTS and (action == "stop" or action.startswith("sleep:")):
            out[name] = action
    return out


def failpoint(name: str) -> None:
    """Do what ``TAILOR_FAILPOINTS`` asks at ``name``; nothing, in any real use."""
    action = _actions().get(name)
    if action is None:
        return
    if action == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
        return
    try:
        seconds = float(action[len("sleep:") :])
    except ValueError:
        return
    if 0 <= seconds <= 600:
        time.sleep(seconds)
