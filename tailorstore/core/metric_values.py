"""Metrics recorded with a step (``eval_loss=2.31``), checked the same way wherever they come from.

A step carries its evaluation metrics so that retention can keep the best steps, not only the
newest. They are written into the manifest object, so every host sees them, and read back as
hostile input: at most 64 metrics, each a name of at most 100 characters (letters, digits and
``._-/:``) and a number. A NaN or infinite value is recorded as ``null``: such a step is never
among the best by that metric (gc's keep-best rule, docs/FORMAT.md section 7.3).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from typing import Any

from tailorstore.core.errors import MetricError

MAX_METRICS = 64
MAX_TEXT = 16384
_NAME = re.compile(r"[A-Za-z0-9._/:-]{1,100}")


_NOT_A_NUMBER = ("inf", "infinity", "nan")  # what a recorded non-finite value may be written as


def checked(metrics: Mapping[str, Any] | None, *, strict: bool = True) -> dict[str, float | None]:
    """Metrics as they are recorded: names checked, values floats, NaN and infinities None.

    ``strict`` (recording): a number beyond a float's range (``10**400``, ``1e400``) is refused,
    not stored as null without a word. Reading (``strict=False``) takes such a value as null: a
    manifest object from a stranger holding one must not stop every command of the store."""
    if metrics is None:
        return {}
    if not isinstance(metrics, Mapping) or len(metrics) > MAX_METRICS:
        raise MetricError(f"metrics must be a mapping of at most {MAX_METRICS} names to numbers")
    out: dict[str, float | None] = {}
    for name, value in metrics.items():
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise MetricError(
                f"metric name {str(name)[:40]!r} is not allowed: use 1-100 letters, digits or ._-/: (eval_loss)"
            )
        out[name] = None if value is None else _number(name, value, strict)
    return out


def _number(name: str, value: Any, strict: bool) -> float | None:
    if isinstance(value, bool):
        raise MetricError(f"metric {name}={value} is a boolean, not a number")
    try:
        number = float(value)  # an int, a numpy scalar, or a string the command line passed
    except OverflowError:
        number = math.inf
    except (TypeError, ValueError):
        raise MetricError(f"metric {name}={str(value)[:40]!r} is not a number") from None
    if math.isfinite(number):
        return number
    written_so = isinstance(value, float) or (
        isinstance(value, str) and value.strip().lower().lstrip("+-") in _NOT_A_NUMBER
    )
    if strict and not written_so:
        raise MetricError(f"metric {name}={str(value)[:40]!r} is beyond the range of a number tailorstore records")
    return None


def encode(metrics: Mapping[str, Any] | None) -> str | None:
    """The JSON text an index row and a manifest object hold (None when there are none)."""
    values = checked(metrics)
    return json.dumps(values, sort_keys=True, allow_nan=False) if values else None


def decode(text: str | None) -> dict[str, float | None]:
    """Recorded metrics, read as hostile: anything malformed raises :class:`MetricError`."""
    if text is None:
        return {}
    if not isinstance(text, str) or len(text) > MAX_TEXT:
        raise MetricError("the recorded metrics are not JSON text of at most 16 KiB")
    try:
        doc = json.loads(text, parse_constant=lambda c: None)
    except (ValueError, RecursionError) as exc:
        raise MetricError(f"the recorded metrics are not JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise MetricError("the recorded metrics are not a JSON object")
    return checked(doc, strict=False)


def parse_assignment(text: str) -> tuple[str, float]:
    """``NAME=VALUE`` as the command line gives it."""
    name, sep, value = text.partition("=")
    if not sep:
        raise MetricError(f"{text[:60]!r} is not NAME=VALUE (eval_loss=2.31)")
    name = name.strip()
    return name, checked({name: value.strip()})[name]  # type: ignore[return-value]
