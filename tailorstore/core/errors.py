"""Exceptions of tailorstore.

Every error a user can cause or meet carries a message that says what to do next, and
maps to a process exit code in the CLI: 2 for bad input or a refused request, 3 for a
damaged store, 4 for a lock that could not be taken.
"""

from __future__ import annotations


class TailorError(Exception):
    """Base of every error that tailorstore raises on purpose."""

    exit_code = 2


class BadCheckpointError(TailorError):
    """The input is not a checkpoint we understand, or a file in it is damaged."""


class UnsafePickleError(BadCheckpointError):
    """A pickle asks for a global outside the allowlist; we refuse to run it."""


class InputChangedError(BadCheckpointError):
    """An input file changed, was replaced or was cut short while a commit read it."""


class LayoutError(BadCheckpointError):
    """DeepSpeed's bookkeeping and the tensors in a file disagree."""


class StoreError(TailorError):
    """The store is missing, or the request does not fit what it holds."""


class StepExistsError(StoreError):
    """A commit would overwrite a step that the store already holds."""


class UnknownStepError(StoreError):
    """A step, tag or selector names nothing in the store."""


class ThinnedStepError(StoreError):
    """What was asked for needs state a retention tier dropped (``tailor gc --thin``)."""


class FormatVersionError(StoreError):
    """The store was written by a format version this program does not read."""


class CorruptStoreError(TailorError):
    """A blob or index row does not match what the store promised."""

    exit_code = 3


class UnsafePathError(TailorError):
    """A recorded path would lead outside the output directory."""


class LockTimeoutError(TailorError):
    """Another tailorstore process held the store lock for too long."""

    exit_code = 4


class LeaseLostError(LockTimeoutError):
    """This process no longer surely holds its store lease (it stalled past the lease, or
    renewing failed), so it stopped before publishing or deleting anything more."""
