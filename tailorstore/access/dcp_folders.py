"""A stored step's DCP folders, and each folder's ``.metadata`` read back from the store as hostile
input: what the model view (export) and the DCP storage reader both start from."""

from __future__ import annotations

from pathlib import PurePosixPath

from tailorstore.core.errors import BadCheckpointError, Call, CorruptStoreError, UnsafePickleError
from tailorstore.core.records import FileRecord
from tailorstore.formats import dcp
from tailorstore.formats.kinds import DCP, RAW
from tailorstore.formats.megatron import CONFIG as MEGATRON_CONFIG
from tailorstore.store.repo import BlobReader


def dcp_folders(files: list[FileRecord]) -> list[str]:
    """Pure: the DCP folders among a step's files (``""`` for one at the step's top)."""
    folders = {str(PurePosixPath(f.path).parent) for f in files if f.kind == DCP}
    return sorted("" if f == "." else f for f in folders)


def folder_metadata(
    repo: BlobReader, step: int, files: list[FileRecord], folder: str
) -> tuple[dcp.DcpMetadata, dict[str, FileRecord]]:
    """The checked ``.metadata`` of one DCP folder of a step, and its ``.distcp`` rows by file name.
    A folder with Megatron's ``metadata.json`` beside is a Megatron save, read with the classes its
    planner adds (``dcp.read_metadata``), as its commit read it."""
    prefix = f"{folder}/" if folder else ""
    distcp = {
        f.path[len(prefix) :]: f
        for f in files
        if f.kind == DCP and f.path.startswith(prefix) and "/" not in f.path[len(prefix) :]
    }
    row = next((f for f in files if f.path == f"{prefix}{dcp.METADATA}" and f.kind == RAW), None)
    where = f"step {step}, file {prefix}{dcp.METADATA}"
    if row is None:
        raise CorruptStoreError(f"step {step}: the DCP folder {folder or '.'} has no .metadata; run ", Call("verify"))
    megatron = any(f.path == f"{prefix}{MEGATRON_CONFIG}" for f in files)
    sizes = {n: f.raw_size for n, f in distcp.items()}
    try:
        meta = dcp.read_metadata(repo.read_blob(row.blob, where), where, sizes, megatron=megatron)
    except (BadCheckpointError, UnsafePickleError) as exc:
        raise CorruptStoreError(f"{exc} (read from the store); run ", Call("verify"), ".") from None
    return meta, distcp
