"""The store simulation's DCP writer operation: one ``dcp.save`` of a small fixed state through
:class:`TailorStorageWriter`, in one process (DCP saves without a process group as one rank).

Each state (``D`` or ``E``) is seeded, so the same save is the same bytes every time:
:func:`save_raw` writes it with DCP's own ``FileSystemWriter`` once, as the input the checker
compares a checkout of the step with (the writer's step checks out as that folder, bit for bit).
The operation exits as the command line does: 0, or one line and the error's category's code.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import sys
import warnings
from pathlib import Path

STATES = ("D", "E")
RUN = "dcp"  # its own run: another model than the DeepSpeed saves of run main, which a run refuses


def state(name: str) -> dict:
    import torch

    generator = torch.Generator().manual_seed(STATES.index(name) + 11)
    layers = {f"layers.{i}.weight": torch.randn(48, 48, generator=generator) for i in range(3)}
    moments = {f"layers.{i}.exp_avg": torch.randn(48, 48, generator=generator) for i in range(3)}
    return {"model": layers, "optim": moments}


def save_raw(name: str, folder: Path) -> None:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save(state(name), storage_writer=dcp.FileSystemWriter(str(folder)))


def metadata_digest(path: Path) -> str:
    """What a DCP ``.metadata`` says of the save's items and where they are, without its storage
    meta (a random save id and the folder written). The harness's own saves and checkouts only:
    the file is unpickled with DCP's classes."""
    import hashlib

    from torch.distributed.checkpoint.metadata import Metadata

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        meta = pickle.loads(path.read_bytes())  # written by this harness, or a checkout of it
    assert isinstance(meta, Metadata), type(meta)
    said = (sorted(meta.state_dict_metadata.items()), sorted((meta.storage_data or {}).items(), key=repr))
    return hashlib.sha256(repr((said, meta.planner_data)).encode()).hexdigest()


def main(argv: list[str]) -> int:
    """``STATE STEP [LOCK_SECONDS]``: save that state as that step of run :data:`RUN` of
    ``$TAILOR_STORE`` (made first if it is not there), waiting for the store's locks as long as the
    schedule's commands do (``--lock-timeout``): with the default wait, a save queued behind a
    stopped host's write overran the schedule's bound (seed 20036 of the merges theme)."""
    import torch.distributed.checkpoint as dcp
    from tailorstore.cli.naming import EXIT_CODES
    from torch.distributed.checkpoint.api import CheckpointException

    from tailorstore.api import Store
    from tailorstore.core.errors import StepExistsError, TailorError
    from tailorstore.integrations.dcp_writer import TailorStorageWriter

    name, step = argv[0], int(argv[1])
    waits = {"lock_timeout": float(argv[2])} if len(argv) > 2 else {}
    try:
        store = Store.open(os.environ["TAILOR_STORE"], run=RUN)
        if RUN not in {r.name for r in store.runs()}:
            with contextlib.suppress(StepExistsError):  # another host made it meanwhile
                store.create_run(RUN, lock_timeout=10)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save(state(name), storage_writer=TailorStorageWriter(store, step=step, **waits))
    except TailorError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_CODES[exc.category]
    except CheckpointException as exc:  # DCP hands on a rank's failure as (exception, traceback)
        inner = next(iter(exc.failures.values()), (None, None))[0]
        if isinstance(inner, TailorError):
            print(f"error: {inner}", file=sys.stderr)
            return EXIT_CODES[inner.category]
        raise
    print(f"saved step {step} through the DCP writer")
    return 0
