"""Garbage collection: drop manifests under retention rules, then delete unreferenced blobs.

Like restic's prune, gc first computes a plan (the manifests to drop, the blobs to delete
and the bytes freed), shows it, and only then carries it out, with the store lock held
exclusively so no commit is in flight.

The order of deletion is what keeps a killed gc harmless: manifests and blob rows leave
the index in one transaction first, blob files are unlinked after. A crash in between
leaves unindexed blob files, which are orphans that the next gc removes; it can never
leave an index row that points at a deleted file.

A blob is live when any kept manifest references it, through a file row or a non-derived
atom row. Composites reference their inherited blobs directly, so a blob first stored at a
dropped step lives on as long as a kept composite uses it.

Call order (docs/FORMAT.md section 8, gc; one process, under the exclusive lock):

1. take the lock exclusive; on a remote store, list the manifest and part objects; sync the index;
2. plan (:func:`plan_gc`): the manifests to drop or thin, the dead blobs, the packs to delete or
   repack, the orphans; show the plan (a dry run stops here);
3. thin and archive what the rules thin, and plan again when it archived;
4. carry the refs of superseded versions over, delete the dropped parts and superseded objects;
5. in one index transaction: put each dropped manifest's drop marker and read their refs (a ref
   found: take the markers back, drop nothing, stop), then delete the manifest objects and rows;
6. repack: write the live blobs into new packs, point the index at them;
7. on a remote store, put the notice of the blobs and packs it deletes and read what was published
   since step 1 (``store/gc_notices.py``; one that needs them stops gc);
8. delete the blob and pack objects, each request fenced; then the temp files; then the notice.

Packs: a pack none of whose blobs lives is deleted. A pack whose dead bytes reach
``REPACK_AT`` of its size is repacked: its live blobs are read, hash-checked, written into
new packs, the index is pointed at them, and only then is the old pack deleted. A pack with
fewer dead bytes is left as it is (its dead rows leave the index; its bytes wait for a
later repack), so gc does not rewrite gigabytes to free a few kilobytes.
"""

from __future__ import annotations

import io
import logging
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

from tailorstore.access.contents import Contents
from tailorstore.core.env_seconds import seconds_from_env
from tailorstore.core.environment import PART_AGE_ENV
from tailorstore.core.errors import (
    LOCK_TIMEOUT,
    Call,
    CorruptStoreError,
    LeaseLostError,
    LockTimeoutError,
    StoreError,
)
from tailorstore.core.failpoints import failpoint, operation
from tailorstore.core.metric_values import checked as checked_metrics
from tailorstore.core.metric_values import decode as decode_metrics
from tailorstore.core.object_keys import blob_key
from tailorstore.core.progress import Progress
from tailorstore.core.records import (
    COMMIT,
    MAIN_RUN,
    THIN_ARCHIVE,
    TIERS,
    BlobRecord,
    ManifestRecord,
    RunRecord,
)
from tailorstore.core.sizes import human
from tailorstore.curate.archiving import KEYFRAME_EVERY, ArchiveGrid, archivable
from tailorstore.curate.thinning import check_tier, contents_of, thin, thinner
from tailorstore.store import archive_codec, codec, gc_notices
from tailorstore.store.backends.listing import Holdings
from tailorstore.store.backends.roles import Editor, Leftovers, Reader, Scanner
from tailorstore.store.lease import LeaseHandle
from tailorstore.store.lock import LockHandle
from tailorstore.store.manifests.drop_marks import (
    clear_stale_marks,
    mark_superseded,
    mark_unless_claimed,
    take_back_marks,
)
from tailorstore.store.manifests.keys import pin_key, superseded
from tailorstore.store.manifests.objects import unpublish
from tailorstore.store.manifests.refs import RefSource, carry_refs, damaged_tags
from tailorstore.store.manifests.runs import read_retentions
from tailorstore.store.packs.pack import PackEntry, PackWriter, pack_key, read_trailer
from tailorstore.store.packs.pack_sync import TRAILER_READERS
from tailorstore.store.parts import read_parts
from tailorstore.store.repo import BlobReader, Repository, StepReader, StoreWriter


class GcPlanning(Protocol):
    """The index as gc plans: every manifest and run, which blobs the kept ones need, and the packs."""

    def manifests(self, run: str | None = None) -> list[ManifestRecord]: ...

    def created_runs(self) -> dict[str, RunRecord]: ...

    def commit_at(self, step: int, run: str) -> ManifestRecord | None: ...

    def referenced_hashes(self, manifest: int) -> set[str]: ...

    def blobs_unused_by(self, keep: Iterable[int]) -> list[BlobRecord]: ...

    def blob_hashes(self, *, loose_only: bool = False) -> set[str]: ...

    def packs(self) -> dict[str, int]: ...

    def blobs_in_pack(self, name: str) -> list[BlobRecord]: ...


class GcSweep(RefSource, Protocol):
    """The index as gc reads it between its steps: the records whose refs it carries (the two
    methods of ``RefSource``), and the rows that name objects it must not delete."""

    def blob_hashes(self, *, loose_only: bool = False) -> set[str]: ...

    def packs_named_by_blobs(self) -> set[str]: ...


