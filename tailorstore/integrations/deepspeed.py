"""DeepSpeed: save, then commit, from the training loop.

::

    from tailorstore.integrations.deepspeed import save_checkpoint

    with tailorstore.Store.open("ckpt-store") as store:
        for step in ...:
            ...
            if step % 100 == 0:
                save_checkpoint(engine, "saves", store)   # the save, then a background commit
    # resume: store.checkout("latest", "restored"); engine.load_checkpoint("restored")

Every rank calls ``save_checkpoint`` (DeepSpeed's own is collective); after DeepSpeed's
closing barrier, global rank 0 commits the step's folder in the background and, with
``delete_after_commit``, deletes it once its manifest is durable.
"""

from __future__ import annotations

import os
from concurrent.futures import Future
from typing import Any

import torch.distributed as dist

from ..api import Store
from ..commit import CommitResult


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def save_checkpoint(
    engine: Any,
    save_dir: str | os.PathLike,
    store: Store | None,
    tag: str | None = None,
    *,
    delete_after_commit: bool = True,
    asynchronous: bool = True,
    policy: str = "full",
    client_state: dict | None = None,
    **policy_params: float,
) -> Future[CommitResult] | CommitResult | None:
    """``engine.save_checkpoint(save_dir, tag)`` on every rank, then rank 0 commits the step.

    ``store`` is needed on rank 0 only (other ranks may pass None). Returns rank 0's future
    (or result, when not asynchronous); other ranks get None.
    """
    engine.save_checkpoint(str(save_dir), tag=tag, client_state=client_state or {})
    if _rank() != 0:
        return None
    if store is None:
        raise TypeError("save_checkpoint: global rank 0 needs the store to commit to")
    folder = os.path.join(str(save_dir), tag or f"global_step{engine.global_steps}")
    options: dict[str, Any] = {"step": engine.global_steps, "policy": policy, **policy_params}
    if asynchronous:
        return store.commit_async(folder, delete_after_commit=delete_after_commit, **options)
    return store.commit(folder, delete_after_commit=delete_after_commit, **options)
