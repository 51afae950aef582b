"""Turning checkpoints into blobs and manifests: commit, parts and finalize, rank-parallel shares."""
