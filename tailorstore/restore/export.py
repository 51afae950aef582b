"""Exporting: a consolidated Hugging Face model folder from a stored step of any layout the store
holds layer-wise (DeepSpeed, DCP, an HF Trainer's safetensors or bin, a plain torch.save):
:func:`~tailorstore.access.model_tensors.model_view` says which atoms tile each parameter.

What ``zero_to_fp32`` does from a checkout, done straight from the atoms: each parameter's
FP32 master is read piece by piece from every rank's partition (hash-checked), rounded to the
requested dtype and streamed into ``model.safetensors`` (sharded above ``max_shard_size``,
with ``model.safetensors.index.json``) a chunk at a time, decoded on a helper thread ahead of
the writer (:mod:`read_ahead`): memory stays at a few chunks whatever the size of a tensor, and
neither torch nor DeepSpeed is imported. Tied parameters are written once, under the name DeepSpeed
registered, as ``save_pretrained`` does; ``from_pretrained`` ties them again from the config.

An HF Trainer checkpoint's ``config.json``, ``generation_config.json`` and tokenizer files are
copied, so ``AutoModelForCausalLM.from_pretrained(out)`` loads the folder; for a plain
DeepSpeed save, ``config`` names a ``config.json`` to add. The folder appears whole or not at
all (see :mod:`output_dir`).
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

from tailorstore.access.contents import Contents
from tailorstore.access.model_tensors import (
    ModelTensor,
    ModelView,
    look_up_rows,
    model_view,
    stream_elements,
    stream_float32,
)
from tailorstore.access.output_dir import staged
from tailorstore.access.read_ahead import ReadAhead
from tailorstore.core.errors import BadCheckpointError, StoreError
from tailorstore.core.local_files import write_new
from tailorstore.core.progress import Progress, Silent
from tailorstore.core.rounding import rounded_chunks
from tailorstore.formats import dcp
from tailorstore.formats.kinds import RAW
from tailorstore.formats.safetensors_writer import (
    DEFAULT_SHARD_SIZE,
    INDEX_FILE,
    TensorSpec,
    header_bytes,
    index_json,
    parse_size,
    plan_shards,
    shard_names,
)
from tailorstore.formats.small_text import read_small_text
from tailorstore.restore.checkout import write_step_files
from tailorstore.restore.folder_result import FolderResult
from tailorstore.store.backends.direct_io import SequentialWriter
from tailorstore.store.repo import Repository, StepReader

EXPORT_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
# Files of an HF checkpoint that from_pretrained and the tokenizer read next to the weights.
MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "tokenizer.model",
    "spiece.model",
    "chat_template.jinja",
    "chat_template.json",
)


@dataclass
class ExportResult(FolderResult):
    dtype: str
    tensors: int
    shards: list[str]
    copied: list[str] = field(default_factory=list)  # config and tokenizer files
    tied: dict[str, str] = field(default_factory=dict)  # written once: alias -> name written


def export_dtype(name: str) -> str:
    try:
        return EXPORT_DTYPES[name]
    except KeyError:
        raise StoreError(f"dtype {name!r}: choose one of {', '.join(EXPORT_DTYPES)}.") from None


# Names that only optimizer state has (torch.optim's state_dict, flattened by DCP): an export that
# would write one has misread the step, and says so rather than write moments as weights.
_OPTIMIZER_NAME = re.compile(rf"(^|\.)({'|'.join(dcp.OPTIMIZER_TOPS)})\.(state|param_groups)\.|\.(exp_avg|exp_avg_sq)$")


def refuse_optimizer_names(step: int, names: list[str]) -> None:
    """Pure: an export holds only the model's parameters and buffers; a name of optimizer state means
    the step's layout was misread (as the DCP tutorial's ``Stateful`` wrapper can be:
    tests/unit/restore/test_export.py, ``test_an_export_refuses_names_of_optimizer_state``)."""
    strays = [n for n in names if _OPTIMIZER_NAME.search(n)]
    if strays:
        raise BadCheckpointError(
            f"step {step}: {len(strays)} tensor(s) to export are named as optimizer state ({strays[0]!r}"
            f"{', ...' if len(strays) > 1 else ''}); an export holds only the model's weights. The step's "
            "layout was read wrongly; please report it with the save's layout."
        )


def output_specs(view: ModelView, dtype: str) -> list[TensorSpec]:
    """What each tensor becomes: floating ones in ``dtype``, others (integer buffers) as they are."""
    refuse_optimizer_names(view.step, [t.name for t in view.tensors])
    return [TensorSpec(t.name, dtype if t.floating else t.dtype, t.shape) for t in view.tensors]


def tensor_chunks(repo: StepReader, view: ModelView, tensor: ModelTensor, dtype: str) -> Iterator[memoryview]:
    """The tensor's bytes as written, a chunk at a time (each hash-checked as its blob ends):
    floating tensors as float32 rounded to ``dtype`` (ties to even, as torch's ``.to``), others
    (integer buffers) as they are."""
    if not tensor.floating:
        return stream_elements(repo, view, tensor)
    values = stream_float32(repo, view, tensor)
    return values if dtype == "float32" else rounded_chunks(values, dtype)


def read_ahead(repo: StepReader, view: ModelView, order: list[ModelTensor], dtype: str) -> ReadAhead:
    """The tensors of ``order`` decoded on a helper thread while the caller writes (see
    :mod:`read_ahead`: memory stays at its slots, not at the largest tensor). A derived weight
    is rebuilt on the caller's thread, which holds the index its master is looked up in."""
    for tensor in order:
        look_up_rows(repo, view, tensor)  # so that the helper needs no SQL
    sources = [partial(tensor_chunks, repo, view, tensor, dtype) for tensor in order]
    return ReadAhead(sources, [all(a.derived is None for a in t.atoms) for t in order])


def _model_config(config: Path) -> str:
    """The text of the config to add, checked as ``from_pretrained`` will read it: a JSON object
    naming its ``model_type`` (a wrong path would otherwise make a folder that does not load)."""
    if not config.is_file():
        raise BadCheckpointError(f"{config}: no such file; give the path of a model's config.json.")
    text = read_small_text(config, "a model's config.json")
    try:
        doc = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise BadCheckpointError(f"{config}: not JSON ({exc}); give the path of a model's config.json.") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("model_type"), str):
        raise BadCheckpointError(
            f"{config}: not a model's config (a JSON object with a model_type, as save_pretrained writes it); "
            "give the path of the config.json of the model that was trained."
        )
    return text


