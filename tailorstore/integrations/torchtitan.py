"""Stable name (docs/API.md) of :mod:`tailorstore.integrations.dcp.torchtitan`: ``TailorCheckpointManager``."""

from tailorstore.integrations.dcp.torchtitan import TailorCheckpointManager

__all__ = ["TailorCheckpointManager"]
