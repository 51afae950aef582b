"""The environment variables tailorstore reads, in one place (README lists them for users).

No imports here: the ``tailor`` command names them in its help before anything else loads.
"""

STORE_ENV = "TAILOR_STORE"  # the store, when none is given
CACHE_ENV = "TAILOR_CACHE"  # where a remote store's index cache lives
TTL_ENV = "TAILOR_LOCK_TTL"  # seconds before a lock of a host that stopped renewing it goes stale
RETRY_ENV = "TAILOR_S3_RETRY_SECONDS"  # how long failing S3 requests are retried
TIMEOUT_ENV = "TAILOR_S3_TIMEOUT_SECONDS"  # how long one S3 request may take
SAVE_BOUND_ENV = "TAILOR_SAVE_SECONDS"  # how long a save's request may make no progress before the save fails
SINGLE_WRITER_ENV = "TAILOR_SINGLE_WRITER"  # 1: open an S3 store on a server without conditional writes, alone
STAGING_ENV = "TAILOR_STAGING"  # where TailorCheckpointEngine stages a save in memory (default /dev/shm)
THREADS_ENV = "TAILOR_THREADS"  # threads of the compressing and decoding pools (default: from the usable cores)
COLLECTIVE_TIMEOUT_ENV = "TAILOR_COLLECTIVE_TIMEOUT"  # seconds one of our collectives waits for the other ranks
PART_AGE_ENV = "TAILOR_DROP_PARTS_AFTER"  # seconds a part waits for its finalize before gc --drop-parts takes it
TRY_ENV = "TAILOR_TRY"  # a token every host's part of one try of a save shares (store/parts.py)
FAILPOINTS_ENV = "TAILOR_FAILPOINTS"  # tests only: stop or slow this process at a named point (failpoints.py)
