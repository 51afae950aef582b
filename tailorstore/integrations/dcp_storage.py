"""Stable name (docs/API.md) of :mod:`tailorstore.integrations.dcp.reader`: ``TailorStorageReader``."""

from tailorstore.integrations.dcp.reader import TailorStorageReader

__all__ = ["TailorStorageReader"]