class GcDrop(Protocol):
    """The index as gc's one dropping transaction changes it."""

    def object_keys(self, manifests: Iterable[int]) -> dict[int, str | None]: ...

    def upsert_blobs(self, blobs: Iterable[BlobRecord]) -> None: ...

    def delete_manifests(self, manifests: Iterable[int]) -> None: ...

    def delete_blobs(self, hashes: Iterable[str]) -> None: ...

    def delete_packs(self, names: Iterable[str]) -> None: ...


class GcObjects(Editor, Leftovers, Protocol):
    """What gc does to the store's objects: it reads trailers and refs, lists, puts drop marks,
    notices and packs, deletes, and clears temp files; handed out once, at :func:`gc`'s entry."""


class GcPlanObjects(Scanner, Leftovers, Protocol):
    """What planning reads: parts, trailers, superseded versions, temp files; it changes nothing."""


class Repack(Protocol):
    """The index as a repack moves live blobs into new packs."""

    def blobs_in_pack(self, name: str) -> list[BlobRecord]: ...

    def add_packs(self, packs: Iterable[tuple[str, int]]) -> None: ...

    def move_blobs(self, placed: dict[str, tuple[str, int]]) -> None: ...

    def delete_packs(self, names: Iterable[str]) -> None: ...


REPACK_AT = 0.25  # repack a pack once this share of its bytes is dead
log = logging.getLogger("tailorstore")


@dataclass(frozen=True)
class KeepBest:
    """Keep the ``count`` best committed steps of each run by ``metric`` (``min``: lowest first)."""

    metric: str
    mode: str
    count: int

    @classmethod
    def parse(cls, text: str) -> KeepBest:
        """``eval_loss:min:3`` (or ``accuracy:max:2``)."""
        parts = str(text).rsplit(":", 2)  # a metric's name may hold ':' itself (eval:loss:min:3)
        try:
            metric, mode, count = parts
            best = cls(metric.strip(), mode.strip(), int(count))
        except ValueError:
            raise StoreError(f"keep-best {str(text)[:60]!r} is not METRIC:min|max:COUNT (eval_loss:min:3)") from None
        checked_metrics({best.metric: 0.0})  # the metric's name follows the rules of a recorded one
        if best.mode not in ("min", "max") or not 1 <= best.count < 1 << 31:
            raise StoreError(f"keep-best {text!r}: the mode is min or max, the count a whole number of 1 or more")
        return best

    def text(self) -> str:
        return f"{self.metric}:{self.mode}:{self.count}"

    def best(self, commits: list[ManifestRecord]) -> set[int]:
        """Pure, the documented rule: only steps that recorded a finite value of the metric rank
        (a missing metric, NaN or infinity never does); among equal values the later step ranks
        first; the first ``count`` are kept."""
        ranked = []
        for m in commits:
            value = decode_metrics(m.metrics).get(self.metric)
            if value is not None:
                ranked.append((value if self.mode == "min" else -value, -m.step, m.id))
        return {manifest for *_, manifest in sorted(ranked)[: self.count]}


@dataclass(frozen=True)
class Retention:
    """Which steps gc keeps whole; the others it drops, or thins to ``thin``. Tags, pins and run
    bases are always kept. ``Store.gc(Retention(keep_last=3, thin="weights"))``; a run carries its
    own with ``Store.set_retention`` (what ``gc()`` without rules applies)."""

    keep_last: int | None = None  # the K newest committed steps
    keep_every: int | None = None  # committed steps whose number is a multiple of N
    run: str | None = None  # apply the rules to this run only (None: to every run, each on its own)
    thin: str | None = None  # thin the commits the rules do not keep to this tier, instead of dropping them
    keep_best: KeepBest | None = None  # the best steps by a recorded metric ("eval_loss:min:3")
    archive_levels: int | None = None  # thin="archive": grid steps to a group's largest (None: 31)
    keyframe_every: int | None = None  # thin="archive": a keyframe at least every N steps (None: 16)

    def __post_init__(self) -> None:
        if isinstance(self.keep_best, str):
            object.__setattr__(self, "keep_best", KeepBest.parse(self.keep_best))
        if self.grid is not None and self.thin != THIN_ARCHIVE:
            raise StoreError(
                Call(archive_levels="N"), " and ", Call(keyframe_every="N"), " go with ", Call(thin="archive"), "."
            )
        for name, value in (("keep_last", self.keep_last), ("keep_every", self.keep_every)):
            if value is not None and (type(value) is not int or not 1 <= value < 1 << 63):
                raise StoreError(Call(**{name: value}), " is not allowed: give a whole number of 1 or more.")
        if self.thin is not None:
            check_tier(self.thin)
            if not self.drops_manifests:
                raise StoreError(
                    Call(thin="TIER"),
                    " thins the steps the rules do not keep: give ",
                    Call(keep_last="N"),
                    ", ",
                    Call(keep_every="N"),
                    " or ",
                    Call(keep_best="METRIC:min:N"),
                    " too.",
                )

    @property
    def grid(self) -> ArchiveGrid | None:
        """How coarse the archive tier is, where either of its options is given (None: the default)."""
        if self.archive_levels is None and self.keyframe_every is None:
            return None
        return ArchiveGrid(
            archive_codec.DEFAULT_LEVELS if self.archive_levels is None else self.archive_levels,
            KEYFRAME_EVERY if self.keyframe_every is None else self.keyframe_every,
        )

    @property
    def drops_manifests(self) -> bool:
        return self.keep_last is not None or self.keep_every is not None or self.keep_best is not None

    def as_doc(self) -> dict[str, Any]:
        """The rules as a run carries them (``refs/retention/RUN``)."""
        doc: dict[str, Any] = {"keep_last": self.keep_last, "keep_every": self.keep_every, "thin": self.thin}
        if self.keep_best is not None:
            doc["keep_best"] = self.keep_best.text()
        if self.grid is not None:
            doc["archive_levels"], doc["keyframe_every"] = self.grid.levels, self.grid.keyframe_every
        return doc

    @classmethod
    def from_doc(cls, run: str, doc: dict[str, Any]) -> Retention:
        try:
            best = doc.get("keep_best")
            if best is not None and not isinstance(best, str):
                raise TypeError("keep_best is not METRIC:min|max:COUNT")
            levels, every = doc.get("archive_levels"), doc.get("keyframe_every")
            if ("archive_levels" in doc or "keyframe_every" in doc) and (levels is None or every is None):
                raise TypeError("archive_levels and keyframe_every come together")
            return cls(
                keep_last=doc.get("keep_last"),
                keep_every=doc.get("keep_every"),
                thin=doc.get("thin"),
                run=run,
                keep_best=KeepBest.parse(best) if best is not None else None,
                archive_levels=levels,
                keyframe_every=every,
            )
        except (StoreError, TypeError) as exc:
            raise CorruptStoreError(f"the retention run {run!r} carries is damaged ({exc}); set it again") from None


