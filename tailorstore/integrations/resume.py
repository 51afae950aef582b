"""Resuming from the store at any world size, each node writing only what its own ranks load.

DeepSpeed refuses a ZeRO checkpoint saved at another data-parallel world size, and its own way
round (``ds_to_universal``, then ``load_universal``) is an offline conversion with a full copy
on disk. Here the step is resolved once, on global rank 0, to its stable id (``id=HEX``), so
every node reads the same manifest even while commits go on. Then each node's leader (its local
rank 0) writes into its own staging folder the files its ranks load: the step as saved when the
world size and ZeRO stage match, else the native layout of the new world size
(``checkout_resharded``) cut down to this node's ranks. Every rank then loads through
DeepSpeed's own ``load_checkpoint``, and the leader deletes the folder.

A node's peak staging is therefore its ranks' optimizer files plus the model-states file(s):
its share of the step, not the whole step. Ranks are taken to be numbered node by node, as
``torchrun`` numbers them (``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``).

Every collective runs on a gloo group of its own (``ranks.tailor_group``) with a timeout: a node
that dies mid-restore turns into an error on the others, not a hang.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

from tailorstore.api import Store
from tailorstore.core.errors import StoreError
from tailorstore.integrations.ranks import gathered, is_distributed, is_leader, node_ranks
from tailorstore.integrations.ranks import rank as global_rank
from tailorstore.restore.checkout import loaded_by
from tailorstore.restore.file_objects import StepObjects


@dataclass(frozen=True)
class Found:
    """The step a resume loads, as global rank 0 resolved it for every node."""

    ref: str  # "id=HEX": the same manifest on every host
    step: int
    world_size: int | None
    zero_stage: int | None
    inherited: dict[str, int]  # a composite's layers from earlier steps (layer -> step)
    created_at: float = 0.0  # when the manifest was recorded (integrations/head.py compares it)


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
        return store.checkout_resharded(found.ref, out, world_size=world_size, zero_stage=stage, ranks=ranks).tag
    store.checkout(found.ref, out, ranks=ranks)  # this node's share: its ranks' files and the shared ones
    folders = [p.name for p in out.iterdir() if p.is_dir()]
    if len(folders) != 1:
        raise StoreError(f"the checked-out step in {out} holds {len(folders)} tag folders, not one")
    return folders[0]


def restore_and_load(
    store: Store | None,
    pick: Callable[[Store], Found],
    load: Callable[[str, str], Any],
    out: Path,
    world_size: int,
    zero_stage: int,
    group: Any,
) -> tuple[Found, Any]:
    """Collective: resolve on rank 0 (``pick``), materialize on each node's leader into ``out``
    (this node's staging), load on every rank (``load(folder, tag)``), and clean up.

    Every node's leader needs a store handle; on one node, global rank 0's is enough."""
    distributed = is_distributed()
    rank = global_rank()
    leader = is_leader()
    # who can write for whom: every node leader with a store, or rank 0 alone for a single node
    seen = gathered((rank, leader, store is not None, len(node_ranks(rank))), group)
    leaders = [r for r, lead, has, _ in seen if lead]
    single_node = len(leaders) == 1 and all(size == len(seen) for *_, size in seen)
    if not all(has for _, lead, has, _ in seen if lead) and not single_node:
        missing = [r for r, lead, has, _ in seen if lead and not has]
        raise StoreError(
            f"resuming from the store on {len(leaders)} nodes needs a store handle on each node's local rank 0; "
            f"ranks {missing} have none"
        )
    found, _ = resolved(store, pick, group)
    error: str | None = None
    tag: str | None = None
    if leader:
        try:
            assert store is not None
            mine = node_ranks(rank) if not single_node else list(range(len(seen)))
            out.parent.mkdir(parents=True, exist_ok=True)
            tag = materialize(store, found, out, world_size, zero_stage, mine)
        except Exception as exc:
            shutil.rmtree(out, ignore_errors=True)
            error = f"resuming step {found.step} from {store.location if store else 'the store'} failed: {exc}"
    outcomes = gathered((rank, tag, error), group)
    failures = [e for _, _, e in outcomes if e]
    if failures:
        raise StoreError(failures[0])
    my_leader = node_ranks(rank)[0] if not single_node else 0
    tag = next(t for r, t, _ in outcomes if r == my_leader)
    try:
        return found, load(str(out), tag)
    finally:
        if distributed:
            dist.barrier(group)
        if leader:
            shutil.rmtree(out, ignore_errors=True)


def resolved(store: Store | None, pick: Callable[[Store], Found], group: Any) -> tuple[Found, str | None]:
    """Collective: the step rank 0 resolves (``pick``), and the store's location, on every rank."""
    found: Found | None = None
    error: str | None = None
    location = store.location if store is not None else None
    if global_rank() == 0:
        try:
            if store is None:
                raise StoreError("global rank 0 needs the store to resume from")
            found = pick(store)
        except Exception as exc:  # every rank must hear it
            error = f"resuming from {location or 'the store'} failed: {exc}"
    found, error, location = gathered((found, error, location), group)[0]
    if error:
        raise StoreError(error)
    assert found is not None
    return found, location


def load_in_memory(
    store: Store | None,
    pick: Callable[[Store], Found],
    load: Callable[[StepObjects, dict[str, Any]], Any],
    world_size: int,
    zero_stage: int,
    group: Any,
) -> tuple[Found, Any]:
    """Collective: resolve on rank 0, then every rank builds the files it loads straight from the
    store (``restore/file_objects.py``), at the world size and stage training runs at now, and
    ``load(objects, built)`` loads them; nothing is staged. A rank without a store handle opens the
    store rank 0 names (readers take no lock). Every rank builds its own files before any loads, and
    a failure on one is raised on all, so no rank waits in DeepSpeed's collectives for one that
    failed."""
    found, location = resolved(store, pick, group)
    rank = global_rank()
    objects: StepObjects | None = None
    built: dict[str, Any] = {}
    error: str | None = None
    opened: Store | None = None
    try:
        own = store if store is not None else (opened := Store.open(str(location)))  # rank 0 resolved it there
        stage = zero_stage if zero_stage != found.zero_stage else None
        objects = own.step_objects(found.ref, world_size=world_size, zero_stage=stage)
        for name in objects.names:
            if loaded_by(name, {rank}):
                built[name] = objects.load(name)
    except Exception as exc:
        error = f"resuming step {found.step} from {location or 'the store'} failed on rank {rank}: {exc}"
    failures = [e for e in gathered(error, group) if e]
    try:
        if failures:
            raise StoreError(failures[0])
        assert objects is not None
        return found, load(objects, built)
    finally:
        if opened is not None:
            opened.close()
