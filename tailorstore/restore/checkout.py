"""Checking out: write a manifest back in its native layout, every byte checked.

Files are written into a hidden sibling directory and renamed to ``--out`` only when every
file is complete, fsynced and every blob has matched its hash. A failed or killed
checkout therefore never leaves a directory that looks complete under the requested
name; the hidden ``.NAME.tailor-partial-*`` directory a killed one leaves is deleted by the
next checkout or export to that name (see :mod:`output_dir`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from tailorstore.access import placement
from tailorstore.access.atom_reader import blob_of, stream_blob
from tailorstore.access.contents import Contents
from tailorstore.access.output_dir import staged
from tailorstore.core.errors import CorruptStoreError
from tailorstore.core.local_files import create_new, write_new
from tailorstore.core.paths import safe_join
from tailorstore.core.progress import Progress, Silent
from tailorstore.core.records import FileRecord, ManifestRecord
from tailorstore.core.step_rules import refuse_thinned
from tailorstore.formats.deepspeed import file_rank, is_model_states, is_optim_states
from tailorstore.formats.kinds import DCP, RAW, SAFETENSORS, TORCH
from tailorstore.formats.layout import DCP_FOLDER, DEEPSPEED_TAG, MEGATRON
from tailorstore.formats.megatron import WRITTEN_LAST
from tailorstore.formats.torch_pickle import untrusted
from tailorstore.restore.folder_result import FolderResult
from tailorstore.store.repo import BlobReader, Repository, StepReader


@dataclass
class CheckoutResult(FolderResult):
    files: int
    inherited: dict[str, int] = field(default_factory=dict)  # layer -> source step, for composites
    # the DeepSpeed tag folder it wrote below ``out`` (``engine.load_checkpoint(out, tag)``), if any:
    # told, so that no caller reads the folder back to learn it
    tag: str | None = None


def inherited_layers(repo: Repository, manifest: int) -> dict[str, int]:
    step = repo.manifest(manifest).step
    return {x.layer: x.source_step for x in repo.view(Contents).layers(manifest) if x.source_step != step}


def checkout_step(
    repo: Repository,
    selector: str,
    out: Path,
    *,
    trust_pickles: bool = False,
    progress: Progress | None = None,
    threads: int | None = None,
    ranks: Sequence[int] | None = None,
) -> CheckoutResult:
    began = time.perf_counter()
    progress = progress or Silent()
    manifest = repo.resolve(selector)
    facts = repo.manifest(manifest)
    step = facts.step
    refuse_thinned(facts.step, facts.tier, "a checkout")
    out = Path(out)
    files = repo.view(Contents).files(manifest)
    if ranks is not None:  # one node's share: the files its data-parallel ranks load
        files = [f for f in files if loaded_by(PurePosixPath(f.path).name, set(ranks))]
    inherited = inherited_layers(repo, manifest)
    if inherited:
        names = ", ".join(f"{layer} (from step {src})" for layer, src in sorted(inherited.items()))
        progress.warn(f"step {step} is a composite: these layers come from other steps: {names}")
    for row in files:
        safe_join(out, row.path)  # refuse before writing anything
        if row.trusted and not trust_pickles:
            raise untrusted(f"step {step}, file {row.path}")
    try:
        with repo.reading_manifest(manifest), staged(out, repo) as tmp:
            progress.start(f"checkout step {step}", sum(r.raw_size for r in files))
            written = write_step_files(
                repo, facts, files, tmp, trust_pickles=trust_pickles, advance=progress.advance, threads=threads
            )
            if facts.layout == DEEPSPEED_TAG and facts.ds_tag and not any(r.path == "latest" for r in files):
                # A tag folder was committed; `engine.load_checkpoint(out)` needs `latest` to find it.
                write_new(tmp / "latest", facts.ds_tag.encode())
            if dcp_folder_itself(facts, files):
                lift(tmp, str(facts.ds_tag))
    finally:
        progress.close()
    tag = facts.ds_tag if facts.ds_tag and any(r.path.startswith(f"{facts.ds_tag}/") for r in files) else None
    if dcp_folder_itself(facts, files):
        tag = None  # the step is ``out`` itself
    seconds = time.perf_counter() - began
    return CheckoutResult(step, manifest, out, written, len(files), inherited, tag=tag, seconds=seconds)


def dcp_folder_itself(facts: ManifestRecord, files: list[FileRecord]) -> bool:
    """Pure: whether a checkout writes the step as ``out`` itself: a DCP folder committed by itself
    (``step-6/``), which ``dcp.load(..., checkpoint_id=out)`` then reads, or a Megatron
    ``iter_N/`` folder (``dist_checkpointing.load(sd, out)``). A DeepSpeed tag folder keeps its
    name below ``out``, since ``engine.load_checkpoint(out)`` looks for it there, and so does a
    Megatron run folder's iteration, beside its tracker file (Megatron-LM's ``--load out``)."""
    tag = facts.ds_tag
    return facts.layout in (DCP_FOLDER, MEGATRON) and bool(tag) and all(f.path.startswith(f"{tag}/") for f in files)


def last_written(facts: ManifestRecord, rows: list[FileRecord]) -> list[FileRecord]:
    """Pure: the files in the order a checkout writes them. A Megatron save's ``metadata.json``
    (and then ``integrity.json``) come after every other file, as Megatron writes them: Megatron
    takes ``metadata.json`` for "this checkpoint is complete", so no reader that looks into the
    folder (a checkout written in place by a tool that copies it file by file) may see it first."""
    if facts.layout != MEGATRON:
        return rows

    def rank(row: FileRecord) -> int:
        name = PurePosixPath(row.path).name
        return 1 + WRITTEN_LAST.index(name) if name in WRITTEN_LAST else 0

    return sorted(rows, key=rank)


def lift(root: Path, folder: str) -> None:
    """Move the contents of ``root/folder`` up into ``root`` (a new folder of ours, not yet in place)."""
    inner = root / folder
    for child in list(inner.iterdir()):
        child.rename(root / child.name)
    inner.rmdir()


def loaded_by(name: str, ranks: set[int]) -> bool:
    """Whether DeepSpeed's ranks ``ranks`` load the file ``name``: their own optimizer files (and
    ZeRO 3's per-rank model states), the shared model states, and every file of no rank."""
    if is_optim_states(name) or (is_model_states(name) and "zero_pp_rank_" in name):
        return file_rank(name) in ranks
    return True


