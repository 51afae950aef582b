"""A training's head: the run and step it last committed, kept beside DeepSpeed's ``latest``.

DeepSpeed's ``latest`` names a tag (``global_step8``), never a run. After a rewind that branched
(saves 5-8 went to ``main-from-4``), a restarted job that read only ``latest`` would
resume ``main:step=8``, the timeline the user had abandoned, and commit its next steps there
(tests/system/test_integrations.py). With ``on_existing="replace"``, a job killed while committing step
7 again would leave the old step 7 among the new ones, and its restart resume from that old step
(tests/system/test_restarts.py).

So, like git's ``HEAD`` in a work tree, global rank 0 writes ``tailorstore-head.json`` into the
save folder after each step it commits: the store's id, the run, the step and the manifest's
``created_at``. A restart resumes in that run; and when ``latest`` names a step the job never
committed (it was killed first), the step the store holds there is taken only if it was
committed after the head, else it belongs to an abandoned timeline and the job resumes from the
head's own step, saying so.

The file is input from outside like any other, in a folder others may write to: it is opened
without following a link, and only a regular file is read (a FIFO planted under its name is
refused at once, never waited on), at most 4 KiB of a JSON object whose every field is checked;
anything else is ignored with a warning, as if there were no head. It is written as a temp file
created exclusively under an unpredictable name and renamed into place (``core/local_files``),
so a link planted in the save folder is never written through.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path

from tailorstore.core.local_files import Beneath, TooLarge, read_small, write_atomic
from tailorstore.core.run_names import RUN_NAME

log = logging.getLogger("tailorstore")

HEAD_FILE = "tailorstore-head.json"
_MOST = 4096


@dataclass(frozen=True)
class Head:
    store: str | None  # the store's id (None: a store made before ids)
    run: str
    step: int
    created_at: float  # the manifest's, as the index records it

    def matches(self, store_id: str | None) -> bool:
        return self.store == store_id


def read_head(folder: Path) -> Head | None:
    """The head in ``folder``, or None (none there, or one that is not a head: a warning says so)."""
    path = folder / HEAD_FILE
    try:
        data = read_small(Beneath(folder, HEAD_FILE, links=False), _MOST)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except TooLarge:
        log.warning("tailorstore: ignoring %s: more than %d bytes", path, _MOST)
        return None
    except OSError as exc:
        log.warning("tailorstore: cannot read %s (%s); resuming as if training had no head", path, exc)
        return None
    try:
        doc = json.loads(data)
        if not isinstance(doc, dict) or doc.get("tailorstore_head") != 1:
            raise ValueError("not a tailorstore head")
        store, run, step, created = doc.get("store"), doc.get("run"), doc.get("step"), doc.get("created_at")
        if store is not None and not isinstance(store, str):
            raise ValueError("its store id is not a string")
        if not isinstance(run, str) or not RUN_NAME.fullmatch(run) or run in (".", ".."):
            raise ValueError("its run is not a run name")
        if type(step) is not int or not 0 <= step < 1 << 63:
            raise ValueError("its step is not a step number")
        if not isinstance(created, int | float) or isinstance(created, bool) or not math.isfinite(created):
            raise ValueError("its time is not a number")
    except (ValueError, RecursionError) as exc:
        log.warning("tailorstore: ignoring %s: %s", path, exc)
        return None
    return Head(store, run, step, float(created))


def write_head(folder: Path, head: Head) -> None:
    """Replace the head in ``folder`` atomically; a failure is a warning (the step is committed)."""
    doc = {
        "tailorstore_head": 1,
        "store": head.store,
        "run": head.run,
        "step": head.step,
        "created_at": head.created_at,
    }
    try:
        write_atomic(folder, HEAD_FILE, json.dumps(doc).encode())
    except OSError as exc:
        log.warning("tailorstore: committed step %d, but could not write %s (%s)", head.step, folder / HEAD_FILE, exc)
