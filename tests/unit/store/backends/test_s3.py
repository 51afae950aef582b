"""The S3 backend (store/backends/s3.py): a location's prefix is checked before any request."""

from __future__ import annotations

import pytest

from tailorstore.core.errors import BackendError, StoreError
from tailorstore.store.backends.s3 import S3Backend


@pytest.mark.parametrize("location", ["s3://", "s3:///p", "s3://b/p1/../p2", "s3://b/./p", "s3://b/p1//p2"])
def test_an_s3_location_with_odd_prefix_parts_is_refused_before_any_request(location: str) -> None:
    """S3 keeps '..' and empty parts literally: s3://b/p1/../p2 was a third store, not p2. A name is
    the user's input (exit 2), not a server's failure (BackendError, exit 5)."""
    with pytest.raises(StoreError, match="s3://bucket/prefix") as refused:
        S3Backend(location)
    assert not isinstance(refused.value, BackendError)
