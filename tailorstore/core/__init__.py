"""Shared names and pure rules every layer uses: errors, atoms, layers, policies, rounding."""
