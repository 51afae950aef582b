"""The public Python API: :class:`Store`, what ``import tailorstore`` gives a training script.

Everything the ``tailor`` command does goes through this class, so a training loop gets
the same behaviour without paying the command's start-up, and can commit in the
background (:meth:`Store.commit_async`). The library has no process-wide side effects: it
logs to the ``tailorstore`` logger and never configures logging, and its errors
(:mod:`tailorstore.core.errors`) say what to do without naming command-line flags.

Each verb's machinery is imported when the verb is first called, not with this module: a
command pays only for its own (docs/PERFORMANCE.md, "Start-up: importing on first use"), as
the commit machinery always was.

Example (docs/API.md has more)::

    import tailorstore

    with tailorstore.Store.open("s3://bucket/run1") as store:
        store.commit_async("ckpt/", tag=None, policy="parity")
        ...
        store.checkout("latest", "restored/")
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from tailorstore.background import CommitQueue
from tailorstore.core.errors import LOCK_TIMEOUT, Call, StoreError
from tailorstore.core.metric_values import encode as encode_metrics
from tailorstore.core.progress import Progress, Silent
from tailorstore.core.records import MAIN_RUN
from tailorstore.curate.runs import qualify
from tailorstore.store.backends.roles import Editor
from tailorstore.store.manifests.runs import check_run_name, write_retention
from tailorstore.store.repo import RebuildResult, Repository

if TYPE_CHECKING:
    from tailorstore.curate.gc import GcPlan, Retention
    from tailorstore.curate.merge import MergeResult
    from tailorstore.curate.runs import RunInfo
    from tailorstore.ingest.commit_options import CommitOptions, CommitRequest, CommitResult
    from tailorstore.ingest.finalize import FinalizeResult
    from tailorstore.report.diff import DiffResult
    from tailorstore.report.inspect import StepDetail, StepFiles, StepSummary
    from tailorstore.report.page import HistoryFacts, ReportResult
    from tailorstore.report.usage import Usage
    from tailorstore.report.verify import VerifyReport
    from tailorstore.restore.checkout import CheckoutResult
    from tailorstore.restore.export import ExportResult
    from tailorstore.restore.reshard import ReshardResult
    from tailorstore.restore.universal import UniversalResult

logger = logging.getLogger("tailorstore")
Ref = int | str
T = TypeVar("T")


def selector(ref: Ref) -> str:
    """``12`` or ``"step=12"``, ``"tag=NAME"``, ``"id=HEX"``, ``"digest=HEX"`` or ``"latest"``, as the
    store reads it."""
    if isinstance(ref, bool) or not isinstance(ref, int | str):
        raise StoreError(
            f"{ref!r} names no step: give an int step, 'step=N', 'tag=NAME', 'id=HEX', 'digest=HEX' or 'latest'."
        )
    return f"step={ref}" if isinstance(ref, int) else ref


class Store:
    """A checkpoint store, opened at a directory or at ``s3://bucket/prefix``.

    Use it as a context manager: leaving the block waits for background commits and
    raises their errors. One ``Store`` serves one thread; a background commit opens its
    own connection to the index.
    """

    def __init__(self, repo: Repository, *, max_in_flight: int = 1, run: str = MAIN_RUN) -> None:
        self.repo = repo
        self.location = repo.location
        self.run = check_run_name(run)  # commits go to this run; step=N and latest are read in it
        self._queue: CommitQueue[Any] = CommitQueue(max_in_flight)
        self._id: tuple[str | None] | None = None

    @property
    def id(self) -> str | None:
        """The random id ``init`` gave this store, the same on every host (None for a store made
        before ids): what tells two stores at one place apart. Read once per handle."""
        if self._id is None:
            from tailorstore.store.backends.roles import Reader
            from tailorstore.store.repo import store_id

            self._id = (store_id(self.repo.objects(Reader)),)
        return self._id[0]

    # -- lifecycle ---------------------------------------------------------------------
    @classmethod
    def init(cls, location: str | os.PathLike, *, max_in_flight: int = 1, run: str = MAIN_RUN) -> Store:
        """Create an empty store (an empty directory, or an empty S3 prefix) and open it."""
        return cls(Repository.init(location), max_in_flight=max_in_flight, run=run)

    @classmethod
    def open(cls, location: str | os.PathLike | None = None, *, max_in_flight: int = 1, run: str = MAIN_RUN) -> Store:
        """Open a store; ``None`` reads ``$TAILOR_STORE``. ``max_in_flight`` bounds background commits.
        ``run`` is the run this handle commits to and reads ``step=N`` and ``latest`` in."""
        return cls(Repository.open(location), max_in_flight=max_in_flight, run=run)

    @staticmethod
    def rebuild_index(location: str | os.PathLike | None = None) -> RebuildResult:
        """Recreate the index from the manifest objects; returns (manifests, blobs)."""
        return Repository.rebuild_index(location)

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def flush(self) -> None:
        """Wait for every background commit, then raise the first that failed."""
        self._queue.flush()

    def close(self) -> None:
        """Flush, then close the index. Errors of background commits are raised here at the latest."""
        try:
            self._queue.close()
        finally:
            self.repo.close()

    # -- commit ------------------------------------------------------------------------
    def commit(
        self,
        path: str | os.PathLike,
        request: CommitRequest | None = None,
        *,
        part: bool = False,
        part_label: str = "",
        progress: Progress | None = None,
        **options: Any,
    ) -> CommitResult:
        """Commit a DeepSpeed save, a ``global_stepN`` folder, an HF ``checkpoint-N`` folder, a DCP
        folder (``dcp.save``), or a plain torch.save or safetensors file or folder.

        What to do is a :class:`CommitRequest` (or its fields as keywords: ``step``, ``tag``,
        ``policy``, ``force``, ``level``, ``trust_pickles``, ``lock_timeout``,
        ``delete_after_commit``, ``run``, ``metrics``: ``{"eval_loss": 2.31}``, recorded with the
        step). ``policy`` (full, parity, filter, adaptive, budget, or a
        typed one, ``Budget(fraction=0.2)``) chooses the layers stored; the rest are inherited
        from earlier steps. With ``delete_after_commit``, the committed files are deleted once the
        manifest is durable and every blob it names has been found with its recorded size. With
        ``part``, only the files this host holds are committed, as one part of the step;
        :meth:`finalize` records the step once every host's part is in. ``part_label`` begins the
        part's key, so that :meth:`finalize` can take one save's parts alone.
        """
        # loaded on use: start-up (tests/system/test_startup.py)
        from tailorstore.ingest.commit_options import CommitRequest

        wanted = CommitRequest.of(request, options)
        if part and wanted.delete_after_commit:
            raise StoreError("delete_after_commit waits for the manifest, which a part does not write; finalize first.")
        commit_options = self._options(wanted, part=part, part_label=part_label)
        return _commit(self.repo, Path(path), commit_options, wanted.delete_after_commit, progress)

    def _options(self, request: CommitRequest, **fixed: Any) -> CommitOptions:
        """The one ``CommitOptions`` of a commit, built whole from ``request`` and what the caller
        fixes for itself (``part``, its label, a step, a plan): nothing changes it afterwards, so the
        options a commit was given are the ones it ran with, in the background too.
        ``integrations/common/store_session.py`` builds a part's options through this."""
        from tailorstore.ingest.commit_options import CommitOptions

        given = {
            "step": request.step,
            "tag": request.tag,
            "force": request.force,
            "trust_pickles": request.trust_pickles,
            "level": request.level,
            "threads": request.threads,
            "lock_timeout": request.lock_timeout,
            "policy": request.spec(),
            "run": check_run_name(request.run) if request.run is not None else self.run,
            "metrics": encode_metrics(request.metrics),
        }
        return CommitOptions(**{**given, **fixed})

    def finalize(
        self,
        step: int,
        *,
        tag: str | None = None,
        force: bool = False,
        lock_timeout: float = LOCK_TIMEOUT,
        label: str | None = None,
        metrics: Mapping[str, float] | None = None,
        progress: Progress | None = None,
    ) -> FinalizeResult:
        """Record step ``step`` from the parts every host committed (with ``label``, only the parts
        committed with that ``part_label``); refused, naming the missing ranks, while a part is
        missing (the parts then stay for a later finalize)."""
        from tailorstore.ingest.finalize import FinalizeRequest, finalize_step

        request = FinalizeRequest(
            step, run=self.run, tag=tag, force=force, label=label, metrics=encode_metrics(metrics),
            lock_timeout=lock_timeout,
        )  # fmt: skip
        return finalize_step(self.repo, request, progress or Silent())

    def commit_async(
        self, path: str | os.PathLike, request: CommitRequest | None = None, **options: Any
    ) -> Future[CommitResult]:
        """:meth:`commit` on the background worker; returns at once, or when a slot frees up.
        It takes the same :class:`CommitRequest` (or keywords).

        A failure is raised by the next ``commit_async``, by :meth:`flush` or by :meth:`close`,
        and the save it was committing is kept. The save must not change until the future is
        done: a commit refuses an input that changes under it.
        """
        source = Path(path)
        from tailorstore.ingest.commit_options import CommitRequest

        wanted = CommitRequest.of(request, options)
        commit_options = self._options(wanted)
        return self._background(
            str(source),
            lambda store: _commit(store.repo, source, commit_options, wanted.delete_after_commit, None),
        )

    def _background(self, what: str, job: Callable[[Store], T]) -> Future[T]:
        """Run ``job`` on the background worker, in order with :meth:`commit_async`, its errors raised
        the same way, with a handle of its own on this store and run (one handle serves one thread).
        Framework adapters reach it through ``StoreSession.background`` (integrations/common)."""
        location, run = self.location, self.run

        def run_job() -> T:
            with Store(Repository.open(location), run=run) as store:
                return job(store)

        return self._queue.submit(what, run_job)

    # -- reading -----------------------------------------------------------------------
    def checkout(
        self,
        ref: Ref,
        out: str | os.PathLike,
        *,
        world_size: int | None = None,
        zero_stage: int | None = None,
        format: str = "native",
        trust_pickles: bool = False,
        progress: Progress | None = None,
        threads: int | None = None,
        ranks: Sequence[int] | None = None,
    ) -> CheckoutResult:
        """Write the checkpoint ``ref`` names into the new directory ``out``, every byte hash-checked:
        as it was saved; for ``world_size`` ranks (and ``zero_stage`` 1 or 2) as DeepSpeed would have
        saved it there; or, ``format="universal"``, as DeepSpeed's universal checkpoint. As the
        ``checkout`` command does with ``--world-size``, ``--zero-stage`` and ``--format``. ``threads``
        sets the decoding threads of a native checkout (default: ``$TAILOR_THREADS``, else two a
        usable core). ``ranks`` writes only the files those data-parallel ranks load (one node's
        share of a DeepSpeed step)."""
        if format not in ("native", "universal"):
            raise StoreError(Call(format=format), ": choose native or universal.")
        if format == "universal":
            if world_size is not None or zero_stage is not None:
                raise StoreError("a universal checkpoint loads at any world size and stage; give neither with it.")
            return self.checkout_universal(ref, out, progress=progress)
        if world_size is not None or zero_stage is not None:
            return self._checkout_resharded(
                ref, out, world_size=world_size, zero_stage=zero_stage, ranks=ranks, progress=progress
            )
        from tailorstore.restore.checkout import checkout_step

        return checkout_step(
            self.repo,
            self._selector(ref),
            Path(out),
            trust_pickles=trust_pickles,
            progress=progress,
            threads=threads,
            ranks=ranks,
        )

    def _checkout_resharded(
        self,
        ref: Ref,
        out: str | os.PathLike,
        *,
        world_size: int | None = None,
        zero_stage: int | None = None,
        ranks: Sequence[int] | None = None,
        progress: Progress | None = None,
    ) -> ReshardResult:
        """:meth:`checkout` with ``world_size`` (the one way to a step at another world size): ``ref``
        in DeepSpeed's native layout as ``world_size`` data-parallel ranks would have saved it (ZeRO
        1-3; ``zero_stage`` switches between 1 and 2), so ``engine.load_checkpoint(out)`` resumes at
        that world size. ``ranks`` writes only the ZeRO files
        those ranks load (one node's share). Refused, before anything is written, for what cannot be
        produced."""
        from tailorstore.restore.reshard import checkout_resharded

        return checkout_resharded(
            self.repo,
            self._selector(ref),
            Path(out),
            world_size=world_size,
            zero_stage=zero_stage,
            ranks=ranks,
            progress=progress,
        )

    def checkout_universal(
        self, ref: Ref, out: str | os.PathLike, *, progress: Progress | None = None
    ) -> UniversalResult:
        """:meth:`checkout` with ``format="universal"``: DeepSpeed's universal checkpoint at ``out``
        (``latest_universal``, ``<tag>/zero/<param>/``), which ``engine.load_checkpoint`` loads at any
        world size with ``"checkpoint": {"load_universal": true}``."""
        from tailorstore.restore.universal import checkout_universal

        return checkout_universal(self.repo, self._selector(ref), Path(out), progress=progress)

    def export(
        self,
        ref: Ref,
        out: str | os.PathLike,
        *,
        dtype: str = "bf16",
        max_shard_size: str = "5GB",  # safetensors_writer.DEFAULT_SHARD_SIZE, as transformers saves
        config: str | os.PathLike | None = None,
        progress: Progress | None = None,
    ) -> ExportResult:
        """Write ``ref`` as a Hugging Face model folder at ``out``: ``model.safetensors`` (sharded above
        ``max_shard_size``) from the FP32 masters (else the stored weights: an HF Trainer or plain save,
        a step thinned to weights) in ``dtype`` (bf16, fp16 or fp32), with the step's config and
        tokenizer files, or the ``config.json`` given."""
        from tailorstore.restore.export import export_step

        return export_step(
            self.repo,
            self._selector(ref),
            Path(out),
            dtype=dtype,
            max_shard_size=max_shard_size,
            config=None if config is None else Path(config),
            progress=progress,
        )

    def log(self, *, run: str | None = None) -> list[StepSummary]:
        """The manifests by step, of every run unless ``run`` names one: the scope rule of
        :meth:`gc` and of the ``log`` command (each summary names its run)."""
        from tailorstore.report.inspect import log

        return log(self.repo, run)

    def runs(self) -> list[RunInfo]:
        from tailorstore.curate.runs import list_runs

        return list_runs(self.repo)

    def create_run(self, name: str, *, base: Ref | None = None, lock_timeout: float = LOCK_TIMEOUT) -> RunInfo:
        """Start run ``name``, branched from the step ``base`` names (read in this handle's run), or empty."""
        from tailorstore.curate.runs import create_run

        base_selector = None if base is None else self._selector(base)
        return create_run(self.repo, name, base_selector, from_run=self.run, lock_timeout=lock_timeout)

    def set_retention(self, rules: Retention | None = None) -> Retention | None:
        """The retention this handle's run carries: ``gc()`` without rules applies it
        (``Retention(keep_last=3, keep_best="eval_loss:min:3", thin="weights")`` keeps the last three
        and the three best whole and thins the rest). None, or rules that keep everything, clear it.
        The rules' ``run`` is this handle's run, whatever they say."""
        from dataclasses import replace

        rules = replace(rules, run=self.run) if rules is not None else None
        carried = rules if rules is not None and rules.drops_manifests else None
        write_retention(self.repo.objects(Editor), self.run, carried.as_doc() if carried is not None else None)
        return carried

    def retention(self) -> Retention | None:
        """The retention this handle's run carries, if any."""
        from tailorstore.curate.gc import carried_rules

        return next((r for r in carried_rules(self.repo) if r.run == self.run), None)

    def _selector(self, ref: Ref) -> str:
        return qualify(selector(ref), self.run)

    def step(self, ref: Ref) -> StepSummary:
        """The step ``ref`` names now, as :meth:`log` lists it; its ``id`` names the same manifest on
        every host, whatever is committed after (``f"id={summary.id}"``), and its ``digest`` what
        it holds, the same in every store that holds those bytes (``f"digest={summary.digest}"``)."""
        return self._summary(self.repo.resolve(self._selector(ref)))

    def show(self, ref: Ref) -> StepDetail:
        from tailorstore.report.inspect import show

        return show(self.repo, self._selector(ref))

    def files(self, ref: Ref) -> StepFiles:
        """The step's files as a checkout would write them (path, size, kind, mode; ``held``: what
        the step still holds of each, less for a thinned step), from the index alone: no blob is
        read and nothing is written."""
        from tailorstore.report.inspect import list_files

        return list_files(self.repo, self._selector(ref))

    def diff(self, a: Ref, b: Ref) -> DiffResult:
        from tailorstore.report.diff import diff

        return diff(self.repo, self._selector(a), self._selector(b))

    def plot(self, out: str | os.PathLike) -> Path:
        """A PNG heatmap of each layer's relative change over this run's committed steps."""
        from tailorstore.report.diff import plot

        return plot(self.repo, Path(out), self.run)

    def report(self, out: str | os.PathLike = "report.html") -> ReportResult:
        """The store's history as one self-contained HTML page at ``out`` (a ``.html`` path outside the
        store; an old report there is replaced): metrics over steps, bytes over time, lineage, each
        layer's change, and a sortable table of steps. It opens offline: every script is inlined."""
        import time

        from tailorstore.report.page import report_data, write_report
        from tailorstore.report.page.render import check_out

        started = time.monotonic()
        check_out(self.repo, Path(out))  # a wrong path is said before the store is read
        data = report_data(self.repo, _history_facts(self.repo), store_id=self.id)
        return write_report(self.repo, Path(out), data, started)

    def usage(self) -> Usage:
        from tailorstore.curate.gc import Retention, effective_rules, plan_gc
        from tailorstore.report.usage import usage

        frees = plan_gc(self.repo, effective_rules(self.repo, Retention())).freed_bytes  # what a plain gc would free
        return usage(self.repo, gc_frees=frees)

    def verify(self, ref: Ref | None = None, *, deep: bool = False, progress: Progress | None = None) -> VerifyReport:
        from tailorstore.report.verify import verify

        return verify(self.repo, None if ref is None else self._selector(ref), deep=deep, progress=progress)

    # -- changing ----------------------------------------------------------------------
    def gc(
        self,
        rules: Retention | None = None,
        *,
        dry_run: bool = False,
        drop_parts: bool = False,
        lock_timeout: float = LOCK_TIMEOUT,
        progress: Progress | None = None,
        show_plan: Callable[[GcPlan], None] | None = None,
        clear_notices: bool = False,
    ) -> GcPlan:
        """Drop the manifests outside the ``rules`` (a :class:`Retention`), in every run (each counted
        on its own) unless ``rules.run`` names one, as the ``gc`` command does (tags, pins and run
        bases stay); then every blob no kept manifest uses. Without rules, each run's own retention
        (:meth:`set_retention`) applies. With ``thin="weights"`` (or ``"master"``) the commits outside
        the retention are thinned to that tier instead of dropped: they keep their weights (or FP32
        masters) for export and averaging. ``keep_best="eval_loss:min:3"`` also keeps each run's three
        steps with the lowest recorded ``eval_loss`` (``metrics=`` at commit); a step without it is
        never among the best.
        ``thin="archive"`` keeps the weights quantized against the previous archived step:
        ``archive_levels`` grid steps up to each group's largest magnitude (default 31, so each value
        is within 1/62 of it) and a keyframe at least every ``keyframe_every`` steps (default 16).
        ``clear_notices`` deletes the notices that gc runs which died left on a leased store (each blocks
        the publications that need the blobs it names); give it only when no other gc can be running.
        ``drop_parts`` drops the parts no finalize took that are older than ``$TAILOR_DROP_PARTS_AFTER``
        seconds (an hour by default), so that a save in flight keeps its parts."""
        from tailorstore.curate.gc import Retention, gc

        return gc(
            self.repo,
            rules if rules is not None else Retention(),
            dry_run=dry_run,
            drop_parts=drop_parts,
            lock_timeout=lock_timeout,
            progress=progress or Silent(),
            show_plan=show_plan,
            clear_notices=clear_notices,
        )

    def merge(self, spec: str | os.PathLike, *, tag: str, lock_timeout: float = LOCK_TIMEOUT) -> MergeResult:
        """Compose a checkpoint from the layer slices a YAML spec names, or (a spec with
        ``method: sma | ema | wma``) average the FP32 masters of several steps; it is recorded
        under ``tag``. An average writes new blobs; a composite writes none."""
        from tailorstore.curate.merge import merge

        return merge(self.repo, Path(spec), tag, self.run, lock_timeout=lock_timeout)

    def tag(self, ref: Ref, name: str, *, force: bool = False, lock_timeout: float = LOCK_TIMEOUT) -> StepSummary:
        """Name the step ``ref`` names; returns it as ``log`` lists it. Waits for a running gc."""
        from tailorstore.curate.refs import tag

        return self._summary(tag(self.repo, self._selector(ref), name, force=force, lock_timeout=lock_timeout))

    def untag(self, name: str, *, lock_timeout: float = LOCK_TIMEOUT) -> StepSummary:
        """Remove a tag; returns the step it named (which stays, droppable by gc unless pinned)."""
        from tailorstore.curate.refs import untag

        return self._summary(untag(self.repo, name, lock_timeout=lock_timeout))

    def pin(self, ref: Ref, pinned: bool = True, *, lock_timeout: float = LOCK_TIMEOUT) -> StepSummary:
        """Keep the step through every gc (``pinned=False``: no longer); returns it. Waits for a running gc."""
        from tailorstore.curate.refs import pin

        return self._summary(pin(self.repo, self._selector(ref), pinned, lock_timeout=lock_timeout))

    def unpin(self, ref: Ref, *, lock_timeout: float = LOCK_TIMEOUT) -> StepSummary:
        """Let gc drop the step again (the command line's ``unpin``; ``pin(ref, False)`` does the same)."""
        return self.pin(ref, False, lock_timeout=lock_timeout)

    def remove(self, ref: Ref, *, force: bool = False, lock_timeout: float = LOCK_TIMEOUT) -> StepSummary:
        """Drop one manifest (its blobs go at the next gc); returns it as it was."""
        from tailorstore.curate.refs import remove

        gone = self._summary(self.repo.resolve(self._selector(ref)))
        remove(self.repo, self._selector(ref), force=force, lock_timeout=lock_timeout)
        return gone

    def add_metrics(self, ref: Ref, metrics: Mapping[str, float], *, lock_timeout: float = LOCK_TIMEOUT) -> StepSummary:
        """Record metrics with a step after its commit (an evaluation that ended later); a name it
        has already takes the new value. Returns the step as ``log`` lists it."""
        from tailorstore.curate.adding_metrics import add_metrics

        return self._summary(add_metrics(self.repo, self._selector(ref), metrics, lock_timeout=lock_timeout))

    def _summary(self, manifest: int) -> StepSummary:
        from tailorstore.report.inspect import summary
        from tailorstore.store.digest import ContentRows

        return summary(self.repo.manifest(manifest), self.repo.view(ContentRows))


