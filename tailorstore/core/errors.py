"""Exceptions of tailorstore, and what they tell a user to do next.

Every error a user can cause or meet says what is wrong and what to do next, and carries a
:class:`Category` (bad input or a refused request, a damaged store, a lock), which is all a
front end needs to decide how to end: the command line turns it into an exit code (2, 3, 4),
a training script catches the classes.

What to do next is often another operation, or the same one with an option: "run verify",
"pass force=True". The library does not know the command line, so such a step is a
:class:`Call`, a part of the message that each front end names its own way: the API as a
call (``verify(deep=True)``, ``force=True``), the command line as a command or a flag
(``tailor verify --deep``, ``--force``). A message is a sequence of text and calls.
"""

from __future__ import annotations

import errno
from collections.abc import Callable, Iterable, Mapping
from enum import Enum
from typing import ClassVar


class Category(Enum):
    BAD_INPUT = "bad input"  # the input or the request: change it and try again
    DAMAGED_STORE = "damaged store"  # the store does not hold what it promised: verify, repair
    LOCK = "lock"  # another process holds the store, or this one lost its hold on it
    BACKEND = "backend"  # the store's server or disk failed or refused (unreachable, denied): check it, retry


# Which category a failure of several parts takes: the one that asks most of the user. A damaged
# store needs a repair whatever else failed, a lock clears on its own, a backend needs a retry.
SEVERITY = (Category.DAMAGED_STORE, Category.LOCK, Category.BACKEND, Category.BAD_INPUT)


class Call:
    """An operation of the public API with its arguments (``operation`` None: the call at hand,
    with other options). Arguments are shown as given: ``Call("commit", "DIR", part=True)``,
    ``Call(step="N")``. Each front end names it: :meth:`as_api` here, the command line its own."""

    def __init__(self, operation: str | None = None, *args: str, **options: object) -> None:
        self.operation, self.args, self.options = operation, args, options

    def as_api(self) -> str:
        options = [f"{k}={v}" for k, v in self.options.items()]
        if self.operation is None:
            return " and ".join(f"`{o}`" for o in options)
        return f"`{self.operation}({', '.join([*self.args, *options])})`"

    def __repr__(self) -> str:
        return f"Call({self.operation!r}, {self.args!r}, {self.options!r})"


Part = str | Call


class TailorError(Exception):
    """Base of every error that tailorstore raises on purpose. Its message is made of ``parts``:
    text, and :class:`Call` parts that name an operation; ``str()`` names them as the API does."""

    category: ClassVar[Category] = Category.BAD_INPUT

    def __init__(self, *parts: Part) -> None:
        self.parts: tuple[Part, ...] = parts
        super().__init__(self.render(Call.as_api))

    def render(self, name: Callable[[Call], str]) -> str:
        """The message, each call named by ``name`` (a front end's way of naming operations)."""
        return "".join(p if isinstance(p, str) else name(p) for p in self.parts)

    def calls(self) -> Iterable[Call]:
        return (p for p in self.parts if isinstance(p, Call))

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (type(self), self.parts)  # pickled whole (a rank hands its error to the others)


class BadCheckpointError(TailorError):
    """The input is not a checkpoint we understand, or a file in it is damaged."""


class UnsafePickleError(BadCheckpointError):
    """A pickle asks for a global outside the allowlist; we refuse to run it."""

    needs: str | None = None  # the global refused (``module.name``), where one was


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
    """What was asked for needs state a retention tier dropped (gc's thinning)."""


class FormatVersionError(StoreError):
    """The store was written by a format version this program does not read."""


class ObjectExistsError(StoreError):
    """A create-only put found an object under that key already."""


class BackendError(StoreError):
    """The backend failed (unreachable server, refused credentials, a missing bucket, I/O error):
    its own category, not bad input, so a script can tell a typo from a server to retry."""

    category = Category.BACKEND


class StalledRequestError(BackendError):
    """A request of a save made no progress within the save's bound (``TAILOR_SAVE_SECONDS``,
    core/save_bound.py): the save failed, naming it, rather than hang."""


class UnsafeServerError(BackendError):
    """The S3 server ignores conditional writes (``If-None-Match``, ``If-Match``), which the store's
    safety between writers rests on (store/backends/conditional.py)."""


class MergeSpecError(TailorError):
    """The merge spec is malformed or names what the store does not hold."""


class MetricError(StoreError):
    """A metric that cannot be recorded or read: a bad name, a value that is not a number."""


class MissingDependencyError(TailorError):
    """An optional package a command needs is not installed (``pip install 'tailorstore[EXTRA]'``):
    the user's setup, not a bug, so one line and the bad-input exit, never an ImportError's traceback."""

    def __init__(self, what: str, package: str, extra: str | None) -> None:
        self.needed = (what, package, extra)  # extra None: a dependency of every install, gone missing
        install = f"'tailorstore[{extra}]'" if extra else package
        super().__init__(f"{what} needs {package}, which is not installed: pip install {install}")

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (type(self), self.needed)


class PolicyError(TailorError):
    """A policy name or parameter is wrong."""


class StagingFailed(StoreError):
    """A rank could not write a file into staging and wrote it where DeepSpeed writes it."""