def placed_rows(rows: list[FileRecord]) -> list[FileRecord]:
    """The files written in place from a container and atoms (:mod:`placement`); the rest are
    whole-file blobs, or files committed without a container (by tailorstore 0.1)."""
    return [row for row in rows if row.container is not None and row.kind in (TORCH, SAFETENSORS, DCP)]


def write_step_files(
    repo: StepReader,
    facts: ManifestRecord,
    rows: list[FileRecord],
    root: Path,
    *,
    trust_pickles: bool = False,
    advance: Callable[[int], None] = lambda n: None,
    threads: int | None = None,
) -> int:
    """Write files of manifest ``facts`` under ``root`` byte for byte, every byte hash-checked: those
    with a container placed around their atoms, whole-file blobs streamed, files committed without a
    container (by tailorstore 0.1) re-pickled by torch. Returns the bytes written."""
    manifest, step = facts.id, facts.step
    written = 0
    rows = last_written(facts, rows)
    placed = placed_rows(rows)
    if placed:
        placement.write_files(repo, facts, placed, root, advance=advance, threads=threads)
        written += sum(safe_join(root, row.path).stat().st_size for row in placed)
    placed_paths = {row.path for row in placed}
    for row in rows:
        if row.path in placed_paths:
            continue
        target = safe_join(root, row.path)
        target.parent.mkdir(parents=True, exist_ok=True)
        where = f"step {step}, file {row.path}"
        if row.kind == RAW:
            write_raw_blob(repo, row.blob, target, where)
        elif row.kind in (TORCH, SAFETENSORS):
            # Files committed without a container (by tailorstore 0.1) are re-pickled by torch; importing
            # it here, not at the top, keeps the two seconds it costs off every checkout that needs none.
            from tailorstore.restore import repickle

            repickle.write_file(repo, manifest, row, target, where, trust_pickles)
        else:
            raise CorruptStoreError(f"{where}: unknown file kind {row.kind!r}; upgrade tailorstore")
        os.chmod(target, (row.mode or 0o644) & 0o777)  # never setuid, setgid or sticky
        written += target.stat().st_size
        advance(row.raw_size)
    return written


def write_raw_blob(repo: BlobReader, digest: str, target: Path, where: str) -> None:
    """A whole-file blob, streamed through one reused buffer and hash-checked: memory stays at a chunk."""
    row = blob_of(repo, digest, where)
    with os.fdopen(create_new(target), "wb") as out:  # a new file of our own hidden folder
        for piece in stream_blob(repo, row, 0, row.raw_size, where):
            out.write(piece)
