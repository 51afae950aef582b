"""Object keys (core/object_keys.py): a blob's name is a hash, nothing else."""

from __future__ import annotations

import pytest

from tailorstore.core.errors import CorruptStoreError
from tailorstore.core.object_keys import check_name


@pytest.mark.parametrize("name", ["../../../tmp/x", "ABCDEF" * 5 + "00", "0" * 31, "0" * 33, "g" * 32])
def test_blob_names_must_be_hashes(name: str) -> None:
    with pytest.raises(CorruptStoreError):
        check_name(name)
