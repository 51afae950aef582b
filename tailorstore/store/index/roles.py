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

from functools import cache
from typing import Any, Protocol, TypeVar, cast

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


@cache
def members(role: type) -> frozenset[str]:
    """The public names a role protocol declares, its protocol bases' included."""
    names: set[str] = set()
    for klass in role.__mro__:
        if klass is object or klass is Protocol or not getattr(klass, "_is_protocol", False):
            continue
        names.update(n for n in vars(klass) if not n.startswith("_"))
        names.update(n for n in getattr(klass, "__annotations__", {}) if not n.startswith("_"))
    return frozenset(names)


class RoleView:
    """The index as one role sees it: its methods, and nothing else."""

    __slots__ = ("_names", "_role", "_target")

    def __init__(self, target: object, role: type) -> None:
        names = members(role)
        missing = sorted(n for n in names if not hasattr(type(target), n))
        if missing:
            raise TypeError(f"{role.__name__} names what the index does not have: {', '.join(missing)}")
        self._names = names
        self._role = role
        self._target = target

    def __getattr__(self, name: str) -> Any:
        if name in self._names:
            return getattr(self._target, name)
        raise AttributeError(f"{self._role.__name__} offers no {name!r}: add it to the role if the operation needs it")

    def __repr__(self) -> str:
        return f"<{self._role.__name__} view of the index>"


def view_as(target: object, role: type[R]) -> R:
    """``target`` (the index, or its handle inside a transaction) seen as ``role``."""
    return cast(R, RoleView(target, role))