class BackgroundCommitError(TailorError):
    """A commit that ran in the background failed; its cause is chained."""


class CorruptStoreError(TailorError):
    """A blob or index row does not match what the store promised."""

    category = Category.DAMAGED_STORE


class BlobMissingError(CorruptStoreError):
    """A blob a manifest names is not in the backend."""


class StepChangedError(TailorError):
    """The step being read was removed or replaced by another process meanwhile: a race, not damage;
    reading again reads what the store holds now."""

    category = Category.LOCK


class UnsafePathError(TailorError):
    """A recorded path would lead outside the output directory."""


class RecordError(ValueError):
    """A row of a manifest object or part that is not a record of its kind: the object is damaged
    (or was written by hand). Raised before anything of it reaches the index. A ValueError, not a
    TailorError: no user meets it, as the reader of the object turns it into a :class:`CorruptStoreError`
    naming the object (store/manifests/document.py, store/parts.py)."""


def first_line(exc: BaseException) -> str:
    """An error's first line, at most 300 characters, for a warning or a message (a backend's retry
    error spans many lines)."""
    return str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__


def is_out_of_space(exc: OSError) -> bool:
    """Whether a failed write means the disk (or the quota) is full: said as such, not as a failure
    of the store, wherever bytes are written (the blob writer, the publisher, an output folder)."""
    return exc.errno in (errno.ENOSPC, errno.EDQUOT)


LOCK_TIMEOUT = 600.0  # seconds an operation waits for the store lock unless told otherwise


class LockTimeoutError(TailorError):
    """Another tailorstore process held the store lock for too long."""

    category = Category.LOCK


class LeaseLostError(LockTimeoutError):
    """This process no longer surely holds its store lease (it stalled past the lease, or
    renewing failed), so it stopped before publishing or deleting anything more."""


class RanksFailedError(TailorError):
    """Work of a job's ranks failed on one rank or more, raised alike on every rank
    (``integrations/common/session.py``). ``failures`` holds each failed rank's own error, whole, by
    global rank; the category is the most severe of theirs (:data:`SEVERITY`), so the exit code
    is the one the worst failure alone would give."""

    MOST_SHOWN = 4  # distinct messages shown; a thousand ranks failing alike make one line

    def __init__(self, failures: Mapping[int, TailorError], doing: str = "") -> None:
        self.failures: dict[int, TailorError] = dict(sorted(failures.items()))
        self.doing = doing
        worst = min((SEVERITY.index(e.category) for e in self.failures.values()), default=len(SEVERITY) - 1)
        self.category = SEVERITY[worst]  # type: ignore[misc]
        super().__init__(*self._parts())

    def _parts(self) -> list[Part]:
        alike: dict[str, list[int]] = {}
        for rank, error in self.failures.items():
            alike.setdefault(str(error), []).append(rank)
        parts: list[Part] = [f"{self.doing} failed" if self.doing else "failed"]
        for i, ranks in enumerate(list(alike.values())[: self.MOST_SHOWN]):
            shown = ", ".join(map(str, ranks[:8])) + (f" and {len(ranks) - 8} more" if len(ranks) > 8 else "")
            parts += [";" if i else "", f" on rank{'s' if len(ranks) > 1 else ''} {shown}: "]
            parts += self.failures[ranks[0]].parts
        if len(alike) > self.MOST_SHOWN:
            parts.append(f"; and {len(alike) - self.MOST_SHOWN} other failures")
        return parts

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (type(self), (self.failures, self.doing))


class RankError(StoreError):
    """An exception that is not tailorstore's, raised by one rank's share of work several ranks do,
    as the other ranks receive it (a member of :class:`RanksFailedError`). ``original`` is the
    exception itself, whole (its class, its arguments, an ``OSError``'s ``errno`` and file name),
    wherever it survives pickling, so a caller can still tell a ``KeyError`` from a ``ValueError``
    on any rank; ``kind`` names its class either way. Its traceback stays on the rank it was raised
    on, chained there. Built by :meth:`of`."""

    def __init__(self, kind: str, message: str, original: BaseException | None = None) -> None:
        self.kind, self.message, self.original = kind, message, original
        super().__init__(f"{kind}: {message}")

    @classmethod
    def of(cls, exc: BaseException) -> RankError:
        """``exc`` as it crosses ranks: a :class:`RankBackendError` for an ``OSError`` (a disk or a
        server failed: its own category), else a :class:`RankError`."""
        kind = RankBackendError if isinstance(exc, OSError) else RankError
        return kind(type(exc).__name__, str(exc), _survives_pickling(exc))

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (type(self), (self.kind, self.message, self.original))


class RankBackendError(RankError, BackendError):
    """A rank's ``OSError``, as the other ranks receive it: a backend failure (exit 5), whole."""


def _survives_pickling(exc: BaseException) -> BaseException | None:
    """``exc`` when it pickles and comes back as its own class (one whose ``__init__`` takes other
    arguments than it stores does not), else None: the message and class name then say it all."""
    import pickle

    try:
        again = pickle.loads(pickle.dumps(exc))
    except Exception:
        return None
    return exc if type(again) is type(exc) else None
