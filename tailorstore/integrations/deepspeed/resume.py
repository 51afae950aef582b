"""Resuming from the store at any world size, each node writing only what its own ranks load.

DeepSpeed refuses a ZeRO checkpoint saved at another data-parallel world size, and its own way
round (``ds_to_universal``, then ``load_universal``) is an offline conversion with a full copy
on disk. Here the step is resolved once, on global rank 0, to its stable id (``id=HEX``), so
every node reads the same manifest even while commits go on. Then each node's leader (its local
rank 0) writes into its own staging folder the files its ranks load: the step as saved when the
world size and ZeRO stage match, else the native layout of the new world size
(``checkout`` at the new world size) cut down to this node's ranks. Every rank then loads through
DeepSpeed's own ``load_checkpoint``, and the leader deletes the folder.

A node's peak staging is therefore its ranks' optimizer files plus the model-states file(s):
its share of the step, not the whole step. Ranks are taken to be numbered node by node, as
``torchrun`` numbers them (``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``).

Every collective runs on a gloo group of its own (``ranks.tailor_group``) with a timeout: a node
that dies mid-restore turns into an error on the others, not a hang. The step is decided once, on
global rank 0, and every failure is raised on every rank with each rank's own error, through a
:class:`..session.Session`.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from tailorstore import StepObjects
from tailorstore.api import Store
from tailorstore.core.errors import StoreError
from tailorstore.integrations.common.ranks import is_leader, node_ranks
from tailorstore.integrations.common.ranks import rank as global_rank
from tailorstore.integrations.common.session import Session
from tailorstore.integrations.common.store_session import StoreSession, loaded_by


@dataclass(frozen=True)
class Found:
    """The step a resume loads, as global rank 0 resolved it for every node."""

    ref: str  # "id=HEX": the same manifest on every host
    step: int
    world_size: int | None
    zero_stage: int | None
    inherited: dict[str, int]  # a composite's layers from earlier steps (layer -> step)
    created_at: float = 0.0  # when the manifest was recorded (deepspeed/head.py compares it)
    location: str | None = None  # the store rank 0 resolved it in (a rank without a handle opens it)


def needs_reshard(found: Found, world_size: int, zero_stage: int) -> bool:
    """A ZeRO save loads as it is only at its own world size and stage."""
    if not found.zero_stage or found.world_size is None:
        return False  # no ZeRO partitions: the files load at any world size
    return found.world_size != world_size or found.zero_stage != zero_stage


def find(store: Store, ref: str) -> Found:
    """Rank 0: the step ``ref`` names, pinned to its stable id."""
    detail = store.show(ref)
    head = detail.summary
    inherited = {x.layer: x.source_step for x in detail.layers if x.source_step != head.step}
    return Found(f"id={head.id}", head.step, head.world_size, head.zero_stage, inherited, head.created_at)


def materialize(store: Store, found: Found, out: Path, world_size: int, zero_stage: int, ranks: list[int]) -> str:
    """A node leader: write what ``ranks`` load into ``out``; returns the tag folder's name."""
    if needs_reshard(found, world_size, zero_stage):
        stage = zero_stage if zero_stage != found.zero_stage else None
        done = store.checkout(found.ref, out, world_size=world_size, zero_stage=stage, ranks=ranks)
    else:
        done = store.checkout(found.ref, out, ranks=ranks)  # this node's share: its ranks' files and the shared ones
    if not done.tag:
        raise StoreError(f"the step checked out in {out} holds no DeepSpeed tag folder")
    return done.tag