def carried_rules(repo: Repository) -> list[Retention]:
    """The retention each run carries (``tailor run retention``), each touching its own run only."""
    return [Retention.from_doc(run, doc) for run, doc in sorted(read_retentions(repo.objects(Scanner)).items())]


def effective_rules(repo: Repository, rules: Retention) -> list[Retention]:
    """Rules given win; without any, each run's carried retention applies (within ``rules.run`` if set)."""
    if rules.drops_manifests:
        return [rules]
    return [r for r in carried_rules(repo) if rules.run is None or r.run == rules.run]


@dataclass
class GcPlan:
    drop: list[tuple[int, int]] = field(default_factory=list)  # (manifest, step)
    keep: list[tuple[int, int]] = field(default_factory=list)
    dead_blobs: list[str] = field(default_factory=list)  # indexed, referenced by no kept manifest
    orphan_files: list[str] = field(default_factory=list)  # blob files with no index row
    temp_files: list[str] = field(default_factory=list)
    dead_loose: list[str] = field(default_factory=list)  # the dead blobs that are objects of their own
    dead_packs: list[str] = field(default_factory=list)  # packs with no live blob
    repack: list[str] = field(default_factory=list)  # packs whose live blobs move to new packs
    orphan_packs: list[str] = field(default_factory=list)  # pack objects the index does not know
    drop_parts: list[str] = field(default_factory=list)  # part objects to delete (finalized, or asked to)
    seen_parts: list[str] = field(default_factory=list)  # every part object the plan read
    superseded: list[str] = field(default_factory=list)  # older versions of a step's manifest object
    misplaced: dict[str, tuple[str, PackEntry]] = field(default_factory=dict)  # blob -> the pack its trailer names
    thin: list[tuple[int, int, str]] = field(default_factory=list)  # (manifest, step, tier) to thin
    grids: dict[int, ArchiveGrid] = field(default_factory=dict)  # the grid of each manifest to archive
    # stored bytes of the dead blobs, by what frees them: "drop" (a dropped manifest used them), or the tier
    # thinning to which drops them (only thinned manifests used them); orphans and packs are on top
    freed_by_tier: dict[str, int] = field(default_factory=dict)
    thin_weight_bytes: int = 0  # raw bytes of derived weights that become blobs (compressed when written)
    archive_weight_bytes: int = 0  # raw bytes of weights the archive tier writes again, quantized against a base
    written_bytes: int | None = None  # once gc ran: what it wrote (thinning, archiving, repacking)
    pending_parts: int = 0  # parts kept for a finalize; their blobs are live
    freed_bytes: int = 0  # planned; after gc ran, what it freed
    runs: dict[int, str] = field(default_factory=dict)  # manifest -> its run, for naming steps in messages

    def summary(self) -> str:
        packs = ""
        if self.dead_packs or self.repack or self.orphan_packs:
            packs = (
                f"; delete {len(self.dead_packs)} empty and {len(self.orphan_packs)} orphan pack(s), "
                f"repack {len(self.repack)}"
            )
        parts = ""
        if self.drop_parts or self.pending_parts:
            parts = f"; drop {len(self.drop_parts)} part(s), keep {self.pending_parts} waiting for a finalize"
        if self.superseded:
            parts += f"; delete {len(self.superseded)} superseded manifest object(s)"
        thin = "".join(
            f"thin {len(steps)} manifest(s){self._steps(steps)} to {tier} (their other state: "
            f"{human(self.freed_by_tier.get(tier, 0))}), "
            for tier in TIERS
            if (steps := [(m, s) for m, s, t in self.thin if t == tier])
        )
        if self.thin_weight_bytes:
            thin += f"write {human(self.thin_weight_bytes)} of weights (raw), "
        if self.archive_weight_bytes:
            thin += f"archive {human(self.archive_weight_bytes)} of weights (raw; written quantized, smaller), "
        if self.written_bytes is not None:  # what it did: net of what it wrote
            freeing = f"freeing {human(self.freed_bytes)} net ({human(self.written_bytes)} written)"
        elif self.thin or self.repack:
            freeing = f"freeing {human(self.freed_bytes)}, less what it writes"
        else:
            freeing = f"freeing {human(self.freed_bytes)}"
        dropped = f" ({human(self.freed_by_tier['drop'])})" if self.thin and self.drop else ""
        return (
            f"{thin}drop {len(self.drop)} manifest(s){self._steps(self.drop)}{dropped}, "
            f"keep {len(self.keep)}; "
            "delete "
            f"{len(self.dead_blobs)} unreferenced blob(s), {len(self.orphan_files)} orphan blob file(s) and "
            f"{len(self.temp_files)} temp file(s){packs}{parts}, {freeing}"
        )

    def _steps(self, steps: list[tuple[int, int]]) -> str:
        return _steps_by_run(steps, self.runs)

    def doomed(self) -> tuple[set[str], set[str]]:
        """The blobs this plan leaves nowhere (dead rows, orphan objects) and the packs it deletes
        (a repacked pack too: a publication that names a blob there by an older row is stopped,
        and runs again after its sync finds the blob's new pack)."""
        blobs = set(self.dead_blobs) | set(self.orphan_files)
        return blobs, set(self.dead_packs) | set(self.repack) | set(self.orphan_packs)

    def thin_to(self, tier: str) -> list[int]:
        """The manifests this plan thins to ``tier``."""
        return [m for m, _, t in self.thin if t == tier]


