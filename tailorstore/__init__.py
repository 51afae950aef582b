"""tailorstore: a content-addressed, layer-wise store for DeepSpeed training checkpoints."""

from __future__ import annotations

from .store.schema import FORMAT_VERSION

__version__ = "0.2.0"
__all__ = ["FORMAT_VERSION", "__version__"]
