"""The universal layout: DeepSpeed's universal checkpoint, straight from atoms.

DeepSpeed resumes at another world size from a *universal* checkpoint: one folder per
parameter under ``<tag>/zero/`` holding its full FP32 master and Adam moments
(``fp32.pt``, ``exp_avg.pt``, ``exp_avg_sq.pt``, and ``step.pt`` under ZeRO 1 and 2),
``<tag>/zero/optimizer_state.pt`` with the optimizer's settings, the model-states files as
they were, and ``latest_universal`` naming the tag. ``ds_to_universal`` makes it from a save by
writing every rank's fragments out and merging them; here each parameter's pieces are read
from the store once, hash-checked, and written whole, without torch (``torch_save_writer``).
``engine.load_checkpoint`` with ``"checkpoint": {"load_universal": true}`` then loads it at any
world size. The folder appears whole or not at all.

ZeRO 1, 2 and 3 are written (under ZeRO 3, as ds_to_universal does, the state files hold flat
tensors, there is no step.pt, and optimizer_state.pt carries rank 0's whole optimizer state);
ZeRO 0 is refused before anything is written (DeepSpeed has no universal path from it).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from functools import partial
from pathlib import Path, PurePosixPath
from typing import Any

from tailorstore.access.contents import Contents
from tailorstore.access.model_tensors import (
    ModelTensor,
    ModelView,
    committed_tree,
    look_up_rows,
    model_view,
    rank0_optimizer_file,
    read_raw,
    skeleton_tree,
    stream_elements,
    stream_float32,
    tiling,
)
from tailorstore.access.output_dir import staged, tree_bytes, write_torch_file
from tailorstore.access.placement import PlacedFiles
from tailorstore.core.atom_types import MASTER, STEP
from tailorstore.core.errors import Call, CorruptStoreError, StoreError
from tailorstore.core.local_files import write_new
from tailorstore.core.paths import safe_join
from tailorstore.core.progress import Progress, Silent
from tailorstore.core.records import FileRecord
from tailorstore.core.step_rules import refuse_thinned
from tailorstore.formats import deepspeed as ds
from tailorstore.formats.kinds import TORCH
from tailorstore.formats.torch_save_writer import TensorOut
from tailorstore.restore.checkout import CheckoutResult, placed_rows, write_step_files
from tailorstore.store.repo import Repository, StepReader

UNIVERSAL = "universal"
LATEST_UNIVERSAL = "latest_universal"
# What ds_to_universal leaves out of optimizer_state.pt: the per-rank partitions it writes per parameter.
WRITERS = 3  # on 2 cores: two decode and write while a third waits for its reads
_SHARDED = ("base_optimizer_state", "param_slice_mappings", "single_partition_of_fp32_groups")


@dataclass
class UniversalResult(CheckoutResult):
    """A checkout as DeepSpeed's universal checkpoint: what it wrote, and how many parameters."""

    tag: str = ""
    params: int = 0


def _optimizer_file(files: list[FileRecord], folder: str, step: int) -> FileRecord:
    found = rank0_optimizer_file(files, folder)
    if found is None:
        raise StoreError(
            f"step {step} holds no optimizer-states file of rank 0; a universal checkpoint needs the optimizer "
            "state (a checkpoint saved without it can be exported with ",
            Call("export"),
            ").",
        )
    return found


def _check_stage(view: ModelView) -> None:
    if view.states_file is None:
        raise StoreError(
            f"step {view.step} holds no DeepSpeed model states; the universal layout is DeepSpeed's. "
            "Check it out as it is, or export its weights as a model folder."
        )
    if view.zero_stage in (1, 2, 3):
        return
    raise StoreError(
        f"step {view.step} is a ZeRO-{view.zero_stage} save; DeepSpeed loads universal checkpoints of ZeRO 1 "
        "to 3 only (no ZeRO 0: DeepSpeed #7200). Check it out as it is."
    )


def _whole(view: ModelView, name: str, kind: str, shape: tuple[int, ...]) -> ModelTensor:
    tensor = view.state(name, kind, shape)
    if tensor.dtype != "float32":
        raise StoreError(f"step {view.step}: the {kind} of {name} is {tensor.dtype}, not float32; upgrade tailorstore")
    return tensor


