"""tailorstore: a content-addressed, layer-wise store for LLM training checkpoints (DeepSpeed, FSDP/DCP, HF).

``tailorstore.Store`` is the public API (docs/API.md). It is loaded on first use, not by
``import tailorstore``: the ``tailor`` command imports this package for its version, and
``tailor log`` must not pay the two seconds that importing torch costs.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from tailorstore.core.environment import STORE_ENV
from tailorstore.core.errors import (
    LOCK_TIMEOUT,
    BadCheckpointError,
    Call,
    Category,
    CorruptStoreError,
    FormatVersionError,
    InputChangedError,
    LayoutError,
    LeaseLostError,
    LockTimeoutError,
    RankError,
    RanksFailedError,
    StepChangedError,
    StepExistsError,
    StoreError,
    TailorError,
    ThinnedStepError,
    UnknownStepError,
    UnsafePathError,
    UnsafePickleError,
)
from tailorstore.core.progress import Progress, for_terminal

if TYPE_CHECKING:
    from tailorstore.api import Store
    from tailorstore.core.errors import BackendError, BackgroundCommitError
    from tailorstore.core.host_memory import reuse_freed_memory
    from tailorstore.core.records import MAIN_RUN
    from tailorstore.curate.averaging import AverageResult
    from tailorstore.curate.merge import MergeResult
    from tailorstore.store.index.schema import FORMAT_VERSION

# Loaded on first use (the module docstring says why): name -> module. Every result a Store
# method returns is here, and its request and policy types.
_LOADED_ON_USE = {
    "BackgroundCommitError": ".core.errors",
    "reuse_freed_memory": ".core.host_memory",
    "BackendError": ".core.errors",
    "MAIN_RUN": ".core.records",
    "FORMAT_VERSION": ".store.index.schema",  # sqlite3: not for --help and --version
    "Store": ".api",
    "CommitRequest": ".ingest.commit_options",
    "PartPlan": ".ingest.commit_options",
    "MemoryFolder": ".formats.memory_folder",
    "CommitResult": ".ingest.commit_options",
    "FinalizeResult": ".ingest.finalize",
    "RankParallelResult": ".ingest.rank_parallel",
    "Collective": ".ingest.rank_parallel",
    "FolderResult": ".restore.folder_result",
    "CheckoutResult": ".restore.checkout",
    "DcpStep": ".restore.dcp_read",
    "StepObjects": ".restore.file_objects",
    "ReshardResult": ".restore.reshard",
    "UniversalResult": ".restore.universal",
    "ExportResult": ".restore.export",
    "StepSummary": ".report.inspect",
    "StepDetail": ".report.inspect",
    "StepFiles": ".report.inspect",
    "FileSummary": ".report.inspect",
    "LayerSummary": ".report.inspect",
    "DiffResult": ".report.diff",
    "LayerDiff": ".report.diff",
    "Usage": ".report.usage",
    "ReportResult": ".report.page.render",
    "VerifyReport": ".report.verify",
    "GcPlan": ".curate.gc",
    "Retention": ".curate.gc",
    "RunInfo": ".curate.runs",
    "BaseStep": ".curate.runs",
    "AverageResult": ".curate.averaging",
    "MergeResult": ".curate.merge_result",
    "RebuildResult": ".store.repo",
    "PolicySpec": ".core.policies",
    "PolicyError": ".core.errors",
    "Full": ".core.policies",
    "Parity": ".core.policies",
    "Filter": ".core.policies",
    "Adaptive": ".core.policies",
    "Budget": ".core.policies",
}

__version__ = "0.3.0"
__all__ = [
    "FORMAT_VERSION",
    "LOCK_TIMEOUT",
    "MAIN_RUN",
    "STORE_ENV",
    "Adaptive",
    "AverageResult",
    "BackendError",
    "BackgroundCommitError",
    "BadCheckpointError",
    "BaseStep",
    "Budget",
    "Call",
    "Category",
    "CheckoutResult",
    "Collective",
    "CommitRequest",
    "CommitResult",
    "CorruptStoreError",
    "DcpStep",
    "DiffResult",
    "ExportResult",
    "FileSummary",
    "Filter",
    "FinalizeResult",
    "FolderResult",
    "FormatVersionError",
    "Full",
    "GcPlan",
    "InputChangedError",
    "LayerDiff",
    "LayerSummary",
    "LayoutError",
    "LeaseLostError",
    "LockTimeoutError",
    "MemoryFolder",
    "MergeResult",
    "Parity",
    "PartPlan",
    "PolicyError",
    "PolicySpec",
    "Progress",
    "RankError",
    "RankParallelResult",
    "RanksFailedError",
    "RebuildResult",
    "ReportResult",
    "ReshardResult",
    "Retention",
    "RunInfo",
    "StepChangedError",
    "StepDetail",
    "StepExistsError",
    "StepFiles",
    "StepObjects",
    "StepSummary",
    "Store",
    "StoreError",
    "TailorError",
    "ThinnedStepError",
    "UniversalResult",
    "UnknownStepError",
    "UnsafePathError",
    "UnsafePickleError",
    "Usage",
    "VerifyReport",
    "__version__",
    "for_terminal",
    "reuse_freed_memory",
]


def __getattr__(name: str) -> Any:
    if name in _LOADED_ON_USE:
        return getattr(importlib.import_module(_LOADED_ON_USE[name], __name__), name)
    raise AttributeError(f"module 'tailorstore' has no attribute {name!r}")