def export_step(
    repo: Repository,
    selector: str,
    out: Path,
    *,
    dtype: str = "bf16",
    max_shard_size: str = DEFAULT_SHARD_SIZE,
    config: Path | None = None,
    progress: Progress | None = None,
) -> ExportResult:
    """Write the step ``selector`` names as a consolidated model folder at ``out``."""
    began = time.perf_counter()
    target_dtype = export_dtype(dtype)
    limit = parse_size(max_shard_size)
    config_text = _model_config(Path(config)) if config is not None else None
    manifest = repo.resolve(selector)
    view = model_view(repo, manifest)
    # Plan everything before writing: shard names, headers, the files to copy.
    specs = output_specs(view, target_dtype)
    shards = plan_shards(specs, limit)
    names = shard_names(len(shards))
    by_name = {t.name: t for t in view.tensors}
    copies = [f for f in repo.view(Contents).files(manifest) if f.kind == RAW and f.path in MODEL_FILES]
    if config is not None:
        copies = [f for f in copies if f.path != "config.json"]
    if config is None and not any(f.path == "config.json" for f in copies):
        (progress or Silent()).warn(
            f"step {view.step} holds no config.json; pass a config to make the folder loadable by from_pretrained"
        )
    out = Path(out)
    written = 0
    progress = progress or Silent()
    try:
        with staged(out, repo) as tmp:
            progress.start(f"export step {view.step}", sum(s.nbytes for s in specs))
            order = [by_name[s.name] for shard in shards for s in shard]
            ahead = read_ahead(repo, view, order, target_dtype)  # looks up every row first: the plan
            with repo.reading_manifest(view.manifest, view.rows.values()), ahead:
                i = 0
                for shard, name in zip(shards, names, strict=True):
                    with SequentialWriter(tmp / name, 0o644) as f:  # around the page cache (direct_io)
                        f.write(header_bytes(shard))
                        for spec in shard:
                            size = 0
                            for chunk in ahead.chunks(i):
                                f.write(chunk)
                                size += len(chunk)
                            if size != spec.nbytes:
                                raise StoreError(f"{spec.name}: came out at {size} bytes, not {spec.nbytes}")
                            progress.advance(spec.nbytes)
                            i += 1
                    written += (tmp / name).stat().st_size
            if len(shards) > 1:
                write_new(tmp / INDEX_FILE, index_json(shards, names).encode())
            write_step_files(repo, repo.manifest(manifest), copies, tmp)  # top-level files, hash-checked
            if config_text is not None:
                write_new(tmp / "config.json", config_text.encode())  # the bytes checked, not a second read
            for path in tmp.iterdir():
                os.chmod(path, 0o644)
    finally:
        progress.close()
    copied = sorted({r.path for r in copies} | ({"config.json"} if config is not None else set()))
    return ExportResult(
        view.step,
        manifest,
        out,
        written,
        dtype,
        len(specs),
        names,
        copied,
        dict(view.aliases),
        seconds=time.perf_counter() - began,
    )
