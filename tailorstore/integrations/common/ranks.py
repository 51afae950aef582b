"""Who this process is among the ranks, and the few collectives every integration shares.

One place for each, so that the integrations for DeepSpeed, the HF Trainer, DCP and several
nodes share one rank lookup, one broadcast (one failure semantics) and one reading of
``LOCAL_WORLD_SIZE`` (one cap); tests/system/test_layers.py keeps them here. Every value read from the
environment is read as hostile input. Ranks are taken to be numbered node by node,
as ``torchrun`` numbers them (``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``).

Every collective here runs on the group it is given; :func:`tailor_group` makes a gloo group of our
own with a timeout (``$TAILOR_COLLECTIVE_TIMEOUT`` seconds, default 1800), so a node that dies turns
into an error on the others, not a hang, and nothing interleaves with training's collectives.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from tailorstore.core.env_seconds import seconds_from_env
from tailorstore.core.environment import COLLECTIVE_TIMEOUT_ENV

DEFAULT_COLLECTIVE_TIMEOUT = 1800.0
MOST_LOCAL_RANKS = 65536  # LOCAL_WORLD_SIZE above this is taken for a damaged environment


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    """This process's global rank (0 outside torch.distributed)."""
    return dist.get_rank() if is_distributed() else 0


def barrier(group: Any = None) -> None:
    if is_distributed():
        dist.barrier(group)


def member(group: Any = None) -> int:
    """This rank's number in ``group`` (its global rank for the default group); 0 outside torch.distributed."""
    return dist.get_rank(group) if is_distributed() else 0


def broadcast(value: Any, group: Any = None) -> Any:
    """The ``value`` of ``group``'s member 0 on every rank (collective). For work that may fail
    there and must fail on every rank, ``Session.decide`` carries the failure too."""
    if not is_distributed():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0 if group is None else dist.get_global_rank(group, 0), group=group)
    return box[0]


def gathered(value: Any, group: Any) -> list[Any]:
    """Every rank's ``value``, in rank order (collective)."""
    if group is None and not is_distributed():
        return [value]
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, value, group=group)
    return out


def collective_timeout() -> float:
    """Seconds any one collective of ours may wait for the other ranks (read as hostile input)."""
    return seconds_from_env(COLLECTIVE_TIMEOUT_ENV, DEFAULT_COLLECTIVE_TIMEOUT, least=1.0, most=7 * 86400.0)


def tailor_group() -> Any:
    """A gloo process group of our own (collective: every rank calls it, in the same order)."""
    if not is_distributed():
        return None
    return dist.new_group(backend="gloo", timeout=timedelta(seconds=collective_timeout()))


def local_rank_and_size() -> tuple[int, int]:
    """(LOCAL_RANK, LOCAL_WORLD_SIZE), read as hostile input: numbers in range, else one rank a node."""
    try:
        local = int(os.environ.get("LOCAL_RANK", "0")[:6])
        size = int(os.environ.get("LOCAL_WORLD_SIZE", "1")[:6])
    except ValueError:
        return 0, 1
    if not (0 <= local < size <= MOST_LOCAL_RANKS):
        return 0, 1
    return local, size


def ranks_on_node() -> int:
    """How many ranks this node runs."""
    return local_rank_and_size()[1]


def node_ranks(global_rank: int) -> list[int]:
    """The global ranks of ``global_rank``'s node (this process's node layout)."""
    local, size = local_rank_and_size()
    first = global_rank - local
    return list(range(first, first + size))


def is_leader() -> bool:
    """Whether this process is its node's local rank 0."""
    return local_rank_and_size()[0] == 0
