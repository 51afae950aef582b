"""Blobs in packs, as restic keeps them: the pack format, writing blobs (dedup, compress, write),
reading a pack's small blobs in few requests, syncing the index with the packs, and what a failed write leaves."""
