"""Many nodes, node-local staging: each node commits its own ranks' files as a part.

A cluster stages each node's save in that node's memory, which no other node sees. So when a
job spans several nodes and each node's leader (its local rank 0) holds a store handle, every
leader commits what its node's ranks staged as one part of the step, labelled with the save
(``<engine>.s<save>-n<rank>``), and global rank 0, once its own part is in, waits for one part
from every node and finalizes the step from that save's parts alone. Only the store is shared.

A node that dies mid-save leaves no part, or a part no finalize takes: rank 0's wait ends in
an error after ``$TAILOR_COLLECTIVE_TIMEOUT`` seconds, no manifest is recorded, the earlier
steps stay as they were, and ``gc --drop-parts`` collects what the dead save left.
"""

from __future__ import annotations

import logging
import re
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

from tailorstore.api import Store
from tailorstore.core.errors import Call, StoreError, TailorError
from tailorstore.integrations.common import ranks
from tailorstore.integrations.common.session import Session
from tailorstore.integrations.common.store_session import StoreSession

log = logging.getLogger("tailorstore")

POLL_SECONDS = 0.5
# the token of a part's key: <engine>.s<save>.of<nodes>-n<rank>-<random>
_SAVE_PART = re.compile(r"(?P<label>[A-Za-z0-9._-]+\.s\d+\.of(?P<count>\d{1,5}))-n\d+-[0-9a-f]+\.json\.zst")


def parts_possible(store: Store | None, group: Any) -> list[int]:
    """Collective: the nodes' leader ranks when the job spans several nodes and every leader
    holds a store handle (each node then commits a part); else empty (one committer)."""
    rank = ranks.rank()
    seen = Session(group).gather((rank, ranks.is_leader(), store is not None, len(ranks.node_ranks(rank))))
    leaders = [r for r, lead, _, _ in seen if lead]
    single = len(leaders) == 1 and all(size == len(seen) for *_, size in seen)
    if single or not all(has for _, lead, has, _ in seen if lead):
        return []
    return leaders


def leaders_group(leaders: list[int]) -> Any:
    """Collective (every rank calls it): a gloo group of the nodes' leaders, with our timeout;
    None on one node."""
    if not leaders:
        return None
    return dist.new_group(ranks=leaders, backend="gloo", timeout=timedelta(seconds=ranks.collective_timeout()))


def node_names(every: list[list[str]]) -> list[str]:
    """The files this node's ranks staged (``every``: each global rank's names)."""
    return sorted({n for r in ranks.node_ranks(ranks.rank()) if r < len(every) for n in every[r]})


def each_node_apart(folder: Path, every: list[list[str]], group: Any) -> bool:
    """Collective: True when no leader sees another node's files in its folder (node-local
    staging). A folder every node shares (a shared staging= or save_dir) is committed whole by
    global rank 0 instead, as on one node."""
    here = set(ranks.node_ranks(ranks.rank()))
    own = {n for r, names in enumerate(every) if r in here for n in names}
    foreign = {n for r, names in enumerate(every) if r not in here for n in names} - own  # model states: both
    sees = ranks.is_leader() and any((folder / n).exists() for n in foreign)
    return not any(Session(group).gather(sees))


def save_label(engine: str, save: int, count: int) -> str:
    """What every part of one save's key begins with; it says how many parts make the save whole."""
    return f"{engine}.s{save:06d}.of{count}"


def finish_pending(store: Store) -> list[int]:
    """Global rank 0 at start: finalize every save of this run whose parts are all in the store
    but which no manifest records (its job was killed between the last part and the finalize).
    A save with a part missing is left for gc's drop_parts. Returns the steps recorded."""
    groups: dict[tuple[int, str], list[str]] = {}
    wanted: dict[str, int] = {}
    for key in StoreSession(store).parts(None):
        step_text, name = key.rsplit("/", 2)[-2:]
        if not key.startswith(f"parts/{store.run}/"):
            continue
        found = _SAVE_PART.fullmatch(name)
        if found is None:
            continue
        step = int(step_text.removeprefix("step-"))
        groups.setdefault((step, found["label"]), []).append(key)
        wanted[found["label"]] = int(found["count"])
    recorded = []
    for (step, label), keys in sorted(groups.items()):
        if len(keys) != wanted[label] or any(s.step == step for s in store.log(run=store.run)):
            continue
        try:
            store.finalize(step, label=label)
        except TailorError as exc:
            log.warning("tailorstore: the parts of step %d that a stopped job left were not finalized: %s", step, exc)
            continue
        log.warning("tailorstore: finalized step %d from the parts a stopped job left in the store", step)
        recorded.append(step)
    return recorded


def await_parts(store: Store, step: int, label: str, count: int, timeout: float | None = None) -> None:
    """Global rank 0: wait until ``count`` parts labelled ``label`` are in the store."""
    limit = ranks.collective_timeout() if timeout is None else timeout
    deadline = time.monotonic() + limit
    while True:
        found = StoreSession(store).parts(step, label=label)
        if len(found) >= count:
            return
        if time.monotonic() >= deadline:
            raise StoreError(
                f"step {step}: {len(found)} of the {count} nodes' parts arrived in {limit:g} s, so the step is not "
                "recorded (a node died or could not commit). The parts that arrived stay for a later finalize; ",
                Call("gc", drop_parts=True),
                " collects them.",
            )
        time.sleep(POLL_SECONDS)
