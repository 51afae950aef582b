"""Blobs in packs, as restic keeps them: the pack format, writing blobs (dedup, compress, write),
reading a pack's small blobs in few requests, syncing the index with the packs. Below the repository:
packs/ imports only core, the backends, the index and store/codec.py (tests/system/test_layers.py)."""