def _steps(steps: list[int]) -> str:
    """`` (steps 3, 6)`` for a plan's line, nothing for none: a bare list read as if it were ids."""
    return f" (steps {', '.join(map(str, steps))})" if steps else ""


def _steps_by_run(steps: list[tuple[int, int]], runs: dict[int, str]) -> str:
    """`` (steps 3, 6)`` where every step is main's, else each run named: `` (main: steps 3, 6; ft: steps 2)``."""
    named: dict[str, list[int]] = {}
    for manifest, step in steps:
        named.setdefault(runs.get(manifest, MAIN_RUN), []).append(step)
    if set(named) <= {MAIN_RUN}:
        return _steps([s for _, s in steps])
    return " (" + "; ".join(f"{run}: steps {', '.join(map(str, s))}" for run, s in sorted(named.items())) + ")"


def kept_manifests(manifests: list[ManifestRecord], rules: Retention, bases: frozenset[int] = frozenset()) -> set[int]:
    """Pure: which manifests survive. Tags, pins, merges and the bases runs branched from
    always do. The rules count each run's steps on their own (``--keep-last 3`` keeps three
    steps of every run), and touch only ``rules.run`` when it is set."""
    if not rules.drops_manifests:
        return {m.id for m in manifests}
    keep = {m.id for m in manifests if m.tags or m.pinned or m.origin != COMMIT or m.id in bases}
    keep |= {m.id for m in manifests if rules.run is not None and m.run != rules.run}
    by_run: dict[str, list[ManifestRecord]] = {}
    for m in sorted((m for m in manifests if m.origin == COMMIT), key=lambda m: m.step):
        by_run.setdefault(m.run, []).append(m)
    for commits in by_run.values():
        if rules.keep_last:
            keep |= {m.id for m in commits[-rules.keep_last :]}
        if rules.keep_every:
            keep |= {m.id for m in commits if m.step % rules.keep_every == 0}
        if rules.keep_best:
            keep |= rules.keep_best.best(commits)
    return keep


def kept_as_best(repo: Repository, rules: list[Retention]) -> dict[int, tuple[str, ...]]:
    """The manifests each rule's keep-best keeps (``KeepBest.best``, each run counted on its own, as
    :func:`kept_manifests` counts them), with the rules' text: what the report page stars."""
    manifests = repo.view(GcPlanning).manifests()
    out: dict[int, tuple[str, ...]] = {}
    for one in rules:
        if one.keep_best is None:
            continue
        by_run: dict[str, list[ManifestRecord]] = {}
        for m in manifests:
            if m.origin == COMMIT and (one.run is None or m.run == one.run):
                by_run.setdefault(m.run, []).append(m)
        for commits in by_run.values():
            for manifest in sorted(one.keep_best.best(commits)):
                out[manifest] = (*out.get(manifest, ()), one.keep_best.text())
    return out


PART_AGE = 3600.0  # seconds: a save's parts arrive within minutes of one another; its finalize follows


def part_age() -> float:
    """How old a part must be before ``drop_parts`` takes it (``$TAILOR_DROP_PARTS_AFTER``): a
    save in flight has parts in the store that wait for its other ranks and its finalize, and a
    concurrent gc that took them made that save fail. Parts of a step already recorded are
    dropped at any age. The age is by the part's own ``created_at`` (the writer's clock), so the
    window also covers clock skew between hosts of a few minutes."""
    return seconds_from_env(PART_AGE_ENV, PART_AGE, most=365 * 86400.0)


