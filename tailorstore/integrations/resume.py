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

Every collective runs on a gloo group of its own (:func:`tailor_group`) with a timeout
(``$TAILOR_COLLECTIVE_TIMEOUT`` seconds, default 1800): a node that dies mid-restore turns into
an error on the others, not a hang, and nothing here interleaves with training's collectives.
"""

from __future__ import annotations

import math
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

from tailorstore.api import Store
from tailorstore.core.environment import COLLECTIVE_TIMEOUT_ENV
from tailorstore.core.errors import StoreError

DEFAULT_COLLECTIVE_TIMEOUT = 1800.0


@dataclass(frozen=True)
class Found:
    """The step a resume loads, as global rank 0 resolved it for every node."""

    ref: str  # "id=HEX": the same manifest on every host
    step: int
    world_size: int | None
    zero_stage: int | None
    inherited: dict[str, int]  # a composite's layers from earlier steps (layer -> step)
    created_at: float = 0.0  # when the manifest was recorded (integrations/head.py compares it)


def collective_timeout() -> float:
    """Seconds any one collective of ours may wait for the other ranks (read as hostile input)."""
    text = os.environ.get(COLLECTIVE_TIMEOUT_ENV, str(DEFAULT_COLLECTIVE_TIMEOUT))[:100]
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not 1.0 <= seconds <= 7 * 86400.0:  # NaN and inf included
        raise StoreError(f"{COLLECTIVE_TIMEOUT_ENV}={text!r} is not allowed: give seconds, from 1 to 604800.")
    return seconds


def tailor_group() -> Any:
    """A gloo process group of our own (collective: every rank calls it, in the same order)."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    return dist.new_group(backend="gloo", timeout=timedelta(seconds=collective_timeout()))


def _local() -> tuple[int, int]:
    """(LOCAL_RANK, LOCAL_WORLD_SIZE), read as hostile input: numbers in range, else one rank a node."""
    try:
        local = int(os.environ.get("LOCAL_RANK", "0")[:6])
        size = int(os.environ.get("LOCAL_WORLD_SIZE", "1")[:6])
    except ValueError:
        return 0, 1
    if not (0 <= local < size <= 65536):
        return 0, 1
    return local, size


def ranks_on_node() -> int:
    """How many ranks this node runs (LOCAL_WORLD_SIZE, read as hostile input)."""
    return _local()[1]


def node_ranks(rank: int) -> list[int]:
    """The global ranks of this rank's node."""
    local, size = _local()
    first = rank - local
    return list(range(first, first + size))


def is_leader() -> bool:
    return _local()[0] == 0


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


def gathered(value: Any, group: Any) -> list[Any]:
    if group is None and not (dist.is_available() and dist.is_initialized()):
        return [value]
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, value, group=group)
    return out


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
    distributed = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if distributed else 0
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
    found: Found | None = None
    error: str | None = None
    if rank == 0:
        try:
            if store is None:
                raise StoreError("global rank 0 needs the store to resume from")
            found = pick(store)
        except Exception as exc:  # every rank must hear it
            error = f"resuming from {store.location if store else 'the store'} failed: {exc}"
    found, error = gathered((found, error), group)[0]
    if error:
        raise StoreError(error)
    assert found is not None
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
