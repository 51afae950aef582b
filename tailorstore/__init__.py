"""tailorstore: a content-addressed, layer-wise store for DeepSpeed training checkpoints.

``tailorstore.Store`` is the public API (docs/API.md). It is loaded on first use, not by
``import tailorstore``: the ``tailor`` command imports this package for its version, and
``tailor log`` must not pay the two seconds that importing torch costs.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from tailorstore.background import BackgroundCommitError
from tailorstore.core.environment import STORE_ENV
from tailorstore.core.errors import (
    BadCheckpointError,
    CorruptStoreError,
    FormatVersionError,
    InputChangedError,
    LayoutError,
    LockTimeoutError,
    StepExistsError,
    StoreError,
    TailorError,
    ThinnedStepError,
    UnknownStepError,
    UnsafePathError,
    UnsafePickleError,
)
from tailorstore.core.memory import reuse_freed_memory
from tailorstore.core.progress import Progress, for_terminal
from tailorstore.store.backend import BackendError
from tailorstore.store.records import MAIN_RUN
from tailorstore.store.schema import FORMAT_VERSION

if TYPE_CHECKING:
    from tailorstore.api import Store
    from tailorstore.curate.averaging import AverageResult
    from tailorstore.curate.merge import MergeResult

# Loaded on first use (the module docstring says why): name -> module.
_LOADED_ON_USE = {"Store": ".api", "AverageResult": ".curate.averaging", "MergeResult": ".curate.merge"}

__version__ = "0.3.0"
__all__ = [
    "FORMAT_VERSION",
    "MAIN_RUN",
    "STORE_ENV",
    "AverageResult",
    "BackendError",
    "BackgroundCommitError",
    "BadCheckpointError",
    "CorruptStoreError",
    "FormatVersionError",
    "InputChangedError",
    "LayoutError",
    "LockTimeoutError",
    "MergeResult",
    "Progress",
    "StepExistsError",
    "Store",
    "StoreError",
    "TailorError",
    "ThinnedStepError",
    "UnknownStepError",
    "UnsafePathError",
    "UnsafePickleError",
    "__version__",
    "for_terminal",
    "reuse_freed_memory",
]


def __getattr__(name: str) -> Any:
    if name in _LOADED_ON_USE:
        return getattr(importlib.import_module(_LOADED_ON_USE[name], __name__), name)
    raise AttributeError(f"module 'tailorstore' has no attribute {name!r}")
