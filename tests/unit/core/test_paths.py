"""Relative paths (core/paths.py): an unsafe path is refused."""

from __future__ import annotations

import pytest

from tailorstore.core.errors import UnsafePathError
from tailorstore.core.paths import check_relative


@pytest.mark.parametrize("rel", ["../x", "a/../../x", "/etc/passwd", "a\\b", "", "a//b", "./a"])
def test_unsafe_paths(rel: str) -> None:
    with pytest.raises(UnsafePathError):
        check_relative(rel)
