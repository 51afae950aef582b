"""Seconds read from an environment variable, as hostile input, with one message for every one.

A timeout, a lease's time to live, a retry budget: each is a number of seconds a user may set in
the environment, and each is input from outside (text, NaN and infinity included). One reader
keeps their bounds checked alike and their refusals worded alike.
"""

from __future__ import annotations

import math
import os

from tailorstore.core.errors import StoreError


def seconds_from_env(name: str, default: float, *, most: float, least: float = 0.0, zero: bool = True) -> float:
    """``$name`` as seconds (``default`` when unset): from ``least`` to ``most``, and more than 0
    where ``zero`` is False. Anything else (text, NaN, infinity) is refused in one line that names
    the variable and the range."""
    text = os.environ.get(name, str(default))[:100]
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    above = seconds > least if not zero and least == 0 else seconds >= least
    if not (above and seconds <= most):  # NaN fails both comparisons
        bounds = f"more than 0 and at most {most:g}" if not zero and least == 0 else f"from {least:g} to {most:g}"
        raise StoreError(f"{name}={text!r} is not allowed: give seconds {bounds}.")
    return seconds
