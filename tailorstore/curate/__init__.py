"""Keeping a store in shape: merges and averages, gc and thinning, tags, pins and runs."""
