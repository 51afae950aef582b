"""The seam between the library and its framework adapters: :class:`StoreSession`, and the few
pieces of the library below the API that adapters build on.

``Store`` is the user's surface: the calls the ``tailor`` command, the README and docs/API.md show.
A framework adapter needs more than a user does: to commit files held in memory as one part of a
step, to plan the parts of a step once for every rank, to commit with every rank of a group, to run
a job in order with the background commits, to read a step's DCP items or its DeepSpeed files as
objects. Those operations were once methods of ``Store`` itself, where every user saw them and
nothing told an adapter's needs from a user's. They are here instead, on a handle an adapter wraps
around the user's ``Store``::

    session = StoreSession(store)
    plan = session.plan_parts(step, layer_bytes, request)
    session.commit_memory(folder, request, part_label=label, plan=plan)
    store.finalize(step, label=label)           # what a user may call stays on the Store

This module is the one place in ``integrations/`` that reaches below the public API: the handle's
repository, its background queue and how it builds a commit's options (``Store._options``), and the
modules of ``formats``, ``ingest``, ``restore`` and ``store`` named below. Every other adapter module
imports only ``tailorstore`` (its API), ``tailorstore.core`` and other adapter modules, which
``tests/system/test_layers.py`` pins, as it pins what a ``StoreSession`` offers (:data:`OPERATIONS`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from tailorstore.api import Ref, Store
from tailorstore.core.errors import StoreError
from tailorstore.core.records import COMMIT

# What adapters build on below the API: the formats they write and read, and the rules a commit
# and a resume share with them. Re-exported here so that no adapter imports those layers itself.
from tailorstore.formats import dcp as dcp_format
from tailorstore.formats import megatron as megatron_format
from tailorstore.formats.deepspeed import has_latest, is_model_states, read_latest
from tailorstore.formats.layout import MEGATRON, step_from_name
from tailorstore.formats.memory_folder import MemoryFile, MemoryFolder
from tailorstore.formats.safe_load import load_torch_file
from tailorstore.formats.small_text import NAME_LIMIT, read_small_text
from tailorstore.formats.source import LentBytes
from tailorstore.formats.tensors import dtype_from_name
from tailorstore.ingest.commit_options import CommitRequest
from tailorstore.ingest.rank_plan import check_sized_policy
from tailorstore.ingest.rank_share import owner_of
from tailorstore.restore.checkout import loaded_by

if TYPE_CHECKING:
    from tailorstore.core.records import ManifestRecord
    from tailorstore.ingest.commit_options import CommitResult, PartPlan
    from tailorstore.ingest.finalize import FinalizeResult
    from tailorstore.ingest.rank_parallel import Collective, RankParallelResult
    from tailorstore.restore.dcp_read import DcpStep
    from tailorstore.restore.file_objects import StepObjects

T = TypeVar("T")

# What a StoreSession offers, and nothing more (tests/system/test_layers.py): the store's operations that
# only framework adapters call.
OPERATIONS = frozenset(
    {
        "background", "commit_memory", "commit_together", "delete_once_durable", "holds", "in_run", "open_dcp",
        "parts", "plan_parts", "step_objects",
    }
)  # fmt: skip

__all__ = [
    "COMMIT",
    "MEGATRON",
    "NAME_LIMIT",
    "OPERATIONS",
    "LentBytes",
    "MemoryFile",
    "MemoryFolder",
    "StoreSession",
    "check_sized_policy",
    "dcp_format",
    "dtype_from_name",
    "has_latest",
    "is_model_states",
    "load_torch_file",
    "loaded_by",
    "megatron_format",
    "opened_store",
    "owner_of",
    "read_latest",
    "read_small_text",
    "step_from_name",
]


class StepLookup(Protocol):
    """The index as an adapter asks whether a step is held."""

    def commit_at(self, step: int, run: str) -> ManifestRecord | None: ...


class StoreSession:
    """A framework adapter's handle on a user's open :class:`Store`: the operations only adapters
    call (:data:`OPERATIONS`). ``store`` stays the user's, for every call a user may make too."""

    def __init__(self, store: Store) -> None:
        if not isinstance(store, Store):
            raise StoreError(f"a StoreSession wraps a Store, not a {type(store).__name__}")
        self.store = store

    def plan_parts(
        self, step: int, layer_bytes: Mapping[str, int], request: CommitRequest | None = None, **options: Any
    ) -> PartPlan:
        """One decision for every part of step ``step`` when its hosts write from memory (the DCP
        writer): which layers the request's policy stores, given every layer's size in bytes, and
        where each other layer comes from. Made once, under the shared lock, and handed to every
        part (:meth:`commit_memory`)."""
        from tailorstore.ingest.rank_plan import plan_from_sizes
        from tailorstore.store.repo import check_step

        wanted = CommitRequest.of(request, options)
        run = self.store._options(wanted).run  # the request's run, checked, else the handle's
        check_step(step)
        return plan_from_sizes(self.store.repo, wanted.spec(), step, dict(layer_bytes), run, wanted.lock_timeout)

    def commit_memory(
        self,
        folder: MemoryFolder,
        request: CommitRequest | None = None,
        *,
        part_label: str = "",
        plan: PartPlan | None = None,
        **options: Any,
    ) -> CommitResult:
        """Commit files held in memory (:class:`MemoryFolder`) as one part of step ``folder.step``,
        under ``plan`` (:meth:`plan_parts`); ``Store.finalize`` records the step once every part is
        in. What the DCP writer does on each rank. The part names no tag (the step's tag is
        finalize's to set) and, under a plan, no policy of its own (the plan's is the step's)."""
        from tailorstore.core.policies import PolicySpec
        from tailorstore.ingest.commit import commit_layout

        wanted = CommitRequest.of(request, options)
        commit_options = self.store._options(
            wanted,
            part=True,
            part_label=part_label,
            step=folder.step,
            tag=None,
            plan=plan,
            policy=PolicySpec() if plan is not None else wanted.spec(),
        )
        return commit_layout(self.store.repo, folder.layout(), f"{folder.tag} (in memory)", commit_options)

    def commit_together(
        self,
        path: str | os.PathLike,
        group: Collective,
        request: CommitRequest | None = None,
        *,
        label: str = "",
        part_label: str = "",
        owns: Callable[[str], bool] | None = None,
        **options: Any,
    ) -> RankParallelResult:
        """Commit the save at ``path`` with every member of ``group`` (each calls this, with a handle on
        the same store): each writes its own files' blobs as a part, and member 0 records the step
        from the parts (``ingest/rank_parallel.py``: the call order). The request is as for
        ``Store.commit``; ``owns`` says which files a member commits (default: DeepSpeed's rank R's
        files are member R's), ``part_label`` marks this member's part and ``label`` the parts the
        finalize takes. ``integrations.distributed.commit_rank_parallel`` is this over torch.distributed."""
        from dataclasses import replace

        from tailorstore.ingest.rank_parallel import commit_together

        wanted = CommitRequest.of(request, options)
        if wanted.delete_after_commit:
            raise StoreError("delete_after_commit waits for the manifest, which the parts do not write.")
        parts = self.store._options(
            replace(wanted, tag=None, metrics=None, policy="full", policy_params={}), part=True, part_label=part_label
        )
        store = self.store

        def finalize(step: int) -> FinalizeResult:
            return store.finalize(
                step, tag=wanted.tag, force=wanted.force, lock_timeout=wanted.lock_timeout, label=label or None,
                metrics=wanted.metrics,
            )  # fmt: skip

        return commit_together(store.repo, Path(path), parts, wanted.spec(), group, finalize, owns)

    def parts(self, step: int | None, *, label: str | None = None) -> list[str]:
        """The keys of the parts of ``step`` (None: of every step; this handle's run) waiting for
        ``Store.finalize`` (with ``label``, those committed with it)."""
        from tailorstore.store.backends.roles import Lister
        from tailorstore.store.parts import part_keys

        return part_keys(self.store.repo.objects(Lister), step, self.store.run, label)

    def in_run(self, run: str) -> StoreSession:
        """A session on this same open store whose commits and ``step=N`` go to ``run``."""
        from tailorstore.store.manifests.runs import check_run_name

        if run == self.store.run:
            return self
        return StoreSession(Store(self.store.repo, run=check_run_name(run)))

    def holds(self, step: int, *, run: str | None = None) -> bool:
        """Whether the store records ``step`` in ``run`` (default: this handle's), as of now: what
        other hosts published is read first."""
        self.store.repo.refresh()
        return self.store.repo.view(StepLookup).commit_at(step, run or self.store.run) is not None

    def delete_once_durable(self, manifest: int, path: str | os.PathLike) -> None:
        """``delete_after_commit`` for a step recorded elsewhere (a rank-parallel finalize): every blob
        of ``manifest`` is checked present, then the committed files at ``path`` are deleted."""
        from tailorstore.ingest.deletion import delete_once_durable

        delete_once_durable(self.store.repo, manifest, Path(path))

    def background(self, what: str, job: Callable[[Store], T]) -> Future[T]:
        """Run ``job`` on the handle's background worker, in order with ``Store.commit_async``, and
        with its errors raised the same way (by the next ``commit_async``, ``flush`` or ``close``).
        ``job`` gets its own handle on this store and run: one handle serves one thread. Adapters use
        this to wrap a commit (the DeepSpeed engine rescues its staged save when the commit fails)."""
        return self.store._background(what, job)

    def open_dcp(self, ref: Ref, *, folder: str | None = None) -> DcpStep:
        """A step's DCP folder (its only one, or ``folder``) to read item by item, every tensor
        hash-checked: what ``TailorStorageReader`` hands ``dcp.load``. Nothing is written anywhere."""
        from tailorstore.restore.dcp_read import open_dcp_step

        repo = self.store.repo
        self._share_reads_on_node()
        return open_dcp_step(repo, repo.resolve(self.store._selector(ref)), folder)

    def step_objects(self, ref: Ref, *, world_size: int | None = None, zero_stage: int | None = None) -> StepObjects:
        """The torch files of a DeepSpeed step's tag folder as the objects ``torch.load`` would
        return, built in memory from the store on demand (``StepObjects.load(name)``), each tensor
        decoded once and hash-checked; at ``world_size`` ranks under ZeRO ``zero_stage`` when they
        differ from the save's (resharded). Nothing is written: what a resume loads straight from
        the store."""
        from tailorstore.restore.file_objects import step_objects

        selected = self.store._selector(ref)
        self._share_reads_on_node()
        return step_objects(self.store.repo, selected, world_size=world_size, zero_stage=zero_stage)

    def _share_reads_on_node(self) -> None:
        """A node of several ranks fetches each window of what they read once, for all of them
        (``Repository.share_reads_with_node``): a resume's ranks read many of the same blobs."""
        from tailorstore.integrations.common.ranks import ranks_on_node

        if ranks_on_node() > 1:
            self.store.repo.share_reads_with_node()


def opened_store(store: Store | str | os.PathLike) -> Store:
    """The store an adapter is built over: a :class:`Store`, or its location (a folder or
    ``s3://...``, opened as :meth:`Store.open` opens it)."""
    if isinstance(store, Store):
        return store
    if isinstance(store, str | os.PathLike):
        return Store.open(store)
    raise StoreError(
        f"the store is a {type(store).__name__}: give a Store (Store.open(location)) or its location, a path or s3://..."
    )
