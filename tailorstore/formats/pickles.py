"""The one reader of pickles from outside: an unpickler that resolves globals only through an
allowlist made for its load, after a scan that refuses what would make it allocate from nothing.

Every pickle tailorstore reads comes from outside, whatever file holds it: a ``torch.save`` zip's
``data.pkl`` (``formats/torch_pickle.py``: commits, DCP object items at commit and load, the
skeletons of committed files), DCP's ``.metadata`` (``formats/dcp.py``) and what the store gives
back. Each format passes its own allowlist (a new one for every load: FORMAT.md 8.1, I5, since a
pickle's ``BUILD`` can change the objects it reaches) and says how a refused global is worded;
this module holds what they share, so that a rule learnt once (a memo slot past the pickle's
length, protocol 5's buffers, Python 2's names) holds for all of them.

The only other loader of pickles in the library is torch's own ``weights_only`` unpickler in
``formats/safe_load.py``, for the files this reader hands back (compressed records, a dtype it
does not cut), under the same allowlist of names. ``tests/unit/formats/test_pickles.py`` pins both by syntax
tree, and every call site has a fuzz target (``testbed/fuzz_targets.py``).
"""

from __future__ import annotations

import _compat_pickle
import io
import pickle
import pickletools
from collections.abc import Callable, Mapping
from typing import Any

from tailorstore.core.errors import BadCheckpointError

_PUTS = ("PUT", "BINPUT", "LONG_BINPUT")
# protocol 5's buffers: the C unpickler's READONLY_BUFFER over a bytearray left "deallocated bytearray
# object has exported buffers" when a load failed after it (found by benchmarks.fuzz)
_BUFFERS = ("NEXT_BUFFER", "READONLY_BUFFER")
GETATTR = ("builtins", "getattr")  # an Enum member by name (Python 3.11.0-3.11.4): AllowlistUnpickler._member


def check_memo(data: bytes, where: str) -> None:
    """Refuse a pickle that stores into a memo slot past its own length, or uses protocol 5's
    out-of-band buffers, before the C unpickler sees it. It grows its memo to the slot named, so
    ten bytes (``LONG_BINPUT`` of 2**28) had it zero-fill 4.2 GB. A real pickle puts at most one
    memo entry per opcode, so a slot number beyond its length is never one a pickler wrote. Read
    op by op; a pickle this cannot read that way is left for the unpickler to refuse."""
    try:
        for op, arg, _ in pickletools.genops(data):
            if op.name in _BUFFERS:
                raise BadCheckpointError(
                    f"{where}: the pickle uses out-of-band buffers (protocol 5), which torch.save never writes; "
                    "it was not loaded."
                )
            if op.name in _PUTS and isinstance(arg, int) and not 0 <= arg <= len(data):
                raise BadCheckpointError(
                    f"{where}: the pickle stores into memo slot {arg} of a {len(data)}-byte pickle, which no "
                    "pickler writes; the file is damaged or hostile, and was not loaded."
                )
    except ValueError:
        return


def python3_name(module: str, name: str) -> tuple[str, str]:
    """A global as Python 3 names it: protocol 2 (torch.save's) writes Python 2 names
    (``__builtin__.set``), mapped as pickle itself maps them."""
    if (module, name) in _compat_pickle.NAME_MAPPING:
        return _compat_pickle.NAME_MAPPING[(module, name)]
    return _compat_pickle.IMPORT_MAPPING.get(module, module), name


class AllowlistUnpickler(pickle.Unpickler):
    """Loads ``data`` resolving each global through ``allowed`` (``"module.name"`` -> the object
    to use), a mapping made for this load alone; any other global is ``refuse(module, name)``,
    raised before anything runs. A persistent id is refused unless a subclass reads it.

    ``scanned``: the caller has already run :func:`check_memo` on exactly these bytes, or made
    them itself with ``pickle.dumps`` in this process (its memo slots are numbered one by one)."""

    def __init__(
        self,
        data: bytes,
        where: str,
        allowed: Mapping[str, Any],
        refuse: Callable[[str, str], Exception],
        *,
        scanned: bool = False,
    ) -> None:
        if not scanned:
            check_memo(data, where)
        super().__init__(io.BytesIO(data))
        self.where = where
        self.allowed = allowed
        self.refuse = refuse

    def find_class(self, module: str, name: str) -> Any:
        module, name = python3_name(module, name)
        found = self.resolve(module, name)
        if found is None:
            raise self.refuse(module, name)
        return found

    def resolve(self, module: str, name: str) -> Any:
        """The object ``module.name`` stands for in this load, or None (refused). A format whose
        allowlist is not only names (a function bound to this load) overrides it."""
        if (module, name) == GETATTR:
            return self._member
        return self.allowed.get(f"{module}.{name}")

    def _member(self, owner: Any, name: Any) -> Any:
        """``getattr(owner, name)`` as Python 3.11.0-3.11.4 pickle an Enum member (by name; later
        versions call the class with its value): allowed only on an allowlisted class of this load
        whose own class body defines ``by_name`` (the formats' stand-ins), for a public name. A
        pickle's ``BUILD`` cannot give a class that method (it fails on a class), so no other
        attribute of anything is reached."""
        by_name = None
        if isinstance(owner, type) and any(owner is v for v in self.allowed.values()):
            by_name = next((c.__dict__["by_name"] for c in owner.__mro__ if "by_name" in c.__dict__), None)
        if by_name is None or not (isinstance(name, str) and name.isidentifier() and not name.startswith("_")):
            raise BadCheckpointError(
                f"{self.where}: the pickle looks up {str(name)[:40]!r} on {str(owner)[:60]}, which is no enum "
                "member of a class it may name; it was not loaded."
            )
        return by_name.__get__(None, owner)(name)

    def persistent_load(self, pid: Any) -> Any:
        raise BadCheckpointError(f"{self.where}: a persistent id in a pickle of a kind that never holds one")