def plan_gc(repo: StoreWriter, rules: Retention | list[Retention], *, drop_parts: bool = False) -> GcPlan:
    """What gc would do under ``rules`` (one set, or several each touching its own run). Blobs a
    pending part names are live (the part waits for its finalize); a part of a step already
    recorded is dropped, and every part when ``drop_parts``.

    In order: which manifests stay, go or are thinned; which parts go; which blobs die (no kept
    manifest, pending part or thinned step uses them); which packs die whole or are repacked;
    what lies in the backend that no row names (orphans, superseded versions, temp files)."""
    index = repo.view(GcPlanning)
    objects = repo.objects(GcPlanObjects)
    plan, tiers = _manifests_planned(index, rules)
    held = _parts_planned(objects, index, plan, drop_parts)
    _dead_blobs(repo, index, plan, tiers, held)
    dead_set = set(plan.dead_blobs)
    holdings = repo.holdings()  # sizes from the listing: no request per orphan on an object store
    _packs_planned(repo, objects, index, plan, dead_set, held, holdings)
    indexed = index.blob_hashes(loose_only=True)
    for name, size in holdings.blobs.items():
        if name not in indexed and name not in held:
            plan.orphan_files.append(name)
            plan.freed_bytes += size
    known = set(index.packs())
    for name, size in holdings.packs.items():
        if name not in known:
            plan.orphan_packs.append(name)
            plan.freed_bytes += size
    plan.superseded = superseded(objects)
    plan.temp_files = objects.leftovers()
    plan.freed_bytes += objects.leftover_bytes(plan.temp_files)  # a killed commit's temp files go too
    return plan


def _manifests_planned(index: GcPlanning, rules: Retention | list[Retention]) -> tuple[GcPlan, dict[int, str]]:
    """Which manifests each rule set keeps, drops or thins (and to which tier)."""
    manifests = index.manifests()
    bases = {r.base for r in index.created_runs().values() if r.base}
    base_ids = frozenset(m.id for m in manifests if m.object_key in bases)
    keep = {m.id for m in manifests}
    tiers: dict[int, str] = {}
    grids: dict[int, ArchiveGrid] = {}
    for one in [rules] if isinstance(rules, Retention) else rules:
        kept = kept_manifests(manifests, one, base_ids)
        for m in manifests:
            if m.id in kept:
                continue
            if one.thin and m.origin == COMMIT:  # thinned, not dropped (or left, if thin enough already)
                if thinner(one.thin, m.tier):
                    tiers[m.id] = one.thin
                    if one.grid is not None:
                        grids[m.id] = one.grid
            else:
                keep.discard(m.id)
    keep -= set(tiers)  # kept as they will be: their rows after thinning are counted below
    plan = GcPlan(
        drop=[(m.id, m.step) for m in manifests if m.id not in keep and m.id not in tiers],
        keep=[(m.id, m.step) for m in manifests if m.id in keep],
        thin=[(m.id, m.step, tiers[m.id]) for m in manifests if m.id in tiers],
        grids=grids,
        runs={m.id: m.run for m in manifests},
    )
    return plan, tiers


def _parts_planned(objects: Scanner, index: GcPlanning, plan: GcPlan, drop_parts: bool) -> set[str]:
    """The parts that go (of a recorded step, or old enough with ``drop_parts``); returns the blobs
    the pending ones hold."""
    held: set[str] = set()
    young = time.time() - part_age()  # parts newer than this may be of a save still in flight
    for part in read_parts(objects):
        plan.seen_parts.append(part.key)
        if (drop_parts and part.created_at < young) or index.commit_at(part.step, part.run) is not None:
            plan.drop_parts.append(part.key)
        else:
            plan.pending_parts += 1
            held |= part.blob_hashes()
    return held


def _dead_blobs(repo: StepReader, index: GcPlanning, plan: GcPlan, tiers: dict[int, str], held: set[str]) -> None:
    """The blobs no kept manifest, pending part or thinned step uses, and what each tier frees."""
    keep = {m for m, _ in plan.keep}
    contents = repo.view(Contents)
    thinned = {m: contents_of(contents, m, tier) for m, tier in tiers.items()}
    still = set().union(*(c.hashes() for c in thinned.values())) if thinned else set()
    dead = [b for b in index.blobs_unused_by(keep) if b.hash not in held and b.hash not in still]
    if thinned:
        by_drop = set().union(*(index.referenced_hashes(m) for m, _ in plan.drop)) if plan.drop else set()
        by_tier = {tier: set().union(*(index.referenced_hashes(m) for m in plan.thin_to(tier))) for tier in TIERS}
        plan.freed_by_tier["drop"] = sum(b.stored_size for b in dead if b.hash in by_drop)
        for tier, used in by_tier.items():
            plan.freed_by_tier[tier] = sum(b.stored_size for b in dead if b.hash in used and b.hash not in by_drop)
        plan.thin_weight_bytes = sum(a.nbytes for c in thinned.values() for a in c.materialize)
        plan.archive_weight_bytes = sum(
            a.nbytes for m in plan.thin_to(THIN_ARCHIVE) for a in thinned[m].atoms if archivable(a)
        )  # the dry run said only the norms' bytes, then wrote megabytes of archived weights
    plan.dead_blobs = [b.hash for b in dead]
    plan.dead_loose = [b.hash for b in dead if b.pack is None]
    plan.freed_bytes = sum(b.stored_size for b in dead if b.pack is None)


