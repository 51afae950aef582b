"""Megatron-Core: ``dist_checkpointing`` save and load strategies over the store (``strategies``)."""

from tailorstore.integrations.megatron.strategies import (
    MegatronStorageWriter,
    TailorLoadShardedStrategy,
    TailorSaveShardedStrategy,
)

__all__ = ["MegatronStorageWriter", "TailorLoadShardedStrategy", "TailorSaveShardedStrategy"]
