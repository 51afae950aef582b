"""Seconds from the environment (core/env_seconds.py): every such variable is read alike."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize(
    ("name", "read", "good", "bad"),
    [
        ("TAILOR_LOCK_TTL", "tailorstore.store.lease:lease_ttl", "90", ["0", "-1", "nan", "inf", "1e9", "ten"]),
        (
            "TAILOR_COLLECTIVE_TIMEOUT",
            "tailorstore.integrations.common.ranks:collective_timeout",
            "1",
            ["0.5", "nan", "inf", "604801", "x"],
        ),
        (
            "TAILOR_S3_RETRY_SECONDS",
            "tailorstore.store.backends.s3:_retry_config",
            "0",
            ["-1", "nan", "inf", "3601", "soon"],
        ),
        ("TAILOR_SAVE_SECONDS", "tailorstore.core.save_bound:bound_seconds", "1", ["0.5", "nan", "inf", "86401", "x"]),
    ],
)
def test_every_seconds_variable_is_read_alike(monkeypatch, name: str, read: str, good: str, bad: list[str]) -> None:
    """One reader of seconds from the environment (core/env_seconds.py): each variable refuses text,
    NaN, infinity and numbers out of its range with the same words, naming itself and its range."""
    import importlib

    from tailorstore.core.errors import StoreError

    module, function = read.split(":")
    reader = getattr(importlib.import_module(module), function)
    monkeypatch.setenv(name, good)
    reader()
    for value in bad:
        monkeypatch.setenv(name, value)
        with pytest.raises(StoreError, match=rf"^{name}='{value}' is not allowed: give seconds (from|more than 0)"):
            reader()
