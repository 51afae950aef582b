"""Named points where a test may stop or slow this process, to show what a stall does.

A host of a shared store can pause at any instruction for minutes (a VM freeze, a long GC
pause, a partition). The tests that show the store survives that need the pause to land at
the moment that matters, in a real process, so the code names those moments::

    TAILOR_FAILPOINTS="before-publish=stop"                 # SIGSTOP this process there
    TAILOR_FAILPOINTS="before-publish=sleep:0.5,gc-before-delete=stop"
    TAILOR_FAILPOINTS="before-part-publish=kill@2"          # SIGKILL at the second time it is reached

Like etcd's gofail. Unknown names and malformed entries are ignored (the variable is input
from outside, read once, at most 1,000 characters); a sleep is at most 600 seconds.
"""

from __future__ import annotations

import os
import signal
import time
from functools import cache

from tailorstore.core.environment import FAILPOINTS_ENV

POINTS = ("before-publish", "before-part-publish", "gc-before-delete", "gc-repack-written", "before-lease-renewal")
_reached: dict[str, int] = {}


@cache
def _actions() -> dict[str, str]:
    text = os.environ.get(FAILPOINTS_ENV, "")[:1000]
    out = {}
    for entry in text.split(","):
        name, _, action = entry.strip().partition("=")
        if name in POINTS and (action.partition("@")[0] in ("stop", "kill") or action.startswith("sleep:")):
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
    try:
        seconds = float(action[len("sleep:") :])
    except ValueError:
        return
    if 0 <= seconds <= 600:
        time.sleep(seconds)
