"""What every adapter shares: ranks, the rank ``Session``, rank-parallel commits, rewinds, the ``StoreSession`` seam."""
