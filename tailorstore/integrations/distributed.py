"""Stable name (docs/API.md) of :mod:`tailorstore.integrations.common.distributed`: rank-parallel commits."""

from tailorstore.integrations.common.distributed import RankParallelResult, TorchGroup, commit_rank_parallel, from_rank0

__all__ = ["RankParallelResult", "TorchGroup", "commit_rank_parallel", "from_rank0"]
