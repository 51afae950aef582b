"""A job's ranks as a session (integrations/common/session.py): a decision made on global rank 0 is
every rank's, and a failure crosses ranks whole, by rank, as :class:`RanksFailedError` whose
category (and so exit code) is its worst member's. Two real gloo processes."""

from __future__ import annotations

import json
import os
import pickle
import socket
from pathlib import Path

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp
from tailorstore.cli.naming import EXIT_CODES

from tailorstore.core.errors import (
    BackendError,
    BadCheckpointError,
    Call,
    Category,
    CorruptStoreError,
    LockTimeoutError,
    RanksFailedError,
    StoreError,
    UnknownStepError,
)
from tailorstore.integrations.common.session import Session

pytestmark = pytest.mark.slow  # two spawned gloo processes


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _failures(call) -> dict:  # type: ignore[no-untyped-def]
    try:
        call()
    except RanksFailedError as exc:
        return {
            "failures": {str(r): [type(e).__name__, str(e)] for r, e in exc.failures.items()},
            "category": exc.category.value,
            "message": str(exc),
        }
    return {"failures": None}


def _worker(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    session = Session.open()
    found: dict = {"decided": session.decide(lambda: f"decided on rank {rank}")}

    def missing() -> None:
        raise UnknownStepError("step 6 is not in run 'main'; see ", Call("log"))

    found["decide"] = _failures(lambda: session.decide(missing, "resuming"))

    def each() -> int:
        if rank == 0:
            raise LockTimeoutError("the store lock is held")
        raise CorruptStoreError("blob 1f2e is damaged")

    found["each"] = _failures(lambda: session.each(each))

    def disk() -> None:
        if rank == 1:
            raise OSError(28, "No space left on device")

    found["os"] = _failures(lambda: session.each(disk, "writing"))
    try:  # the OSError itself crossed the ranks, not its text alone
        session.each(disk, "writing")
    except RanksFailedError as exc:
        shipped = exc.failures[1]
        original = getattr(shipped, "original", None)
        found["os_original"] = [
            isinstance(shipped, BackendError), type(original).__name__, getattr(original, "errno", None),
        ]  # fmt: skip

    def bad_value() -> None:
        if rank == 0:
            raise KeyError("layers.3.weight")

    try:
        session.decide(bad_value, "planning")
    except RanksFailedError as exc:
        found["key_original"] = repr(getattr(exc.failures[0], "original", None))
    found["values"] = session.each(lambda: rank * 10)
    found["own"] = session.all_or_none(lambda: rank * 10)

    # the rank-parallel commit's collective and the DCP reader's resolution go through the session too
    from tailorstore.integrations.common.distributed import TorchGroup, from_rank0

    undone: list[int] = []

    def survey() -> int:
        if rank == 1:
            raise LockTimeoutError("the store lock is held by gc")
        return 7

    group = TorchGroup(None)
    found["together"] = _failures(lambda: group.together(survey, "surveying its files", undo=undone.append))
    found["undone"] = undone
    found["from_rank0"] = _failures(lambda: from_rank0(missing, None, "resolving 'latest'"))
    Path(out, f"rank{rank}.json").write_text(json.dumps(found))
    dist.destroy_process_group()


def test_a_session_ships_rank_0s_decision_and_every_failure_whole_to_every_rank(tmp_path: Path) -> None:
    mp.start_processes(_worker, args=(_free_port(), str(tmp_path)), nprocs=2, start_method="spawn")
    seen = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    own = ("own", "undone")  # what stays with each rank
    shared = [{k: v for k, v in one.items() if k not in own} for one in seen]
    assert shared[0] == shared[1], "every rank holds the same decision and the same failures"
    got = seen[1]
    assert got["decided"] == "decided on rank 0"
    assert got["decide"]["failures"] == {"0": ["UnknownStepError", "step 6 is not in run 'main'; see `log()`"]}
    assert got["decide"]["message"] == "resuming failed on rank 0: step 6 is not in run 'main'; see `log()`"
    assert got["decide"]["category"] == Category.BAD_INPUT.value
    assert got["each"]["failures"] == {
        "0": ["LockTimeoutError", "the store lock is held"],
        "1": ["CorruptStoreError", "blob 1f2e is damaged"],
    }
    assert got["each"]["category"] == Category.DAMAGED_STORE.value, "the worst failure decides"
    assert got["os"]["failures"] == {"1": ["RankBackendError", "OSError: [Errno 28] No space left on device"]}
    assert got["os"]["category"] == Category.BACKEND.value, "a rank's OSError is a backend failure (exit 5)"
    assert got["os_original"] == [True, "OSError", 28], "the rank's OSError itself, on every rank"
    assert got["key_original"] == "KeyError('layers.3.weight')", "any other exception crosses whole too"
    assert got["values"] == [0, 10]
    assert [s["own"] for s in seen] == [0, 10], "all_or_none ships outcomes, not results"
    assert got["together"]["failures"] == {"1": ["LockTimeoutError", "the store lock is held by gc"]}
    assert got["together"]["category"] == Category.LOCK.value, "a lock timeout stays a lock timeout (exit 4)"
    assert seen[0]["undone"] == [7] and seen[1]["undone"] == [], "the member whose work held undoes it"
    assert got["from_rank0"]["failures"] == {"0": ["UnknownStepError", "step 6 is not in run 'main'; see `log()`"]}


def test_an_exception_that_is_not_tailorstores_crosses_ranks_whole() -> None:
    """Issue: the house, third step, item 3. An exception of another library was shipped as a
    StoreError naming its type in text; a caller on another rank could not tell what it was."""
    from tailorstore.core.errors import RankBackendError, RankError

    class Unpicklable(Exception):
        def __init__(self, a: int, b: int) -> None:
            super().__init__(a + b)  # stores one argument, takes two: it does not come back

    for raised, kind, original in [
        (ValueError("bad shape"), RankError, ValueError),
        (FileNotFoundError(2, "gone", "/dev/shm/x"), RankBackendError, FileNotFoundError),
        (Unpicklable(1, 2), RankError, type(None)),
    ]:
        shipped = pickle.loads(pickle.dumps(RankError.of(raised)))
        assert type(shipped) is kind and type(shipped.original) is original, raised
        assert str(shipped) == f"{type(raised).__name__}: {raised}"
    gone = pickle.loads(pickle.dumps(RankError.of(FileNotFoundError(2, "gone", "/dev/shm/x")))).original
    assert (gone.errno, gone.filename) == (2, "/dev/shm/x")
    assert RankBackendError("OSError", "x").category is Category.BACKEND
    assert RankError("ValueError", "x").category is Category.BAD_INPUT


def test_ranks_failed_error_pickles_whole_and_takes_its_worst_members_category() -> None:
    error = RanksFailedError(
        {3: BadCheckpointError("cut short"), 0: BackendError("unreachable"), 1: BadCheckpointError("cut short")},
        "resuming step 6",
    )
    again = pickle.loads(pickle.dumps(error))
    assert type(again) is RanksFailedError and list(again.failures) == [0, 1, 3]
    assert [type(e) for e in again.failures.values()] == [BackendError, BadCheckpointError, BadCheckpointError]
    assert str(again) == str(error) == "resuming step 6 failed on rank 0: unreachable; on ranks 1, 3: cut short"
    assert error.category is again.category is Category.BACKEND and EXIT_CODES[error.category] == 5
    assert RanksFailedError({0: StoreError("x"), 1: LockTimeoutError("y")}).category is Category.LOCK
    many = RanksFailedError({r: StoreError(f"failure {r}") for r in range(1000)})
    assert len(str(many)) < 200 and "and 996 other failures" in str(many)
