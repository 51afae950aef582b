"""Stable name (docs/API.md) of :mod:`tailorstore.integrations.dcp.writer`: ``TailorStorageWriter``."""

from tailorstore.integrations.dcp.writer import TailorStorageWriter

__all__ = ["TailorStorageWriter"]
