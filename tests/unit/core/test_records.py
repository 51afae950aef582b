"""Records (core/records.py): a record from another host takes only values of its fields' types."""

from __future__ import annotations

import pytest

from tailorstore.core.errors import RecordError
from tailorstore.core.records import LayerRecord, ManifestRecord, from_table, record


def rows(*specs: tuple) -> list[ManifestRecord]:
    return [
        ManifestRecord(
            step, origin, 0.0, "deepspeed", None, None, None, "{}", True, 0, 0, "", tag, bool(pinned), id=mid
        )
        for mid, step, origin, tag, pinned in specs
    ]


@pytest.mark.parametrize(
    ("field", "value", "taken"),
    [
        ("stored", 1, True),  # flags are 0/1, as SQL and manifest objects write them
        ("stored", False, False),
        ("stored", 2, "error"),
        ("stored", 1.0, "error"),
        ("change", 3, 3.0),  # JSON writes a whole-number float as an int
        ("change", None, None),
        ("change", "0.1", "error"),
        ("change", True, "error"),
        ("raw_bytes", True, "error"),  # a bool is no count, though Python calls it an int
        ("raw_bytes", 5.0, "error"),
        ("layer", None, "error"),  # not a nullable column
    ],
)
def test_a_record_takes_only_values_of_its_fields_types(field: str, value: object, taken: object) -> None:
    """Manifest objects and parts come from other hosts: each value must be of its column's type."""
    named = {"layer": "block.0", "source": 1, "source_step": 3, "raw_bytes": 8, "stored": 1, "change": None}
    named[field] = value
    if taken == "error":
        with pytest.raises(RecordError, match=f"LayerRecord.{field} is"):
            record(LayerRecord, named)
    else:
        assert getattr(record(LayerRecord, named), field) == taken
    with pytest.raises(RecordError, match="has no source_step"):
        record(LayerRecord, {k: v for k, v in named.items() if k != "source_step"})
    table = {"columns": list(named), "rows": [[*named.values()][:-1]]}
    with pytest.raises(RecordError, match="row has 5 values for 6 columns"):
        from_table(table, LayerRecord)
