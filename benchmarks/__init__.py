"""tailorstore's benchmark suite: `python -m benchmarks --help`."""