def _commit(
    repo: Repository,
    path: Path,
    options: CommitOptions,
    delete_after_commit: bool,
    progress: Progress | None,
) -> CommitResult:
    # The commit machinery (readers, planner, codec pools) is slow to import (docs/PERFORMANCE.md,
    # "Start-up: importing on first use"), and torch too for a file that needs its loader.
    # Importing it on the first commit, not with this module, keeps that off `tailor log`, `show`,
    # `gc` and `verify`.
    from tailorstore.ingest.commit import commit_checkpoint

    result = commit_checkpoint(repo, path, options, progress=progress or Silent())
    if delete_after_commit:
        from tailorstore.ingest.deletion import delete_once_durable

        delete_once_durable(repo, result.manifest, path)
    return result


__all__ = ["Ref", "Store", "selector"]


def _history_facts(repo: Repository) -> HistoryFacts:
    """What the report page needs from curate (report does not import it): the runs, and what
    ``gc`` without rules would do now under each run's own retention."""
    from tailorstore.curate.gc import Retention, effective_rules, kept_as_best, plan_gc
    from tailorstore.curate.runs import list_runs
    from tailorstore.report.page import GcOutlook, HistoryFacts, RunFacts

    rules = effective_rules(repo, Retention())
    plan = plan_gc(repo, rules)
    outlook = GcOutlook(
        frees=plan.freed_bytes,
        drops=frozenset(m for m, _ in plan.drop),
        thins={m: tier for m, _, tier in plan.thin},
        best=kept_as_best(repo, rules),
    )
    runs = tuple(
        RunFacts(r.name) if r.base is None else RunFacts(r.name, r.base.run, r.base.step, r.base.id)
        for r in list_runs(repo)
    )
    return HistoryFacts(runs, outlook)

