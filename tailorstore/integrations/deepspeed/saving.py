"""``save_checkpoint(engine, save_dir, store)``: the plain "save, then commit" path, where the save
lands on disk first and global rank 0 commits it."""

from __future__ import annotations

import os
from concurrent.futures import Future
from typing import Any

from tailorstore import CommitResult
from tailorstore.api import Store
from tailorstore.core.policies import Policy
from tailorstore.integrations.common import ranks
from tailorstore.integrations.common.rewind import Rewind
from tailorstore.integrations.common.store_session import StoreSession
from tailorstore.integrations.deepspeed.helpers import T


def save_checkpoint(
    engine: Any,
    save_dir: str | os.PathLike,
    store: Store | None,
    tag: str | None = None,
    *,
    delete_after_commit: bool = False,
    asynchronous: bool = True,
    policy: str | Policy = "full",
    client_state: dict | None = None,
    on_existing: str = "branch",
    **policy_params: float,
) -> Future[CommitResult | None]:
    """``engine.save_checkpoint(save_dir, tag)`` on every rank, then rank 0 commits the step.

    The plain "save, then commit" path: the save lands on disk first. ``store`` is needed on
    rank 0 only (other ranks may pass None). Returns one type on every rank and in both modes, a
    future, so that calling code needs no case of its own: on rank 0 its result is the commit's
    (already done when not ``asynchronous``, whose errors are raised here, at once); on other ranks
    it is done and holds None. ``on_existing`` is as for :func:`attach`; a branch, once made, is
    kept on the engine for its later saves.
    """
    rewind: Rewind | None = getattr(engine, "_tailor_rewind", None)
    if rewind is None or rewind.on_existing != on_existing:
        rewind = Rewind(on_existing, run=rewind.run if rewind else None)
        engine._tailor_rewind = rewind
    engine.save_checkpoint(str(save_dir), tag=tag, client_state=client_state or {})
    if ranks.rank() != 0:
        return _done(None)
    if store is None:
        raise TypeError("save_checkpoint: global rank 0 needs the store to commit to")
    folder = os.path.join(str(save_dir), tag or f"global_step{engine.global_steps}")
    options: dict[str, Any] = {"policy": policy, **policy_params}
    step = int(engine.global_steps)

    def job(handle: Store) -> CommitResult:
        return rewind.commit(handle, folder, step=step, delete_after_commit=delete_after_commit, **options)

    if asynchronous:
        return StoreSession(store).background(folder, job)
    return _done(job(store))


def _done(value: T) -> Future[T]:
    """A future that already holds ``value``: the return of a call that had nothing to wait for."""
    future: Future[T] = Future()
    future.set_result(value)
    return future