def _packs_planned(
    repo: BlobReader,
    objects: Reader,
    index: GcPlanning,
    plan: GcPlan,
    dead: set[str],
    held: set[str],
    holdings: Holdings,
) -> None:
    """The packs whose every blob died go; those mostly dead are repacked; a pack whose trailer
    places a blob elsewhere (or cannot be read) is kept."""
    candidates: dict[str, tuple[list[str], int]] = {}  # pack -> (the list it goes to, the bytes it frees)
    for name, size in index.packs().items():
        inside = index.blobs_in_pack(name)
        live = sum(b.stored_size for b in inside if b.hash not in dead)
        if not any(b.hash not in dead for b in inside):
            candidates[name] = (plan.dead_packs, size)
        elif size - live >= REPACK_AT * size:
            candidates[name] = (plan.repack, size - live)
    plan.misplaced, unreadable = misplaced_blobs(repo, objects, sorted(candidates), dead, held, holdings)
    keep_packs = unreadable | {pack for pack, _ in plan.misplaced.values()}
    for name, (goes_to, freed) in candidates.items():
        if name not in keep_packs:
            goes_to.append(name)
            plan.freed_bytes += freed


def misplaced_blobs(
    repo: BlobReader, objects: Reader, packs: list[str], dead: set[str], held: set[str], holdings: Holdings
) -> tuple[dict[str, tuple[str, PackEntry]], set[str]]:
    """Before gc deletes or repacks ``packs``, what their trailers say (I1, docs/FORMAT.md 8.1): a live
    blob there (not ``dead``, and indexed or ``held`` by a pending part) whose row names no place
    that stands (a listed loose object, or another listed pack whose own trailer holds it) was
    placed wrongly, by a manifest object that lied about where it was. Such a blob is placed
    again in the pack that holds it, and the pack stays. Returns {blob: (pack, entry)} and the
    packs whose trailer could not be read, which stay too (``verify`` names them)."""
    trailers: dict[str, set[str]] = {}
    misplaced: dict[str, tuple[str, PackEntry]] = {}
    unreadable: set[str] = set()

    def holds(pack: str, digest: str) -> bool:
        if pack not in trailers:
            try:
                trailers[pack] = {e.hash for e in read_trailer(objects, pack)[1]}
            except (FileNotFoundError, CorruptStoreError):
                trailers[pack] = set()
        return digest in trailers[pack]

    def fetch(name: str) -> list[PackEntry] | BaseException:
        try:
            return read_trailer(objects, name)[1]
        except (FileNotFoundError, CorruptStoreError) as exc:
            return exc

    with ThreadPoolExecutor(max(1, min(TRAILER_READERS, len(packs))), thread_name_prefix="tailor-gc") as pool:
        fetched = list(pool.map(fetch, packs))  # a round trip each on S3: read at once
    for name, entries in zip(packs, fetched, strict=True):
        if isinstance(entries, FileNotFoundError):
            continue  # gone already: nothing to delete
        if isinstance(entries, BaseException):
            log.warning("tailorstore: gc keeps pack %s: %s", name, entries)
            unreadable.add(name)
            continue
        trailers[name] = {e.hash for e in entries}
        for e in entries:
            if e.hash in dead or e.hash in misplaced:
                continue
            row = repo.blob(e.hash)
            if row is None and e.hash not in held:
                continue  # nothing names it: garbage
            if row is not None and (
                row.pack == name
                or (row.pack is None and e.hash in holdings.blobs)
                or (row.pack is not None and row.pack in holdings.packs and holds(row.pack, e.hash))
            ):
                continue
            misplaced[e.hash] = (name, e)
    return misplaced, unreadable


def gc(
    repo: Repository,
    rules: Retention,
    *,
    dry_run: bool = False,
    drop_parts: bool = False,
    lock_timeout: float = LOCK_TIMEOUT,
    progress: Progress | None = None,
    show_plan: Callable[[GcPlan], None] | None = None,
    clear_notices: bool = False,
) -> GcPlan:
    with operation("gc"):
        return _gc(repo, rules, dry_run, drop_parts, lock_timeout, progress, show_plan, clear_notices)


