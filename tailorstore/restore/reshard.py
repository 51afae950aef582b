"""Resharding: the native DeepSpeed layout for M ranks.

DeepSpeed refuses to resume a ZeRO checkpoint at another data-parallel world size ("used a DP
world size of 32 but the current world size is 128"); its own way round is two slow steps
(``ds_to_universal``, then ``load_universal``). Every atom already says which parameter, kind
and element range it holds, so the files DeepSpeed itself would have saved at M ranks can be
written straight from the store:

* ZeRO 1/2: each param group's parameters end to end (with their alignment paddings), padded to
  a multiple of 2*M elements and cut into M equal partitions; rank r's optimizer file holds its
  FP32 partition (the last rank's without the group padding, as DeepSpeed saves it), its Adam
  moments over the whole partition, the group's step, and ``param_slice_mappings`` naming every
  parameter fragment it holds.
* ZeRO 3: every parameter cut on its own into ``ceil(numel / M)`` elements per rank (the last
  rank's padded); rank r's flat group is its pieces end to end.

The model-states files are the saved ones with ``dp_world_size`` set to M (ZeRO 3 writes one per
rank). The plan (partitions, names, refusals) is made before anything is written; tensors are
read from the atoms, hash-checked, one partition at a time, without torch. ``--zero-stage``
switches between 1 and 2, which share one file layout; ZeRO 3's files differ in structure and
hold no module weights, so a change to or from 3 is refused.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial
from pathlib import Path, PurePosixPath
from typing import Any

from tailorstore.access.contents import Contents
from tailorstore.access.model_tensors import (
    ModelView,
    committed_tree,
    look_up_rows,
    model_view,
    rank0_optimizer_file,
    stream_elements,
    stream_float32,
)
from tailorstore.access.output_dir import staged, tree_bytes, write_torch_file
from tailorstore.access.placement import PlacedFiles
from tailorstore.core.atom_types import EXP_AVG, EXP_AVG_SQ, MASTER
from tailorstore.core.errors import Call, CorruptStoreError, StoreError
from tailorstore.core.local_files import write_new
from tailorstore.core.paths import safe_join
from tailorstore.core.progress import Progress, Silent
from tailorstore.core.records import FileRecord, ManifestRecord
from tailorstore.core.step_rules import refuse_thinned
from tailorstore.formats import deepspeed as ds
from tailorstore.formats.layout import DCP_FOLDER, MEGATRON
from tailorstore.formats.torch_pickle import DEEPSPEED_GLOBALS, Opaque, opaque_class, with_int_field
from tailorstore.formats.torch_save_writer import Parts, TensorOut
from tailorstore.formats.zero_partitions import Piece, zero3_pieces, zero12_pieces
from tailorstore.restore.checkout import CheckoutResult, placed_rows, write_step_files
from tailorstore.store.repo import BlobReader, Repository, StepReader

MAX_WORLD_SIZE = 65536
DP_WORLD_SIZE = "dp_world_size"  # the model-states field that names the world size
ALIGNMENT_FACTOR = 2  # DeepSpeed's nccl_start_alignment_factor: a group pads to a multiple of 2 * world size
_ZERO_STAGE_ENUM = opaque_class(DEEPSPEED_GLOBALS[2])
_FRAGMENT_ADDRESS = opaque_class(DEEPSPEED_GLOBALS[3])


@dataclass
class ReshardResult(CheckoutResult):
    """A checkout for another world size or ZeRO stage: what it wrote, and for which."""

    world_size: int = 0
    zero_stage: int = 0


@dataclass(frozen=True)
class ReshardPlan:
    """Everything decided before a byte is written: the source files, the target, the groups."""

    tag: str
    folder: str  # the tag folder's path in the manifest ("." when the tag folder itself was committed)
    world: int
    stage: int  # target ZeRO stage
    source_stage: int
    groups: tuple[tuple[tuple[str, int], ...], ...]  # per param group: (parameter, numel) in flat order
    alignment_paddings: tuple[tuple[int, ...], ...] | None  # ZeRO 1/2, per group and parameter
    states: FileRecord  # rank 0's model-states file
    optimizer: FileRecord  # rank 0's optimizer-states file
    optimizer_prefix: str  # "bf16_" or ""

    def optimizer_name(self, rank: int) -> str:
        return f"{self.optimizer_prefix}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"

    def states_names(self, ranks: Sequence[int] | None = None) -> list[str]:
        """The model-states files that ``ranks`` (default: every rank) load."""
        if self.stage == 3:
            chosen = range(self.world) if ranks is None else ranks
            return [f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in chosen]
        return ["mp_rank_00_model_states.pt"]

    def zero12_partition(self, group: int) -> tuple[int, int]:
        """(elements per partition, padding of the last rank) of a ZeRO 1/2 group at this world size."""
        paddings = self.alignment_paddings[group] if self.alignment_paddings else ()
        total = sum(n for _, n in self.groups[group]) + sum(paddings)
        alignment = ALIGNMENT_FACTOR * self.world
        aligned = math.ceil(total / alignment) * alignment
        per, padding = aligned // self.world, aligned - total
        if padding >= per:  # the last rank would hold padding only (or less than nothing)
            raise StoreError(
                f"world size {self.world}: parameter group {group} holds {total:,} elements, too few to give each of "
                f"{self.world} ranks a share (each would get {per:,}, and the last rank nothing but padding). "
                "Choose fewer ranks."
            )
        return per, padding


def check_target(view: ModelView, world: int, stage: int | None) -> int:
    """The target ZeRO stage, once the world size and the change of stage are ones this can write."""
    if not 1 <= world <= MAX_WORLD_SIZE:
        raise StoreError(f"world size {world}: give a number of data-parallel ranks from 1 to {MAX_WORLD_SIZE}.")
    source = view.zero_stage
    if source not in (1, 2, 3):
        raise StoreError(
            f"step {view.step} is a ZeRO-{source} save: ZeRO 0 keeps whole tensors, not partitions, and loads at any "
            "world size as it is; check it out as it is, with no new world size."
        )
    target = source if stage is None else stage
    if target not in (1, 2, 3):
        raise StoreError(f"ZeRO stage {target}: give 1, 2 or 3.")
    if (source == 3) != (target == 3):
        raise StoreError(
            f"ZeRO-{source} to ZeRO-{target}: DeepSpeed's ZeRO-3 files differ in structure from ZeRO 1/2 (no module "
            "weights in the model states, per-parameter partitions); change between stages 1 and 2 only. A "
            "universal checkpoint (",
            Call("checkout", format="universal"),
            ") loads under any stage.",
        )
    return target


def plan_reshard(view: ModelView, optimizer: FileRecord, tree: Any, world: int, target: int) -> ReshardPlan:
    """The reshard of ``view`` (rank 0's optimizer file and its tree given) to ``world`` ranks under ZeRO
    ``target`` (from :func:`check_target`), or a refusal that says why."""
    assert view.states_file is not None
    folder = str(PurePosixPath(view.states_file.path).parent)
    source = int(view.zero_stage or 0)
    match = ds.OPTIM_STATES.match(PurePosixPath(optimizer.path).name)
    prefix = f"{match.group(1)}_" if match and match.group(1) else ""
    osd = tree.get("optimizer_state_dict") if isinstance(tree, dict) else None
    if not isinstance(osd, dict):
        raise StoreError(f"step {view.step}: {optimizer.path} has no optimizer_state_dict")
    if source == 3 and not isinstance(osd.get("optimizer_state_dict"), dict):  # a manifest that lies about the stage
        raise CorruptStoreError(
            f"step {view.step}: its manifest says ZeRO-3, but {optimizer.path} holds no ZeRO-3 optimizer state; "
            "the manifest is damaged. Run ",
            Call("verify"),
            ".",
        )
    if source != 3 and ("base_optimizer_state" not in osd or "zero_stage" not in osd):
        raise StoreError(
            f"step {view.step}: {optimizer.path} is not in DeepSpeedZeroOptimizer's layout (a BF16_Optimizer save, "
            "ZeRO-1 with fp32 gradient accumulation?); tailorstore reshards ZeRO 1/2 and 3 saves only."
        )
    config = tree.get("ds_config") if isinstance(tree.get("ds_config"), dict) else {}
    if (config.get("zero_optimization") or {}).get("round_robin_gradients"):
        raise StoreError("the save used round_robin_gradients, whose partition order tailorstore does not write")
    shapes = {t.name: t.numel for t in view.tensors if t.kind == MASTER}
    by_group: dict[int, list[tuple[str, int]]] = {}
    for name, group in view.groups.items():
        by_group.setdefault(group, []).append((name, shapes.get(name, 0)))
    groups = tuple(tuple(by_group.get(g, [])) for g in range(max(by_group, default=-1) + 1))
    paddings = osd.get("param_alignment_paddings") if source != 3 else None
    aligned = tuple(tuple(int(p) for p in group) for group in paddings) if paddings else None
    tag = PurePosixPath(folder).name if folder != "." else f"global_step{view.step}"
    return ReshardPlan(tag, folder, world, target, source, groups, aligned, view.states_file, optimizer, prefix)


class _States:
    """The parameters' states as chunk streams: a partition is written piece by piece straight
    from the atoms (a parameter that straddles two partitions is decoded for each), so memory
    stays at a chunk whatever the partition's size."""

    def __init__(self, repo: BlobReader, view: ModelView, weights: PlacedFiles | None = None) -> None:
        self.store, self.view, self.weights = repo, view, weights
        self.masters = {t.name: t for t in view.tensors if t.kind == MASTER}
        self.any_thread = self._look_up_rows()  # may the streams run on read-ahead helper threads

    def _look_up_rows(self) -> bool:
        """Look up the blob rows of every master and moment, so that streaming them touches no SQL
        and can run on a read-ahead helper thread. False when one of them is derived (rebuilt
        through the index): then every stream stays on the caller's thread."""
        for name, master in self.masters.items():
            tensors = [master, *(self.view.state(name, k, master.shape) for k in self.view.moments(name))]
            for tensor in tensors:
                if any(atom.derived is not None for atom in tensor.atoms):
                    return False
                look_up_rows(self.store, self.view, tensor)
        return True

    def chunks(self, name: str, kind: str, start: int, numel: int) -> Iterator[memoryview]:
        master = self.masters[name]
        if kind == MASTER:
            chunks = stream_float32(self.store, self.view, master, start, numel)
            return chunks if self.weights is None else self.weights.passing(name, start, chunks)
        return stream_elements(self.store, self.view, self.view.state(name, kind, master.shape), start, numel)


_ZEROS = memoryview(bytes(1 << 20))


def _zeros(nbytes: int) -> Iterator[memoryview]:
    for at in range(0, nbytes, len(_ZEROS)):
        yield _ZEROS[: min(len(_ZEROS), nbytes - at)]


def _flat(states: _States, pieces: list[Piece], kind: str) -> Parts:
    """A flat float32 partition, its parameters' pieces and paddings end to end: one stream per
    piece, so that a read-ahead decodes several pieces of one partition at once."""
    return Parts(
        tuple(
            partial(_zeros, 4 * piece.numel)
            if piece.param is None
            else partial(states.chunks, piece.param, kind, piece.start, piece.numel)
            for piece in pieces
        )
    )


def _zero12_flat(states: _States, plan: ReshardPlan, group: int, rank: int, kind: str, length: int) -> Parts:
    partition, _ = plan.zero12_partition(group)
    paddings = plan.alignment_paddings[group] if plan.alignment_paddings else None
    return _flat(states, zero12_pieces(plan.groups[group], paddings, rank, partition, length), kind)


def _zero3_flat(states: _States, plan: ReshardPlan, group: int, rank: int, kind: str) -> tuple[int, Parts]:
    shapes = plan.groups[group]
    length = sum(math.ceil(n / plan.world) for _, n in shapes)
    return length, _flat(states, zero3_pieces(shapes, plan.world, rank, length), kind)


def _fragment(numel: int, start: int) -> Opaque:
    address = _FRAGMENT_ADDRESS.__new__(_FRAGMENT_ADDRESS)
    address.__dict__.update(numel=numel, start=start)
    return address


def _rank_zero12(saved: dict, states: _States, plan: ReshardPlan, rank: int) -> dict:
    """Rank ``rank``'s optimizer_state_dict at the new world size, keys in the saved order."""
    last = plan.world - 1
    out: dict[str, Any] = {}
    base = saved["base_optimizer_state"]
    group_of = ds.group_of_state_key(base.get("param_groups") or [])
    for key, value in saved.items():
        if key == "base_optimizer_state":
            state = {}
            for state_key, group_state in base["state"].items():
                g = group_of.get(str(state_key), int(state_key) if isinstance(state_key, int) else 0)
                partition, _ = plan.zero12_partition(g)
                state[state_key] = {
                    k: (TensorOut("float32", (partition,), _zero12_flat(states, plan, g, rank, k, partition),
                                  states.any_thread)
                        if k in (EXP_AVG, EXP_AVG_SQ) else v)
                    for k, v in group_state.items()
                }  # fmt: skip
            out[key] = {k: (state if k == "state" else v) for k, v in base.items()}
        elif key == "single_partition_of_fp32_groups":
            flats = []
            for g in range(len(plan.groups)):
                partition, padding = plan.zero12_partition(g)
                length = partition - (padding if rank == last else 0)
                build = _zero12_flat(states, plan, g, rank, MASTER, length)
                flats.append(TensorOut("float32", (length,), build, states.any_thread))
            out[key] = flats
        elif key == "group_paddings":
            out[key] = [plan.zero12_partition(g)[1] if rank == last else 0 for g in range(len(plan.groups))]
        elif key == "partition_count":
            out[key] = [plan.world] * len(plan.groups)
        elif key == "param_slice_mappings":
            mappings = []
            for g in range(len(plan.groups)):
                partition, _ = plan.zero12_partition(g)
                paddings = plan.alignment_paddings[g] if plan.alignment_paddings else None
                pieces = zero12_pieces(plan.groups[g], paddings, rank, partition)
                mappings.append(
                    OrderedDict((p.param, _fragment(p.numel, p.offset)) for p in pieces if p.param is not None)
                )
            out[key] = mappings
        elif key == "zero_stage" and plan.stage != plan.source_stage:
            out[key] = _ZERO_STAGE_ENUM(plan.stage)
        else:
            out[key] = value
    return out


def _rank_zero3(saved: dict, states: _States, plan: ReshardPlan, rank: int) -> dict:
    out: dict[str, Any] = {}
    inner = saved["optimizer_state_dict"]
    group_of = ds.group_of_state_key(inner.get("param_groups") or [])
    for key, value in saved.items():
        if key == "fp32_flat_groups":
            flats = []
            for g in range(len(plan.groups)):
                length, build = _zero3_flat(states, plan, g, rank, MASTER)
                flats.append(TensorOut("float32", (length,), build, states.any_thread))
            out[key] = flats
        elif key == "optimizer_state_dict":
            state = {}
            for state_key, group_state in inner["state"].items():
                g = group_of.get(str(state_key), 0)
                moments = {}
                for k, v in group_state.items():
                    if k in (EXP_AVG, EXP_AVG_SQ):
                        length, build = _zero3_flat(states, plan, g, rank, k)
                        moments[k] = TensorOut("float32", (length,), build, states.any_thread)
                    else:
                        moments[k] = v
                state[state_key] = moments
            out[key] = {k: (state if k == "state" else v) for k, v in inner.items()}
        elif key == "partition_count":
            out[key] = plan.world
        else:
            out[key] = value
    return out


def _states_in_place(
    repo: StepReader, facts: ManifestRecord, plan: ReshardPlan, root: Path, beside: list[FileRecord]
) -> PlacedFiles | None:
    """Under ZeRO 1/2 the model-states file at M ranks is the saved one with ``dp_world_size`` set to
    M: written in place from its container (:mod:`placement`), that one field patched, its weights
    rounded from the masters as the optimizer files stream them instead of the masters being read
    and decoded a second time; so are those of the files ``beside`` it (written as they were). None
    (the file is then re-pickled from its tree) under ZeRO 3, for a file committed without a
    container, or when the new world size does not fit the saved field."""
    if plan.stage == 3 or plan.source_stage == 3 or placed_rows([plan.states]) != [plan.states]:
        return None
    files = PlacedFiles(repo, facts, [plan.states, *beside], root)
    try:
        if files.rewrite_record(
            plan.states.path, "/data.pkl", partial(with_int_field, key=DP_WORLD_SIZE, value=plan.world)
        ):
            return files
    except BaseException:
        files.close()
        raise
    files.close()
    for row in files.rows:
        safe_join(root, row.path).unlink()
    return None


def _write_beside(
    on_caller: Callable[[], None],
    rank_file: Callable[[int], None],
    ranks: Sequence[int],
    any_thread: bool,
    progress: Progress,
) -> None:
    """The model-states files on the caller's thread while a worker writes the optimizer files.

    Re-pickled, a bf16 save's module weights are rebuilt from their masters through the index,
    which only the caller's thread may use (written in place, only their stored tensors are left
    to it); the optimizer files read no SQL when every state is stored (``any_thread``). Written
    one after the other, the model states left the other core and the disk idle for a quarter of
    the run. The progress bar advances on the caller's thread only."""
    if not any_thread:
        on_caller()
        for rank in ranks:
            rank_file(rank)
            progress.advance(1)
        return
    with ThreadPoolExecutor(1, thread_name_prefix="tailor-reshard") as pool:
        futures = [pool.submit(rank_file, rank) for rank in ranks]
        try:
            on_caller()
            for future in futures:
                future.result()
                progress.advance(1)
        except BaseException:
            for future in futures:
                future.cancel()
            raise


def _chosen_ranks(ranks: Sequence[int] | None, world: int) -> list[int]:
    if ranks is None:
        return list(range(world))
    chosen = sorted(set(ranks))
    if not chosen or chosen[0] < 0 or chosen[-1] >= world:
        raise StoreError(f"ranks {list(ranks)} are not ranks of a world of {world}")
    return chosen


def _is_zero_file(row: FileRecord) -> bool:
    name = PurePosixPath(row.path).name
    return ds.is_model_states(name) or ds.is_optim_states(name)


@dataclass
class _Setup:
    """What a resharded step is made from, decided before any byte is read or written."""

    store: Repository
    manifest: int
    facts: ManifestRecord
    files: list[FileRecord]
    view: ModelView
    plan: ReshardPlan
    saved_tree: Any  # the source optimizer file's tree (tensors read lazily: only the step counters are read)

    def states_tree(self) -> Any:
        """The model-states file's tree for the new world size (its tensors streamed when written)."""
        where = f"step {self.facts.step}, file {self.plan.states.path}"
        tree = committed_tree(self.store, self.manifest, self.plan.states, where)
        tree[DP_WORLD_SIZE] = self.plan.world
        return tree

    def optimizer_tree(self, states: _States, rank: int) -> Any:
        """Rank ``rank``'s optimizer-states file's tree at the new world size."""
        rebuild = _rank_zero3 if self.plan.stage == 3 else _rank_zero12
        return {
            **self.saved_tree,
            "optimizer_state_dict": rebuild(self.saved_tree["optimizer_state_dict"], states, self.plan, rank),
        }


def _setup(repo: StepReader, selector: str, world_size: int | None, zero_stage: int | None) -> _Setup:
    manifest = repo.resolve(selector)
    facts = repo.manifest(manifest)
    refuse_thinned(facts.step, facts.tier, "a resharded checkpoint")
    if world_size is None:
        world_size = facts.world_size or 1
    if facts.layout == MEGATRON:
        raise StoreError(
            f"step {facts.step} is a Megatron-Core save: dist_checkpointing.load reshards it as it reads it, at any "
            "tensor, pipeline or data parallel size; check it out as it is."
        )
    view = model_view(repo, manifest)
    files = repo.view(Contents).files(manifest)
    if view.states_file is None:
        raise StoreError(
            f"step {facts.step} holds no DeepSpeed model states to reshard"
            + (
                ": a DCP checkpoint reshards when dcp.load reads it, at any world size; check it out as it is"
                if facts.layout == DCP_FOLDER
                else ""
            )
        )
    where = f"step {facts.step}"
    target = check_target(view, world_size, zero_stage)
    optimizer = rank0_optimizer_file(files, str(PurePosixPath(view.states_file.path).parent))
    if optimizer is None:
        raise StoreError(f"step {view.step} holds no optimizer-states file of rank 0; it has no ZeRO state to reshard")
    # the source optimizer file's tree (tensors read lazily: only the step counters are ever read)
    saved_tree = committed_tree(repo, manifest, optimizer, f"{where}, file {optimizer.path}")
    plan = plan_reshard(view, optimizer, saved_tree, world_size, target)
    return _Setup(repo, manifest, facts, files, view, plan, saved_tree)


def resharded_trees(
    repo: StepReader, selector: str, *, world_size: int, zero_stage: int | None = None
) -> tuple[str, dict[str, Callable[[], Any]]]:
    """The ZeRO files of the step ``selector`` names as DeepSpeed would have saved them on
    ``world_size`` ranks, as object trees built on demand instead of files (the tag, and each file's
    path below the tag folder with the function that builds its tree): what a resume loads straight
    from the store. Only files of DeepSpeed's tag folder; the trees stream their tensors from the
    atoms, hash-checked, when they are loaded (``restore/file_objects.py``)."""
    setup = _setup(repo, selector, world_size, zero_stage)
    plan = setup.plan
    states = _States(repo, setup.view)
    trees: dict[str, Callable[[], Any]] = {name: setup.states_tree for name in plan.states_names()}
    for rank in range(plan.world):
        trees[plan.optimizer_name(rank)] = partial(setup.optimizer_tree, states, rank)
    return plan.tag, trees


def checkout_resharded(
    repo: Repository,
    selector: str,
    out: Path,
    *,
    world_size: int | None,
    zero_stage: int | None = None,
    ranks: Sequence[int] | None = None,
    progress: Progress | None = None,
) -> ReshardResult:
    """Write the step ``selector`` names at ``out`` as DeepSpeed would have saved it on ``world_size``
    ranks (default: the save's own) under ZeRO ``zero_stage`` (default: the save's own).

    ``ranks`` writes only the ZeRO files those data-parallel ranks load (with every other file of
    the step): what one node of a job needs, so that each node materializes its own share."""
    began = time.perf_counter()
    setup = _setup(repo, selector, world_size, zero_stage)
    manifest, facts, files, view, plan = setup.manifest, setup.facts, setup.files, setup.view, setup.plan
    chosen = _chosen_ranks(ranks, plan.world)
    states_tree = setup.states_tree()
    in_tag = [f for f in files if str(PurePosixPath(f.path).parent) == plan.folder]
    extras = [f for f in in_tag if not _is_zero_file(f)]  # anything else DeepSpeed's tag folder held
    others = [f for f in files if str(PurePosixPath(f.path).parent) != plan.folder]
    progress = progress or Silent()
    count = 0
    try:
        with repo.reading_manifest(manifest), staged(Path(out), repo) as tmp:
            progress.start(f"step {facts.step} for {plan.world} ranks", len(chosen))
            tag_dir = tmp / plan.tag
            tag_dir.mkdir()
            root = tmp if plan.folder != "." else tag_dir
            # an HF Trainer's model.safetensors beside the tag folder: its weights fed the same way
            in_place = _states_in_place(repo, facts, plan, root, placed_rows(others) if root == tmp else [])
            with in_place or nullcontext():  # its files closed on any error
                written_in_place = in_place.rows if in_place is not None else []
                write_step_files(repo, facts, [f for f in others if f not in written_in_place], tmp)
                write_step_files(repo, facts, extras, root)
                states = _States(repo, view, in_place)

                def optimizer_file(rank: int) -> None:
                    write_torch_file(tag_dir / plan.optimizer_name(rank), setup.optimizer_tree(states, rank))

                def states_files() -> None:
                    if in_place is not None:
                        in_place.place_stored(lambda n: None)  # its weights come as the optimizer files pass
                        return
                    for name in plan.states_names(chosen):
                        write_torch_file(tag_dir / name, states_tree)

                _write_beside(states_files, optimizer_file, chosen, states.any_thread, progress)
                if in_place is not None:
                    in_place.finish()
            if not (tmp / "latest").exists():
                write_new(tmp / "latest", plan.tag.encode())  # `engine.load_checkpoint(out)` finds the tag by it
            count = len(others) + len(extras) + len(plan.states_names(chosen)) + len(chosen)
            written = tree_bytes(tmp)
    finally:
        progress.close()
    seconds = time.perf_counter() - began
    return ReshardResult(
        facts.step, manifest, Path(out), written, count, seconds=seconds, tag=plan.tag, world_size=plan.world,
        zero_stage=plan.stage,
    )  # fmt: skip