def restore_and_load(
    store: Store | None,
    found: Found,
    load: Callable[[str, str], Any],
    out: Path,
    world_size: int,
    zero_stage: int,
    session: Session,
) -> Any:
    """Collective: materialize ``found`` (what :func:`step_for_every_rank` gave every rank) on each node's
    leader into ``out`` (this node's staging), load on every rank (``load(folder, tag)``), and
    clean up. A failure on any leader is raised on every rank, each leader's error kept whole.

    Every node's leader needs a store handle; on one node, global rank 0's is enough."""
    rank = global_rank()
    leader = is_leader()
    # who can write for whom: every node leader with a store, or rank 0 alone for a single node
    seen = session.each(lambda: (rank, leader, store is not None, len(node_ranks(rank))))
    single_node = session.decide(lambda: _one_writer(seen), "resuming from the store")

    def write() -> str | None:
        if not leader:
            return None
        try:
            assert store is not None
            mine = node_ranks(rank) if not single_node else list(range(len(seen)))
            out.parent.mkdir(parents=True, exist_ok=True)
            return materialize(store, found, out, world_size, zero_stage, mine)
        except BaseException:
            shutil.rmtree(out, ignore_errors=True)
            raise

    where = found.location or "the store"
    tags = session.each(write, f"resuming step {found.step} from {where}")
    my_leader = node_ranks(rank)[0] if not single_node else 0
    tag = tags[my_leader]
    assert tag is not None
    try:
        return load(str(out), tag)
    finally:
        session.barrier()
        if leader:
            shutil.rmtree(out, ignore_errors=True)


def _one_writer(seen: list[tuple[int, bool, bool, int]]) -> bool:
    """Rank 0, from every rank's (rank, leader, has a store, ranks on its node): whether global
    rank 0 writes for every rank (one node), else each node's leader for its own (each needs a store)."""
    leaders = [r for r, lead, has, _ in seen if lead]
    single_node = len(leaders) == 1 and all(size == len(seen) for *_, size in seen)
    if not all(has for _, lead, has, _ in seen if lead) and not single_node:
        missing = [r for r, lead, has, _ in seen if lead and not has]
        raise StoreError(
            f"resuming from the store on {len(leaders)} nodes needs a store handle on each node's local rank 0; "
            f"ranks {missing} have none"
        )
    return single_node


def step_for_every_rank(store: Store | None, pick: Callable[[Store], Found | None], session: Session) -> Found | None:
    """Collective: the step rank 0 resolves (``pick``), with the store's location, on every rank
    (None where ``pick`` says there is nothing to resume). Its failure is raised on every rank."""

    def decide() -> Found | None:
        if store is None:
            raise StoreError("global rank 0 needs the store to resume from")
        found = pick(store)
        return None if found is None else replace(found, location=store.location)

    return session.decide(decide, f"resuming from {store.location if store is not None else 'the store'}")


def load_in_memory(
    store: Store | None,
    found: Found,
    load: Callable[[StepObjects, dict[str, Any]], Any],
    world_size: int,
    zero_stage: int,
    session: Session,
) -> Any:
    """Collective: every rank builds the files it loads of ``found`` (what :func:`step_for_every_rank` gave
    every rank) straight from the store (``restore/file_objects.py``), at the world size and stage
    training runs at now, and ``load(objects, built)`` loads them; nothing is staged. A rank
    without a store handle opens the store rank 0 names (readers take no lock). Every rank builds
    its own files before any loads, and a failure on one is raised on all, each rank's error kept
    whole, so no rank waits in DeepSpeed's collectives for one that failed."""
    rank = global_rank()
    opened: list[Store] = []

    def build() -> tuple[StepObjects, dict[str, Any]]:
        if store is None:
            opened.append(Store.open(str(found.location)))  # rank 0 resolved it there
        own = store if store is not None else opened[0]
        stage = zero_stage if zero_stage != found.zero_stage else None
        objects = StoreSession(own).step_objects(found.ref, world_size=world_size, zero_stage=stage)
        return objects, {name: objects.load(name) for name in objects.names if loaded_by(name, {rank})}

    mine: list[tuple[StepObjects, dict[str, Any]]] = []
    try:
        session.each(lambda: mine.append(build()), f"resuming step {found.step} from {found.location or 'the store'}")
        objects, built = mine[0]
        return load(objects, built)
    finally:
        for handle in opened:
            handle.close()
