"""What an engine's start does, once, before it takes a save or a resume: :func:`start_up`.

``attach`` runs it (through :func:`..attaching.start_engine`); the engine's constructor runs no
collective and commits nothing, so that building one is only building one. The start is
collective: every rank calls it, in the same order, and it goes, in this order:

1. the tailor gloo group and the rank session over it (``common/session.py``): every collective
   below, and the engine's later ones, run on it, with their own timeout;
2. global rank 0 has a store handle, or every rank fails alike (``Session.decide``);
3. which ranks commit: with several nodes whose every leader holds a store, each node commits its
   ranks' files as a part (:mod:`.nodes`), and the leaders get a group of their own for the
   policies they decide together; else global rank 0 commits the whole save;
4. with parts, global rank 0 finalizes a killed job's saves whose every part is in the store;
5. this engine's staging folder's name, made on global rank 0, the same on every rank;
6. every rank recovers what dead runs left in its node's staging (:mod:`.staging`), and none goes
   on before all have (``Session.each`` is that barrier): a recovery takes a folder nobody holds,
   so no rank may create its own before every rank of its node has looked;
7. global rank 0 commits what was recovered, or keeps it aside (:mod:`.recovery`), before any rank
   goes on: every rank decides how to load only once the recovery is finished.

What it leaves is a :class:`Started`, which the engine's save path and load path share.
"""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tailorstore.api import Store
from tailorstore.core.errors import StoreError
from tailorstore.integrations.common import ranks
from tailorstore.integrations.common.session import Session
from tailorstore.integrations.deepspeed import nodes
from tailorstore.integrations.deepspeed import staging as staged
from tailorstore.integrations.deepspeed.helpers import default_staging
from tailorstore.integrations.deepspeed.recovery import Recovered, commit_recovered


class EngineFolder:
    """This engine's own staging folder (the same name on every rank), held with a shared lock
    while it exists: a later engine's recovery leaves a held folder alone (:mod:`.staging`)."""

    def __init__(self, staging: Path, root: Path) -> None:
        self.staging, self.root = staging, root
        self._lock: int | None = None

    def hold(self) -> None:
        """Lock the folder (again, when it was emptied and deleted since), creating it."""
        if not staged.still_held(self._lock, self.root):
            if self._lock is not None:
                os.close(self._lock)
            self._lock = staged.hold(self.root)

    def remove_if_empty(self) -> None:
        try:
            self.root.rmdir()
        except OSError:
            pass


@dataclass
class Started:
    """What the start leaves every rank with, for the engine's save path and load path."""

    session: Session
    store: Store | None  # this rank's handle: global rank 0's, and each node leader's (it may resume)
    parts: list[int]  # the nodes' leaders when each node commits a part of each save, else empty
    leaders_group: Any  # the leaders' own group (None on one node)
    folder: EngineFolder
    recovered: list[Recovered] = field(default_factory=list)  # what rank 0 did with dead runs' saves


def start_up(store: Store | None, *, staging: str | os.PathLike | None = None, on_existing: str = "branch") -> Started:
    """The engine's start, on every rank (collective), in the order the module docstring gives."""
    session = Session(ranks.tailor_group())  # 1
    session.decide(lambda: _needs_store(store), "starting the TailorCheckpointEngine")  # 2
    mine = store if ranks.rank() == 0 or ranks.is_leader() else None
    parts = nodes.parts_possible(store, session.group)  # 3
    leaders_group = nodes.leaders_group(parts)
    if parts and ranks.rank() == 0:  # 4
        assert store is not None
        nodes.finish_pending(store)
    token = session.decide(lambda: f"{staged.PREFIX}{os.getpid()}-{secrets.token_hex(4)}")  # 5
    where = Path(staging) if staging is not None else default_staging()
    every = session.each(lambda: staged.recover(where), "recovering a dead run's staging")  # 6
    rescued = [one for found in every for one in found]
    recovered = session.decide(  # 7
        lambda: commit_recovered(store, rescued, on_existing) if rescued and store is not None else [],
        "committing the saves a dead run left in staging",
    )
    return Started(session, mine, parts, leaders_group, EngineFolder(where, where / token), recovered)


def _needs_store(store: Store | None) -> None:
    if store is None:
        raise StoreError("TailorCheckpointEngine: global rank 0 commits, so it needs the store.")
