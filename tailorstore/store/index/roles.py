"""Role views of the index: each operation sees only the few methods it declares.

The index has some seventy methods, and :mod:`catalogue` declares the forty-odd that operations
may use at all. A wide handle would make every operation able to do everything, with only an
AST test to keep gc from inserting manifests or a report from deleting blobs. Like restic's role
interfaces (``Lister``, ``LoaderUnpacked``, ``MasterIndex``), each operation declares a
small ``Protocol`` of the index methods it needs, at most :data:`MOST_METHODS`, and asks the
repository for it (``Repository.view(Role)``, ``Repository.transaction(Role)``). What it gets
is a :class:`RoleView`: an object that answers those methods and refuses every other name at
run time, so a module that grows a new need says so in its role, where a reviewer sees it.

Recording manifests (inserting a manifest's rows, replacing its contents, setting its tier or
metrics) is in no role: only ``store/publish.py`` does it, on the index itself.
"""

from __future__ import annotations

from typing import TypeVar

from tailorstore.core.roles import RoleView, members
from tailorstore.core.roles import view_as as _view_as

__all__ = ["MOST_METHODS", "PUBLISHING", "RoleView", "members", "view_as"]

MOST_METHODS = 8
"""The most index methods one role may name; a role that needs more is two phases of work."""

R = TypeVar("R")

PUBLISHING = frozenset(
    {
        "add_blobs",
        "delete_commit_at",
        "insert_atoms",
        "insert_files",
        "insert_layers",
        "insert_manifest",
        "replace_contents",
        "set_metrics",
        "set_tier",
    }
)
"""What ``store/publish.py`` alone does to the index: no role outside ``store/`` may name these."""


def view_as(target: object, role: type[R]) -> R:
    """``target`` (the index, or its handle inside a transaction) seen as ``role``."""
    return _view_as(target, role, "the index")
