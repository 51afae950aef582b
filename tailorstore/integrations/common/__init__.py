"""What every adapter shares: ranks, the rank ``Session``, rank-parallel commits, rewinds, the ``StoreSession`` seam."""

from tailorstore.integrations.common.session import Session
from tailorstore.integrations.common.store_session import StoreSession

__all__ = ["Session", "StoreSession"]
