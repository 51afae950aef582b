"""Every reader of bytes from outside, as a fuzz target: input files (torch zips and their
pickles, DCP metadata, safetensors headers) and store objects another host or anyone with bucket
access may have written (manifests, parts, leases, pack trailers, archive descriptors, metrics, the
store's marker), and the files a user or a job leaves beside them (merge specs, a job's head).

A target takes the bytes and a scratch folder, and reads them as tailorstore would. The rule
(``benchmarks/fuzz.py`` checks it): every input gives a result or one of tailorstore's errors
(``TailorError``), within the memory and time caps, and leaves no process-wide state changed (the
seed reads back as it did). Nothing here imports torch but the two targets of torch's own
``weights_only`` loader (``formats/safe_load.py``: the fallback for files the torch-free reader hands
back, and committed skeletons) and the job head (its package, the DeepSpeed integration's, imports
torch), which import it when they run and get the larger address-space cap of :data:`MEMORY_MB`;
the others fit 512 MiB.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from tailorstore.core.errors import UnsafePickleError
from tailorstore.formats.dcp import read_metadata
from tailorstore.formats.safetensors_file import read_safetensors
from tailorstore.formats.source import InputFile
from tailorstore.formats.torch_pickle import MemorySource, load_pickle_tree, object_refusal, read_torch_zip
from tailorstore.store import archive_codec, parts
from tailorstore.store.backends.location import resolve
from tailorstore.store.manifests import document
from tailorstore.store.packs import pack as packs

Target = Callable[[bytes, Path], Any]


def _file(data: bytes, work: Path, name: str) -> Path:
    path = work / name
    path.write_bytes(data)
    return path


def torch_zip(data: bytes, work: Path) -> Any:
    with InputFile(_file(data, work, "fuzz.pt")) as src:
        found = read_torch_zip(src, "fuzz.pt")
    return None if found is None else repr(found[0])[:2000]


def pickle_tree(data: bytes, work: Path) -> Any:
    return repr(load_pickle_tree(data, "data.pkl"))[:2000]


def dcp_metadata(data: bytes, work: Path) -> Any:
    meta = read_metadata(data, ".metadata", {"__0_0.distcp": 1 << 20, "__1_0.distcp": 1 << 20})
    return sorted(meta.tensors)


def megatron_metadata(data: bytes, work: Path) -> Any:
    """A Megatron save's ``.metadata``, read with the planner classes its layout widens DCP's
    allowlist by, against the sizes of the ``.distcp`` files of the seed's save (tests/data/megatron)."""
    sizes = {f"__{r}_{k}.distcp": 1 << 20 for r in range(2) for k in range(2)}
    meta = read_metadata(data, ".metadata", sizes, megatron=True)
    return sorted(meta.tensors)


def dcp_object(data: bytes, work: Path) -> Any:
    """A DCP object item's bytes as the reader reads them back from the store before it hands them
    to ``dcp.load`` (``DcpStep.object_bytes``): the allowlist's verdict, or the refusal it raises."""
    why = object_refusal(MemorySource(data), "object item")
    if why is not None:
        raise UnsafePickleError(f"object item: {why}")
    return "passed"


def torch_fallback(data: bytes, work: Path) -> Any:
    """A torch file as the fallback loads it (``load_torch_file``: torch's ``weights_only`` loader
    under the allowlist), as a commit does for a file the torch-free reader hands back and the
    DeepSpeed engine does for what it staged."""
    from tailorstore.formats.safe_load import load_torch_file

    obj, _ = load_torch_file(_file(data, work, "fuzz.pt"), mmap=False)
    return repr(obj)[:2000]


def skeleton(data: bytes, work: Path) -> Any:
    """A committed file's skeleton as a checkout reads it back from the store (``load_skeleton``)."""
    from tailorstore.formats.safe_load import load_skeleton

    return repr(load_skeleton(data, "skeleton", trusted=False, trust_pickles=False))[:2000]


def safetensors_file(data: bytes, work: Path) -> Any:
    with InputFile(_file(data, work, "model.safetensors")) as src:
        found = read_safetensors(src, "model.safetensors")
    return None if found is None else [(e.path, e.tensor.shape) for e in found[1]]


