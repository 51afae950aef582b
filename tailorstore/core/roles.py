"""Role views: an object seen through a small protocol answers that protocol's names and no others.

The index and the backend are wide (the index has some seventy methods, the backend can delete
anything). Like restic's role interfaces (``Lister``, ``LoaderUnpacked``), each operation declares
the few names it needs as a ``Protocol`` and is handed a :class:`RoleView`, which refuses every
other name at run time: a module that grows a new need says so in its role, where a reviewer sees
it, instead of quietly reaching for a method nobody expected it to call.
"""

from __future__ import annotations

from functools import cache
from typing import Any, Protocol, TypeVar, cast

R = TypeVar("R")


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
    """``target`` as one role sees it: the role's names, and nothing else."""

    __slots__ = ("_names", "_role", "_target", "_what")

    def __init__(self, target: object, role: type, what: str) -> None:
        names = members(role)
        missing = sorted(n for n in names if not hasattr(target, n))
        if missing:
            raise TypeError(f"{role.__name__} names what {what} does not have: {', '.join(missing)}")
        self._names = names
        self._role = role
        self._target = target
        self._what = what

    def __getattr__(self, name: str) -> Any:
        if name in self._names:
            return getattr(self._target, name)
        raise AttributeError(f"{self._role.__name__} offers no {name!r}: add it to the role if the operation needs it")

    def __repr__(self) -> str:
        return f"<{self._role.__name__} view of {self._what}>"


def view_as(target: object, role: type[R], what: str) -> R:
    """``target`` seen as ``role``; ``what`` names the target in messages ("the index")."""
    return cast(R, RoleView(target, role, what))
