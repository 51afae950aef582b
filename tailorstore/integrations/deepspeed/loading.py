"""Resuming DeepSpeed from the store without ``attach``: ``load_checkpoint(engine, store)``, and
``staged_loads``, which reads the files a resume staged through the store's allowlist."""

from __future__ import annotations

import os
import secrets
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tailorstore import StepObjects
from tailorstore.api import Store
from tailorstore.integrations.common import ranks
from tailorstore.integrations.common.rewind import warn_if_composite
from tailorstore.integrations.common.session import Session
from tailorstore.integrations.deepspeed import resume, serving
from tailorstore.integrations.deepspeed.engine import TailorCheckpointEngine
from tailorstore.integrations.deepspeed.helpers import default_staging, shape_of
from tailorstore.integrations.deepspeed.staged_reads import below, load_staged


@contextmanager
def staged_loads(engine: Any, root: Path) -> Iterator[None]:
    """While DeepSpeed loads a resume that :func:`load_checkpoint` staged under ``root``, its
    checkpoint engine loads those files through the allowlist, mapped.

    DeepSpeed's own engine loads with ``weights_only=False``, which runs whatever code a pickle
    names, and these files come from the store: anyone who can write to its bucket can put a
    step there. Model-states files are mapped (:func:`mapped`). Other files go to the engine's own
    ``load``, which is put back afterwards."""
    checkpoint_engine = getattr(engine, "checkpoint_engine", None)
    if checkpoint_engine is None or isinstance(checkpoint_engine, TailorCheckpointEngine):
        yield
        return
    own = "load" in vars(checkpoint_engine)
    original = checkpoint_engine.load

    def load(path: str, map_location: Any = None) -> Any:
        if below(path, root) is not None:
            return load_staged(path)
        return original(path, map_location=map_location)

    checkpoint_engine.load = load
    try:
        yield
    finally:
        if own:
            checkpoint_engine.load = original
        else:
            del checkpoint_engine.load


def load_checkpoint(
    engine: Any,
    store: Store | None,
    ref: str = "latest",
    *,
    staging: str | os.PathLike | None = None,
    staged: bool = False,
    **load_kwargs: Any,
) -> tuple[Any, Any]:
    """Resume ``engine`` from the step ``ref`` names, at the world size and ZeRO stage it runs at now
    (collective: every rank calls it). Without :func:`attach`, and with no conversion step.

    Global rank 0 passes a store handle; a rank without one opens the store rank 0 names. Each rank
    builds the files it loads straight from the store, in memory, and DeepSpeed's own
    ``load_checkpoint`` (``load_kwargs`` go to it) loads them (:mod:`.serving`): nothing is staged.
    With ``staged`` (or an engine this cannot serve: a universal load, NVMe offload, model or pipeline
    parallelism), each node's local rank 0 (which then needs a handle) writes its ranks' share into
    its staging folder (``staging``, else ``$TAILOR_STAGING`` or ``/dev/shm``), every rank loads it
    through the allowlist (:func:`staged_loads`), and it is deleted.
    Returns what ``engine.load_checkpoint`` returns: (load path, client state)."""
    session = Session.open()
    token = session.decide(lambda: secrets.token_hex(6))  # one folder name on every rank
    root = (Path(staging) if staging is not None else default_staging()) / f"tailor-restore-{token}"
    world_size, zero_stage = shape_of(engine)

    def pick(handle: Store) -> resume.Found:
        handle.flush()
        found = resume.find(handle, ref)
        warn_if_composite(found.step, found.inherited)
        return found

    found = resume.step_for_every_rank(store, pick, session)
    assert found is not None
    if not staged and serving.servable(engine):

        def load_objects(objects: StepObjects, built: dict[str, Any]) -> Any:
            with serving.served(engine, root, objects, built):  # ``root`` is a name only: never made
                return engine.load_checkpoint(str(root), objects.tag, **load_kwargs)

        return resume.load_in_memory(store, found, load_objects, world_size, zero_stage, session)

    def load(folder: str, tag: str) -> Any:
        with staged_loads(engine, root):
            return engine.load_checkpoint(folder, tag, **load_kwargs)

    try:
        return resume.restore_and_load(store, found, load, root / "step", world_size, zero_stage, session)
    finally:
        if ranks.is_leader():
            shutil.rmtree(root, ignore_errors=True)