def _step_tensor(repo: StepReader, view: ModelView, group: int) -> TensorOut | None:
    """The Adam step of a parameter group, as rank 0's optimizer holds it (a scalar tensor)."""
    pieces = [a for a in view.pieces.get((f"group.{group}", STEP), []) if a.rank == 0]
    tiled = tiling(pieces, 1)
    if not tiled:
        return None
    step = ModelTensor(f"group.{group}", (), tiled[0].dtype, tiled, STEP)
    return TensorOut(step.dtype, tuple(json.loads(tiled[0].shape)), read_raw(repo, view, step))


def _optimizer_state(repo: StepReader, manifest: int, row: FileRecord, where: str, stage: int) -> dict[str, Any]:
    """optimizer_state.pt as ds_to_universal writes it. ZeRO 1/2: rank 0's optimizer settings without
    the partitions. ZeRO 3: rank 0's whole optimizer state (its partition included, read from the
    atoms as the file is written) with the param groups also at the top."""
    if stage == 3:
        tree = committed_tree(repo, manifest, row, where)
        osd = tree.get("optimizer_state_dict") if isinstance(tree, dict) else None
        inner = osd.get("optimizer_state_dict") if isinstance(osd, dict) else None
        if not isinstance(inner, dict) or "param_groups" not in inner:
            raise StoreError(f"{where}: not a ZeRO-3 optimizer-states file (no optimizer_state_dict inside)")
        osd["param_groups"] = inner["param_groups"]
        return osd
    tree = skeleton_tree(repo, row, where)
    osd = tree.get("optimizer_state_dict") if isinstance(tree, dict) else None
    base = osd.get("base_optimizer_state") if isinstance(osd, dict) else None
    if not isinstance(base, dict) or "param_groups" not in base:
        raise StoreError(f"{where}: not a ZeRO 1/2 optimizer-states file (no base_optimizer_state)")
    out = {k: v for k, v in osd.items() if k not in _SHARDED}
    out["param_groups"] = base["param_groups"]
    return out


def _state_file(tensor: ModelTensor, data: Callable[[], Iterator[memoryview]], stage: int, moments: bool) -> Any:
    """What ds_to_universal puts in fp32.pt, exp_avg.pt and exp_avg_sq.pt: under ZeRO 1/2 a dict of
    the tensor in its shape and the dimension tensor parallelism would cut; under ZeRO 3 the flat tensor.
    A parameter without optimizer state (a save before the first step) gets ds_to_universal's fallback,
    fp32.pt from the module's weights as {"param": ...} alone; the masters equal those weights then."""
    if stage == 3:
        return TensorOut("float32", (tensor.numel,), data)
    param = TensorOut("float32", tensor.shape, data)
    return {"cat_dim": 0, "param": param} if moments else {"param": param}


def _write_all(jobs: Iterable[Job], progress: Progress, meanwhile: Callable[[], None]) -> int:
    """Write the per-parameter files on :data:`WRITERS` threads: one waits on the store's disk
    while others decode and write (preadv, zstd, numpy, crc32 and file writes release the GIL).
    Returns how many files were written.

    Each file is handed to the writers as soon as it is planned, so they start on the first
    (the largest) while this thread looks up the rest in the index. ``meanwhile`` runs on this
    thread next: the model-states file, whose weights are rebuilt from their masters through the
    index (which only this thread may use), and took a third of the whole run when it went first
    on its own."""
    futures: dict[Future[None], int] = {}
    with ThreadPoolExecutor(WRITERS, thread_name_prefix="tailor-universal") as pool:
        try:
            for path, tree, elements in jobs:
                futures[pool.submit(write_torch_file, path, tree)] = elements
            meanwhile()
            for future in as_completed(futures):
                future.result()
                progress.advance(futures[future])
        except BaseException:
            for future in futures:
                future.cancel()
            raise
    return len(futures)


Job = tuple[Path, Any, int]