def _gc(
    repo: Repository,
    rules: Retention,
    dry_run: bool,
    drop_parts: bool,
    lock_timeout: float,
    progress: Progress | None,
    show_plan: Callable[[GcPlan], None] | None,
    clear_notices: bool,
) -> GcPlan:
    """gc's call order (docs/FORMAT.md section 8): lock exclusive and sync; plan; thin; delete parts
    and superseded objects; one transaction dropping manifests and rows; repack; delete blob and
    pack objects; temp files. Every deletion request is fenced on its own (``delete_many``)."""
    objects = repo.objects(GcObjects)
    with repo.lock(exclusive=True, timeout=lock_timeout, progress=progress) as lock:
        by_time = lock.by_time  # a lease: its deletions announce themselves first (gc_notices)
        listed = gc_notices.publications(objects) if by_time and not dry_run else set()
        repo.refresh(lock)  # what other hosts recorded before this lock was taken
        _refuse_damaged_tags(objects)
        if clear_notices and not dry_run:
            _clear_notices(objects, lock)
        elif by_time and not dry_run:
            _clear_abandoned_notices(objects, lock)
        plan = plan_gc(repo, effective_rules(repo, rules), drop_parts=drop_parts)
        if show_plan:
            show_plan(plan)
        if dry_run:
            return plan
        # Fencing (store/lease.py): before each step that deletes, gc must still hold its lease and be
        # alone; a gc that stalled past its lease stops there, having deleted nothing more.
        fence = _fence(lock)
        sweep = repo.view(GcSweep)
        written = 0
        for tier in TIERS:  # first: the blobs it materializes must exist before their masters go
            targets = [r for m in plan.thin_to(tier) if (r := sweep.manifest(m)) is not None]
            written += thin(repo, targets, tier, lock, grids=plan.grids)
        if plan.thin_to(THIN_ARCHIVE):  # which blobs die is known only once the archived weights exist
            plan = _replanned(repo, plan, effective_rules(repo, rules), drop_parts)
        fence()
        # superseded versions: marked first, then their refs carried to the current versions, then
        # deleted with their pins (a plain-form pin left behind would pin another run's manifest of
        # the same name: FORMAT.md 3.3). A host that writes a ref naming one of them after the carry
        # read its refs sees the mark and backs off (write, then read: FORMAT.md 8.1). Tombstones of
        # tags and pins stay: deleted by name, one could take a tag another host had just written
        # over it with it, should the delete land late.
        dropping = {
            *plan.superseded,
            *(r.object_key for m, _ in plan.drop if (r := sweep.manifest(m)) and r.object_key),
        }
        clear_stale_marks(objects, dropping, fence=fence)  # a killed gc's or rm's on steps kept
        mark_superseded(objects, plan.superseded, fence=fence)
        carry_refs(objects, plan.superseded, fence=fence)  # before their objects go
        superseded_pins = [pin_key(k) for k in plan.superseded]
        objects.delete_many([*plan.drop_parts, *plan.superseded, *superseded_pins], fence=fence)
        _drop_manifests(repo, objects, plan, fence)
        written += _repack(repo, objects, plan.repack, fence)
        _delete_dead_objects(objects, plan, sweep, listed if by_time else None, fence)
        objects.clear_leftovers(plan.temp_files)
        plan.freed_bytes -= written
        plan.written_bytes = written
    return plan


def _refuse_damaged_tags(objects: Scanner) -> None:
    """A tag object that names no manifest object: gc cannot tell which step it keeps."""
    if damaged := damaged_tags(objects):
        raise CorruptStoreError(
            f"the tag object(s) {', '.join(sorted(damaged)[:5])} name no manifest object, so gc cannot tell "
            "which step each keeps, and deletes nothing; set each again (",
            Call("tag", "STEP", damaged[0], force=True),
            "; untag it afterwards if it should go), then run gc again.",
        )


def _drop_manifests(repo: StoreWriter, objects: Editor, plan: GcPlan, fence: Callable[[], None]) -> None:
    """One transaction: blobs the packs' trailers place elsewhere, then the dropped manifests (their
    objects first, marked, then their rows), the dead blobs' and packs' rows."""
    with repo.transaction(GcDrop) as edit:
        fence()
        edit.upsert_blobs(  # where the packs' trailers say they are (misplaced_blobs)
            BlobRecord(h, e.raw_size, e.stored_size, e.codec, pack, e.offset, time.time())
            for h, (pack, e) in plan.misplaced.items()
        )
        # manifest objects first: a crash after them leaves only unreferenced blobs, which the next gc takes
        dropped = [m for m, _ in plan.drop]
        keys = [k for k in edit.object_keys(dropped).values() if k]
        mine = _mark_then_check(objects, keys, fence)
        try:
            unpublish(objects, keys, fence=fence)
        except LeaseLostError:  # its fence stopped it before the deleting request went out
            take_back_marks(objects, keys, mine, fence=fence)
            raise
        edit.delete_manifests(dropped)
        edit.delete_blobs(plan.dead_blobs)
        edit.delete_packs(plan.dead_packs)


def _delete_dead_objects(
    objects: Editor, plan: GcPlan, sweep: GcSweep, listed: set[str] | None, fence: Callable[[], None]
) -> None:
    """The blob and pack objects no row names now, each request fenced; on a leased store
    (``listed``: the publications seen when the lock was taken) announced by a notice first and
    withdrawn only once its deletions are done."""
    # Never delete an object an index row names now: a repack names its pack by its bytes, so it
    # can write again a pack the plan took for dead (one a killed gc had written before it could
    # point rows at it), and the row must win over the plan.
    named_packs = sweep.packs_named_by_blobs()
    loose = sweep.blob_hashes(loose_only=True)
    blobs = [n for n in [*plan.dead_loose, *plan.orphan_files] if n not in loose]
    packs = [n for n in [*plan.dead_packs, *plan.repack, *plan.orphan_packs] if n not in named_packs]
    notice = None
    if listed is not None and (blobs or packs):
        known = listed | {m.object_key for m in sweep.manifests() if m.object_key} | set(plan.seen_parts)
        notice = _announce_then_check(objects, plan, packs, known, fence)
    batch = objects.batch()
    for name in blobs:
        batch.delete(blob_key(name))
    for name in packs:
        batch.delete(pack_key(name))
    try:
        batch.publish(fence)  # the fence before each request: a stall between two must not delete a reused pack
        fence()
    except LeaseLostError:  # stopped before a request went out: what it sent is done, nothing more goes
        if notice is not None:
            gc_notices.withdraw(objects, notice)
        raise
    if notice is not None:
        gc_notices.withdraw(objects, notice)  # its deletions are done: only now


