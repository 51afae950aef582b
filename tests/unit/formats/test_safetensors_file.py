"""safetensors headers (formats/safetensors_file.py): a malformed one is one clear error."""

from __future__ import annotations

import json
import struct

import pytest

from tailorstore.core.errors import BadCheckpointError
from tailorstore.formats.safetensors_file import parse_header


@pytest.mark.parametrize(
    "header",
    [
        {"w": {"shape": [1]}},
        {"w": ["x"]},
        {"w": {"dtype": "F32", "shape": "ab", "data_offsets": [0, 4]}},
        {"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}},
        {"w": {"dtype": 5, "shape": [1], "data_offsets": [0, 4]}},
        [1, 2],
    ],
)
def test_malformed_safetensors_headers_are_one_clear_error(header: object) -> None:
    raw = json.dumps(header).encode()
    with pytest.raises(BadCheckpointError):
        parse_header(struct.pack("<Q", len(raw)) + raw, "f")