def manifest_object(data: bytes, work: Path) -> Any:
    # a key without a step: the seeds are real objects of several steps, and the check of a key's step
    # against the content (one comparison) would stop every seed before the rows it is here to fuzz
    doc = document.decode(data, "manifests/main/fuzz.json.zst")
    return (doc.manifest.step, len(doc.files), len(doc.atoms), len(doc.blobs))


def part_object(data: bytes, work: Path) -> Any:
    part = parts.decode(data, "parts/main/fuzz.json.zst")  # no step in the key: as manifest_object says
    return (part.step, len(part.files), len(part.atoms))


def _backend(work: Path) -> Any:
    return resolve(str(work / "store")).backend


def lease_object(data: bytes, work: Path) -> Any:
    from tailorstore.store.lease import _read

    backend = _backend(work)
    backend.put("locks/fuzz.json", data)
    return _read(backend, "locks/fuzz.json", 0.0)


def gc_notice(data: bytes, work: Path) -> Any:
    from tailorstore.store import gc_notices

    backend = _backend(work)
    key = f"{gc_notices.NOTICE_PREFIX}fuzz.json.zst"
    backend.put(key, data)
    notice = gc_notices.read_notice(backend, key)
    return None if notice is None else (len(notice.blobs), len(notice.packs))


def pack_trailer(data: bytes, work: Path) -> Any:
    backend = _backend(work)
    name = "ab" * 16
    backend.put(packs.pack_key(name), data)
    return packs.read_trailer(backend, name)


def archive_descriptor(data: bytes, work: Path) -> Any:
    return archive_codec.parse(data.decode(errors="replace"), 1 << 20, "blob")


def merge_spec(data: bytes, work: Path) -> Any:
    from tailorstore.core.errors import MergeSpecError
    from tailorstore.curate.averaging import is_averaging, parse_average
    from tailorstore.curate.merge import parse_spec
    from tailorstore.curate.merge_spec import load_spec

    spec = load_spec(_file(data, work, "spec.yaml"))
    if is_averaging(spec):
        return parse_average(spec, "spec.yaml")
    if not isinstance(spec, dict):
        raise MergeSpecError("not a mapping")
    return parse_spec(spec, list(range(6)), "spec.yaml")


def metrics_text(data: bytes, work: Path) -> Any:
    from tailorstore.core.metric_values import decode

    return decode(data.decode(errors="replace"))


def store_marker(data: bytes, work: Path) -> Any:
    from tailorstore.store.repo import MARKER, store_id

    backend = _backend(work)
    backend.put(MARKER, data)
    return store_id(backend)


def job_head(data: bytes, work: Path) -> Any:
    from tailorstore.integrations.deepspeed.head import HEAD_FILE, read_head

    _file(data, work, HEAD_FILE)
    return read_head(work)


TARGETS: dict[str, Target] = {
    "torch-zip": torch_zip,
    "pickle": pickle_tree,
    "dcp-metadata": dcp_metadata,
    "megatron-metadata": megatron_metadata,
    "dcp-object": dcp_object,
    "safetensors": safetensors_file,
    "manifest": manifest_object,
    "part": part_object,
    "lease": lease_object,
    "pack-trailer": pack_trailer,
    "gc-notice": gc_notice,
    "archive-descriptor": archive_descriptor,
    "merge-spec": merge_spec,
    "metrics": metrics_text,
    "store-marker": store_marker,
    "head": job_head,
    "torch-fallback": torch_fallback,
    "skeleton": skeleton,
}
# Address-space caps above the default: torch's import alone maps more than 512 MiB.
MEMORY_MB: dict[str, int] = {"torch-fallback": 1536, "skeleton": 1536, "head": 1536}
# Modules a target imports, imported before its inputs' time caps start (torch takes seconds).
IMPORTS: dict[str, str] = {
    "torch-fallback": "tailorstore.formats.safe_load",
    "skeleton": "tailorstore.formats.safe_load",
    "head": "tailorstore.integrations.deepspeed.head",  # its package imports torch (the engine)
}
