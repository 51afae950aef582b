"""Loading torch pickles without running code we do not know.

Checkpoints are pickles, and a pickle can run anything. We load with
``weights_only=True`` and allow exactly the globals that real DeepSpeed and torch
checkpoints use; anything else is refused before it runs, unless the user passed
``--trust-pickles``.
"""

from __future__ import annotations

import enum
import functools
import importlib
import io
import re
import zipfile
from pathlib import Path
from typing import Any

import torch

from tailorstore.core.atom_types import TensorSlot
from tailorstore.core.errors import BadCheckpointError, Call, CorruptStoreError, UnsafePickleError
from tailorstore.formats.torch_pickle import DEEPSPEED_GLOBALS, untrusted

_UNSUPPORTED_GLOBAL = re.compile(r"(?:Unsupported global: GLOBAL|unsupported GLOBAL) ([\w.]+)")


@functools.cache
def allowed_globals() -> tuple[Any, ...]:
    """The allowlist for torch's own loader, resolved; a DeepSpeed class that does not import is left out.

    Only the torch fallback (files the torch-free reader does not take, and re-pickling
    checkout) uses this; it is resolved on first use because importing DeepSpeed costs seconds.
    """
    found: list[Any] = []
    for name in DEEPSPEED_GLOBALS:
        module_name, attr = name.rsplit(".", 1)
        try:
            found.append(getattr(importlib.import_module(module_name), attr))
        except (ImportError, AttributeError):
            continue
    return (*found, (_enum_by_name, "builtins.getattr"))


def _enum_by_name(owner: Any, name: Any) -> Any:
    """``getattr`` as Python 3.11.0-3.11.4 pickle an Enum member, for torch's loader: only a member
    of an allowlisted Enum class, by its name; any other look-up is refused."""
    allowed = [g for g in allowed_globals() if isinstance(g, type)]
    if isinstance(owner, type) and issubclass(owner, enum.Enum) and owner in allowed:
        if isinstance(name, str) and name in owner.__members__:
            return owner.__members__[name]
    raise ValueError(f"getattr({str(owner)[:60]}, {str(name)[:40]!r}) is no enum member on the allowlist")


def load_torch_file(
    path: Path | str, *, trust_pickles: bool = False, mmap: bool = True, where: Path | str | None = None
) -> tuple[Any, bool]:
    """Load a torch checkpoint file as safely as we can; errors name the file (``where``) and what to do.

    Returns the object and whether loading it needed ``trust_pickles``: the safe loader is
    always tried first, so a trusted run only runs unknown code where a file demands it.
    """
    shown = where if where is not None else path
    try:
        return _load(path, shown, trust_pickles=False, mmap=mmap), False
    except UnsafePickleError:
        if not trust_pickles:
            raise
    return _load(path, shown, trust_pickles=True, mmap=mmap), True


_INFLATE_SLACK = 64 << 20  # a compressed record may expand to this, plus 10x the archive


def _check_records(source: Path | str, path: Path | str) -> None:
    """Refuse a zip bomb before torch inflates it: torch.save stores records uncompressed, so a
    record that claims far more bytes than the whole archive holds is not a real checkpoint."""
    with zipfile.ZipFile(source) as z:
        size = sum(i.compress_size for i in z.infolist())
        for info in z.infolist():
            if info.compress_type != zipfile.ZIP_STORED and info.file_size > _INFLATE_SLACK + 10 * size:
                raise BadCheckpointError(
                    f"{path}: zip record {info.filename} inflates to {info.file_size} bytes from {info.compress_size}; "
                    "refusing what looks like a zip bomb (torch.save never compresses records)."
                )


def _load(source: Path | str, path: Path | str, *, trust_pickles: bool, mmap: bool) -> Any:
    if not zipfile.is_zipfile(source):
        raise BadCheckpointError(
            f"{path}: not a torch zip checkpoint (truncated, corrupt, or the legacy format). "
            "Re-save it, or restore it from a good copy."
        )
    try:
        _check_records(source, path)
    except (zipfile.BadZipFile, OSError) as exc:
        raise BadCheckpointError(f"{path}: the zip structure is damaged ({exc}); restore a good copy.") from None
    try:
        if trust_pickles:
            return torch.load(source, map_location="cpu", weights_only=False, mmap=mmap)
        with torch.serialization.safe_globals(list(allowed_globals())):  # inputs: never our TensorSlot
            return torch.load(source, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as exc:  # torch raises several types here; we sort them by message
        text = str(exc)
        match = _UNSUPPORTED_GLOBAL.search(text)
        if match:
            raise UnsafePickleError(
                f"{path}: the pickle needs {match.group(1)}, which is not on tailorstore's allowlist, so it was "
                "not loaded. If you trust this file, run again with ",
                Call(trust_pickles=True),
                ".",
            ) from None
        detail = _detail(text)
        if "Weights only load failed" in text:
            raise UnsafePickleError(
                f"{path}: cannot be read safely as a torch checkpoint ({detail}). It may be truncated or corrupt: "
                "restore it from a good copy. If it is intact and you trust it, run again with ",
                Call(trust_pickles=True),
                ".",
            ) from None
        raise BadCheckpointError(
            f"{path}: cannot be read as a torch checkpoint ({type(exc).__name__}: {detail}). "
            "It may be truncated or corrupt; restore it from a good copy."
        ) from None


def _detail(text: str) -> str:
    """The informative line of torch's long error text."""
    for line in text.splitlines():
        if "WeightsUnpickler error:" in line or "Unsupported" in line:
            return line.strip()[:200]
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return (lines[0] if lines else "no detail")[:200]


def load_skeleton(data: bytes, where: str, *, trusted: bool, trust_pickles: bool) -> Any:
    """Skeletons are our own pickles, but they come off disk: load them as strictly as inputs.

    A skeleton committed with ``--trust-pickles`` holds globals outside the allowlist and
    is only loaded when the user trusts it again.
    """
    if trusted and not trust_pickles:
        raise untrusted(where)
    buf = io.BytesIO(data)
    if trusted:
        return torch.load(buf, map_location="cpu", weights_only=False)
    try:
        with torch.serialization.safe_globals([*allowed_globals(), TensorSlot]):
            return torch.load(buf, map_location="cpu", weights_only=True)
    except Exception as exc:  # the blob's hash matched, so the store holds a skeleton no commit of ours wrote
        match = _UNSUPPORTED_GLOBAL.search(str(exc))
        what = (
            f"needs {match.group(1)}, which is not on the allowlist"
            if match
            else f"does not load ({_detail(str(exc))})"
        )
        raise CorruptStoreError(
            f"{where}: the committed file's structure {what}; no commit of tailorstore wrote it. Run ",
            Call("verify", deep=True),
            ".",
        ) from None