def _jobs(
    repo: StepReader, view: ModelView, trainable: list[ModelTensor], tag_dir: Path, stage: int, weights: PlacedFiles
) -> Iterator[Job]:
    """Every per-parameter file to write: (path, what it holds, its bytes for the progress bar),
    the largest parameters first: the embedding's and the head's files (each one blob, decoded as
    one stream) no longer come last, with two writers idle while the third finishes them.
    Each tensor streams from its atoms a chunk at a time (memory stays at a chunk); fp32.pt's
    master chunks also feed the model-states file's weights."""
    steps: dict[int, TensorOut | None] = {}  # a group's step, read once for all of its parameters
    for tensor in sorted(trainable, key=lambda t: -t.numel):
        param_dir = safe_join(tag_dir / "zero", tensor.name)
        param_dir.mkdir(parents=True)
        contents = {"fp32": partial(_fp32_feeding, repo, view, tensor, weights)}
        moments = view.moments(tensor.name)  # none before the first step: no moment files then
        if len(moments) == 1:
            raise CorruptStoreError(
                f"step {view.step}: {tensor.name} has an {moments[0]} but no other Adam moment; run ", Call("verify")
            )
        for kind in moments:
            state = _whole(view, tensor.name, kind, tensor.shape)
            look_up_rows(repo, view, state)  # here: the writer threads must not touch the index
            contents[kind] = partial(stream_elements, repo, view, state)
        for name, chunks in contents.items():
            yield param_dir / f"{name}.pt", _state_file(tensor, chunks, stage, bool(moments)), tensor.numel * 4
        if stage != 3:
            group = view.groups.get(tensor.name, 0)
            if group not in steps:
                steps[group] = _step_tensor(repo, view, group)
            if steps[group] is not None:
                yield param_dir / "step.pt", steps[group], 0


def _fp32_feeding(repo: StepReader, view: ModelView, master: ModelTensor, weights: PlacedFiles) -> Iterator[memoryview]:
    """The master's FP32 chunks for fp32.pt, each also rounded into the model-states file's copy of its weight."""
    return weights.passing(master.name, 0, stream_float32(repo, view, master))


def checkout_universal(
    repo: Repository, selector: str, out: Path, *, progress: Progress | None = None
) -> UniversalResult:
    """Write the step ``selector`` names as a universal checkpoint at ``out`` (``out/<tag>/zero/...``)."""
    began = time.perf_counter()
    manifest = repo.resolve(selector)
    facts = repo.manifest(manifest)
    refuse_thinned(facts.step, facts.tier, "a universal checkpoint")
    view = model_view(repo, manifest)
    _check_stage(view)
    files = repo.view(Contents).files(manifest)
    assert view.states_file is not None
    folder = str(PurePosixPath(view.states_file.path).parent)
    tag = PurePosixPath(folder).name if folder != "." else (facts.ds_tag or f"global_step{facts.step}")
    optimizer = _optimizer_file(files, folder, facts.step)
    states = [
        f
        for f in files
        if f.kind == TORCH
        and ds.is_model_states(PurePosixPath(f.path).name)
        and str(PurePosixPath(f.path).parent) == folder
    ]
    trainable = [t for t in view.tensors if t.kind == MASTER]
    if not trainable:
        raise StoreError(f"step {facts.step} holds no FP32 masters; there is no universal checkpoint to write of it")
    stage = int(view.zero_stage or 0)
    settings = _optimizer_state(repo, manifest, optimizer, f"step {facts.step}, file {optimizer.path}", stage)
    progress = progress or Silent()
    written = count = 0
    try:
        with repo.reading_manifest(manifest), staged(Path(out), repo) as tmp:
            progress.start(f"universal checkpoint of step {facts.step}", sum(t.numel * 12 for t in trainable))
            tag_dir = tmp / tag
            tag_dir.mkdir()
            # the model-states files as they are (`load_universal` reads the module and scheduler there),
            # and every file outside the tag folder (an HF Trainer's config, trainer state, RNG states)
            others = [f for f in files if str(PurePosixPath(f.path).parent) != folder]
            states_root = tmp if folder != "." else tag_dir
            # their weights rounded from the masters fp32.pt streams (an HF Trainer's model.safetensors
            # too, when it shares their root)
            fed = placed_rows(states) + (placed_rows(others) if states_root == tmp else [])
            count += len(states) + len(others)
            with PlacedFiles(repo, facts, fed, states_root) as model_states:
                jobs = _jobs(repo, view, trainable, tag_dir, stage, model_states)

                def meanwhile() -> None:
                    model_states.place_stored(lambda n: None)
                    write_step_files(repo, facts, [f for f in states if f not in fed], states_root)
                    write_step_files(repo, facts, [f for f in others if f not in fed], tmp)

                count += _write_all(jobs, progress, meanwhile)
                model_states.finish()
            write_torch_file(tag_dir / "zero" / "optimizer_state.pt", settings)
            write_new(tmp / LATEST_UNIVERSAL, tag.encode())
            count += 2
            written = tree_bytes(tmp)
    finally:
        progress.close()
    seconds = time.perf_counter() - began
    return UniversalResult(
        facts.step, manifest, Path(out), written, count, seconds=seconds, tag=tag, params=len(trainable)
    )
