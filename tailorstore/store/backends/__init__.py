"""Where a store's bytes live: the backend interface (base.py), POSIX and S3, the location a user types,
reads and writes around the page cache, and one listing of what a backend holds. The lowest layer of
store/: it imports only core (tests/system/test_layers.py)."""
