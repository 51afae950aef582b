"""PyTorch DCP: the storage writer and reader over the store, and torchtitan's checkpoint manager built on them."""