def _mark_then_check(objects: Editor, keys: list[str], fence: Callable[[], None]) -> list[str]:
    """Before dropping manifests: mark each, then read their refs (FORMAT 8.1). A pin or tag written
    before a marker is found here; one written after it finds the marker and backs off. So a ref
    reported set never names a step this gc drops, however long either host stalls after its
    checks. Found one: this gc takes back its own markers and stops, having dropped nothing."""
    taken, mine = mark_unless_claimed(objects, keys, fence=fence)
    if taken:
        raise LockTimeoutError(
            f"gc stopped: {len(taken)} step(s) it would drop were pinned or tagged meanwhile "
            f"({taken[0]}); it dropped nothing. Run ",
            Call("gc"),
            " again.",
        )
    return mine


def _announce_then_check(
    objects: Editor, plan: GcPlan, packs: list[str], known: set[str], fence: Callable[[], None]
) -> gc_notices.Notice:
    """Before deleting blob and pack objects on a leased store: announce them, then read what was
    published since gc listed (gc_notices, FORMAT 8.1). A publication put before the notice is seen
    here; one put after it reads the notice and takes itself back. Found one that needs them: gc
    withdraws its notice and stops, having deleted no blob."""
    gone, _ = plan.doomed()
    notice = gc_notices.announce(objects, gone, packs, fence=fence)
    try:
        found = gc_notices.published_since(objects, known, notice)
    except BaseException:
        gc_notices.withdraw(objects, notice)
        raise
    if found is not None:
        gc_notices.withdraw(objects, notice)
        raise LockTimeoutError(
            f"gc stopped before deleting blobs: {found} was published meanwhile and needs some of them; "
            "the dropped steps are gone, their blobs wait for the next gc. Run ",
            Call("gc"),
            " again.",
        )
    return notice


def _clear_notices(objects: Editor, lock: LockHandle | LeaseHandle) -> None:
    """Delete the notices that gcs which died left behind (the user says none of them still runs):
    until then, publications that need the blobs they name fail."""
    keys = gc_notices.notice_keys(objects)
    if keys:
        lock.check_alone("gc")
        objects.delete_many(keys)
        log.warning("tailorstore: gc cleared %d notice(s) left by gc runs that did not finish", len(keys))


def _clear_abandoned_notices(objects: Editor, lock: LockHandle | LeaseHandle) -> None:
    """Delete the notices of gcs that certainly died (this host, their pid free): alone under the
    exclusive lock, no gc that could still delete is theirs, and publishers already pass them over."""
    notices = gc_notices.abandoned(objects)
    if notices:
        lock.check_alone("gc")
        objects.delete_many([n.key for n in notices])
        log.info("tailorstore: gc deleted %d notice(s) of gc runs on this host that died", len(notices))


def _replanned(repo: StoreWriter, before: GcPlan, rules: Retention | list[Retention], drop_parts: bool) -> GcPlan:
    """The plan again, after archiving, under the same exclusive lock: the same steps drop (the
    archived ones are now thin enough to keep), and the dead blobs are those nothing uses now, so
    an archived blob that happens to equal one the first plan took for dead is never deleted."""
    after = plan_gc(repo, rules, drop_parts=drop_parts)
    if [m for m, _ in after.drop] != [m for m, _ in before.drop]:
        raise StoreError(
            "gc's plan changed while it archived steps under its own lock; the archived steps are "
            "recorded, nothing was deleted: run gc again"
        )
    after.thin, after.freed_by_tier = before.thin, before.freed_by_tier
    after.thin_weight_bytes = before.thin_weight_bytes
    after.archive_weight_bytes = before.archive_weight_bytes
    return after


def _fence(lock: LockHandle | LeaseHandle) -> Callable[[], None]:
    def check() -> None:
        failpoint("gc-before-delete")
        lock.check_alone("gc")

    return check


def _repack(repo: StoreWriter, objects: Editor, packs: list[str], fence: Callable[[], None]) -> int:
    """Move the live blobs of ``packs`` into new packs and point the index at them; returns
    the bytes written. The old packs stay until the caller deletes them, after this commits."""
    if not packs:
        return 0
    batch = objects.batch()
    writer = PackWriter(batch)
    moved = []
    for name in packs:
        for blob in repo.view(Repack).blobs_in_pack(name):
            data = objects.get(blob.key(), blob.pack_offset or 0, blob.stored_size)
            codec.check_raw_size(blob.raw_size, blob.stored_size, f"repacking pack {name}: blob {blob.hash}")
            raw = bytearray(blob.raw_size)  # decoded and hash-checked: a damaged blob is never carried over
            if archive_codec.is_archive(blob.codec):  # rebuilt on its chain, which still stands
                try:
                    repo.read_blob_into(blob, memoryview(raw), f"repacking pack {name}")
                except CorruptStoreError:
                    raw = bytearray()
            else:
                codec.decode_into(blob.codec, io.BytesIO(data), memoryview(raw), f"repacking pack {name}: {blob.hash}")
            if codec.content_hash(raw) != blob.hash:
                raise CorruptStoreError(
                    f"pack {name}: blob {blob.hash} does not match its hash; gc stopped before deleting anything "
                    "of that pack. Run ",
                    Call("verify", deep=True),
                    ".",
                )
            writer.add(blob.hash, data, blob.raw_size, blob.codec)
            moved.append(blob.hash)
    writer.flush()
    batch.publish()
    failpoint("gc-repack-written")
    with repo.transaction(Repack) as edit:
        fence()
        edit.add_packs(writer.sealed)
        edit.move_blobs({h: writer.placed[h] for h in moved})
        edit.delete_packs(packs)
    return sum(size for _, size in writer.sealed)
