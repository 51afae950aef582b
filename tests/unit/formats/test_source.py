"""An input file's identity (formats/source.py) says what changed between two looks at it."""

from __future__ import annotations

from tailorstore.formats.source import Identity


def test_identity_says_what_changed() -> None:
    base = Identity(1, 2, 100, 5, 6)
    assert base.differs(base) == ""
    assert "replaced" in base.differs(Identity(1, 3, 100, 5, 6))
    assert "size" in base.differs(Identity(1, 2, 99, 5, 6))
    assert "written" in base.differs(Identity(1, 2, 100, 7, 6))
