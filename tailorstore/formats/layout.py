"""Recognising what kind of checkpoint directory the user handed us.

Three shapes are accepted, as users meet them:

* a DeepSpeed save directory (``latest`` plus ``global_stepN/``): the tag that ``latest``
  names is committed, with the top-level files beside it;
* one DeepSpeed tag folder (``global_stepN/`` with ``*_model_states.pt``);
* a Hugging Face Trainer ``checkpoint-N/`` folder, with or without DeepSpeed inside (or FSDP's
  DCP folders, ``pytorch_model_fsdp_0/`` and ``optimizer_0/``);
* the folder Accelerate's ``save_state`` writes under FSDP with a sharded state dict
  (``checkpoint_N/``: the same two DCP folders, and Accelerate's own files beside them, its
  random states and scheduler): one step, as the HF Trainer's, without ``trainer_state.json``;
* a PyTorch distributed checkpoint (DCP) folder, ``.metadata`` plus ``__R_K.distcp`` files, as
  ``dcp.save`` writes it for FSDP2 and torchtitan (``step-N/``): committed like a DeepSpeed tag
  folder (a checkout writes its files as the output folder itself, which ``dcp.load`` reads);
* a Megatron-Core ``torch_dist`` save (``iter_NNNNNNN/``: DCP's files beside ``common.pt`` and
  ``metadata.json``), or the run folder that holds such saves and
  ``latest_checkpointed_iteration.txt``, whose named iteration is committed with the tracker file
  (``formats/megatron``); a save without ``metadata.json`` did not finish and is refused;
* a plain folder of weights or training-state files (``model.safetensors`` shards, ``ckpt.pt``),
  or one such file: every ``torch.save`` file the torch-free reader takes and every safetensors
  file is cut into atoms, the rest kept whole.
"""

from __future__ import annotations

import json
import logging
import os
import re
import stat
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from tailorstore.core.errors import BadCheckpointError, Call, UnsafePathError
from tailorstore.core.local_files import Beneath, Where, stat_input
from tailorstore.core.paths import check_relative
from tailorstore.formats import megatron as mg
from tailorstore.formats.deepspeed import has_latest, is_model_states, is_optim_states, read_latest
from tailorstore.formats.small_text import read_small_text
from tailorstore.formats.source import changed, refused

log = logging.getLogger("tailorstore")

DEEPSPEED = "deepspeed"
DEEPSPEED_TAG = "deepspeed-tag"
HF_TRAINER = "hf-trainer"
ACCELERATE = "accelerate"  # Accelerate's save_state folder under FSDP (its DCP folders and its own files)
DCP_FOLDER = "dcp"
MEGATRON = "megatron"  # Megatron-Core's torch_dist save: an iter_N folder, or its run folder with the tracker
PLAIN_FOLDER = "plain"  # weights or training-state files, no framework's layout (model.safetensors, ckpt.pt)
PLAIN_FILE = "plain-file"  # one such file, committed by its own path
PLAIN_SUFFIXES = (".safetensors", ".pt", ".pth", ".bin", ".ckpt")
DCP_METADATA = ".metadata"  # formats/dcp.py reads it; named here so that detecting imports no reader
TAG_PLACEHOLDER = "{tag}"


@dataclass
class CheckpointLayout:
    root: Path  # paths are recorded relative to this directory
    kind: str
    step: int | None
    ds_tag: str | None
    files: list[str] = field(default_factory=list)  # relative posix paths, in commit order
    # files held in memory, not under ``root`` (the DCP writer's): relative path -> a path that
    # opens the very memory file (``/proc/self/fd/N``), and the DCP metadata that cuts them
    memory: dict[str, Path] = field(default_factory=dict)
    dcp_metadata: Any = None  # formats/dcp.DcpMetadata, built from the save plan (no .metadata file read)

    def source(self, rel: str) -> Path:
        """Where a file of the layout is read from."""
        return self.memory.get(rel) or self.root / rel

    def place(self, rel: str) -> Where:
        """How a file of the layout is opened: a memory file by its own path; any other beneath the
        folder the commit was given (a link inside it is followed within it, never out of it), and
        a single file committed by its own path as that very file, never a link."""
        if rel in self.memory:
            return self.memory[rel]
        if self.kind == PLAIN_FILE:
            return Beneath(self.root, rel, links=False)
        top = self.committed
        if top == self.root:
            return Beneath(top, rel)
        return Beneath(top, PurePosixPath(rel).relative_to(str(self.ds_tag)).as_posix())

    def where(self, rel: str) -> str:
        """What errors call a file of the layout."""
        return f"{rel} (in memory)" if rel in self.memory else str(self.root / rel)

    @property
    def committed(self) -> Path:
        """The folder (or file) the commit was given, which errors name: the root itself, or for a
        layout rooted at its parent the one its paths are under (an error named the parent folder)."""
        if self.kind in (DEEPSPEED_TAG, DCP_FOLDER, PLAIN_FOLDER, PLAIN_FILE) and self.ds_tag:
            return self.root / self.ds_tag
        if self.kind == MEGATRON and self.ds_tag and mg.TRACKER not in self.files:
            return self.root / self.ds_tag  # one iter_N folder, rooted at its parent
        return self.root

    def file_key(self, rel: str) -> str:
        """The path with the tag folder replaced, so that the same file of two steps matches."""
        if self.ds_tag and (rel == self.ds_tag or rel.startswith(self.ds_tag + "/")):
            return TAG_PLACEHOLDER + rel[len(self.ds_tag) :]
        return rel


def step_from_name(name: str) -> int | None:
    """The step a folder's name carries (``global_step12``, ``checkpoint-12``, Accelerate's
    ``checkpoint_12``, ``step-12``), or None."""
    match = re.search(r"(?:global_step|checkpoint-|checkpoint_|step-|step_|step|ckpt-|ckpt_|iter_)(\d+)$", name)
    return int(match.group(1)) if match else None


def _tag_files(tag_dir: Path, prefix: str, part: bool = False) -> list[str]:
    """The tag folder's files, model states first. A part (one host's share of a save) may lack
    other ranks' files (finalize checks the whole step), but not the model states, whose
    parameter shapes cut the optimizer states (DeepSpeed's ``use_node_local_storage`` writes
    them on every node). DeepSpeed writes no folders into a tag folder: a link to one is refused as
    links are everywhere in a checkpoint, and a folder is left out with a warning that names it."""
    for p in sorted(tag_dir.iterdir()):
        if p.is_dir() and p.is_symlink():
            raise BadCheckpointError(
                f"{p}: a symbolic link to a directory; tailorstore does not follow links inside a checkpoint. "
                "Replace it with the files themselves, or remove it."
            )
        if p.is_dir():
            log.warning("tailorstore: %s is a folder inside a DeepSpeed tag folder; it is not committed", p)
    names = sorted(p.name for p in tag_dir.iterdir() if _listed(p))
    model = [n for n in names if is_model_states(n)]
    if part and not model and any(is_optim_states(n) for n in names):
        raise BadCheckpointError(
            f"{tag_dir}: a part needs the model states file (mp_rank_00_model_states.pt) beside its optimizer "
            "states, to cut them by parameter. Copy it from the host that saved it, or let DeepSpeed write it "
            'on every node ("checkpoint": {"use_node_local_storage": true}).'
        )
    if part and model:
        return [f"{prefix}{n}" for n in model + [n for n in names if n not in model]]
    if not model:
        raise BadCheckpointError(
            f"{tag_dir}: no *_model_states.pt file, so this is not a complete DeepSpeed checkpoint. "
            "Was the save interrupted? Commit a checkpoint whose save finished."
        )
    _check_rank_files(tag_dir, [n for n in names if is_optim_states(n)])
    # Model-states first: the optimizer files are cut with their param_shapes.
    ordered = model + [n for n in names if n not in model]
    return [f"{prefix}{n}" for n in ordered]


def _check_rank_files(tag_dir: Path, optim: list[str]) -> None:
    ranks = sorted(int(re.search(r"zero_pp_rank_(\d+)_", n).group(1)) for n in optim)  # type: ignore[union-attr]
    if ranks and ranks != list(range(len(ranks))):
        missing = sorted(set(range(max(ranks) + 1)) - set(ranks))
        raise BadCheckpointError(
            f"{tag_dir}: optimizer states of rank(s) {missing} are missing; every rank's "
            "*_optim_states.pt must be present. Commit a checkpoint whose save finished on all ranks."
        )


def _listed(path: Path) -> bool:
    """Whether ``path`` is an entry a commit lists as a file: anything but a folder (or a link to
    one, which the callers refuse or skip as folders). A named pipe, a socket, a device, a link to
    nothing or to a file outside the checkpoint is listed too, so that :func:`check_files` refuses
    it by name: each was once left out, without a word or with a warning, and a save that lacks a
    file is no save to record (a FIFO ``__1_0.distcp`` left a DCP step without a rank's items)."""
    try:
        mode = os.lstat(path).st_mode
    except OSError:
        return False
    return not stat.S_ISDIR(mode) and not (stat.S_ISLNK(mode) and path.is_dir())


def _top_files(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if _listed(p))


def _walk(root: Path, sub: Path) -> list[str]:
    """Every file below ``sub``, relative to ``root``; symlinked directories are refused, not followed."""
    found: list[str] = []
    for folder, dirs, names in os.walk(sub, followlinks=False):
        for d in dirs:
            if (Path(folder) / d).is_symlink():
                raise BadCheckpointError(
                    f"{Path(folder) / d}: a symbolic link to a directory; tailorstore does not follow links inside "
                    "a checkpoint. Replace it with the files themselves, or remove it."
                )
        found += [(Path(folder) / n).relative_to(root).as_posix() for n in names if _listed(Path(folder) / n)]
    return sorted(found)


def check_files(root: Path, files: list[str], place: Callable[[str], Where] | None = None) -> None:
    """Commit stores only what checkout can write back: the path rules of checkout, UTF-8 names,
    and regular files of the checkpoint only. Each is opened as the commit will open it
    (``place``, by default beneath ``root``): a link that leads outside the folder the commit
    was given, a FIFO, a device or a link to nothing is refused here, naming it, before anything
    is read. The reads open each file again by the same rules, so a link swapped in since is
    refused there too (``formats/source``)."""
    place = place or (lambda rel: Beneath(root, rel))
    for rel in files:
        try:
            rel.encode("utf-8")
            check_relative(rel)
        except (UnicodeEncodeError, UnsafePathError):
            raise BadCheckpointError(
                f"{root}: the file name {rel!r} cannot be stored (not UTF-8, or with a backslash or another "
                "character that checkout refuses). Rename or remove the file and commit again."
            ) from None
        where = place(rel)
        try:
            stat_input(where)
        except FileNotFoundError as exc:  # listed a moment ago: a link to nothing, or gone since
            if not os.path.lexists(root / rel):
                raise changed(root / rel, "it was removed or renamed") from None
            raise refused(exc, root / rel) from None
        except OSError as exc:
            raise refused(exc, root / rel) from None


def detect(path: Path, *, part: bool = False) -> CheckpointLayout:
    """The layout of ``path``, with every file name checked against the rules checkout applies."""
    layout = _detect(Path(path), part)
    check_files(layout.root, layout.files, layout.place)
    return layout


def _is_checkpoint(folder: Path) -> bool:
    """Whether a folder is a checkpoint of its own (an HF checkpoint-N, a DeepSpeed save or tag folder,
    a DCP step): what a plain folder of weights never holds."""
    if folder.is_symlink() or not folder.is_dir():
        return False
    if (folder / "trainer_state.json").is_file() or (folder / "latest").is_file() or is_dcp_folder(folder):
        return True
    return any(is_model_states(p.name) for p in folder.iterdir() if p.is_file())


def _refuse_checkpoints_inside(path: Path) -> None:
    """A training's working folder (its final weights beside checkpoint-1, checkpoint-2...) is no
    plain checkpoint: committed as one, its checkpoints' files would become one step
    (tests/system/test_cleanup_failures.py, ``test_a_working_folder_of_several_checkpoints_is_not_one_step``)."""
    inside = sorted(p.name for p in path.iterdir() if _is_checkpoint(p))
    if inside:
        shown = ", ".join(inside[:4]) + (f" and {len(inside) - 4} more" if len(inside) > 4 else "")
        raise BadCheckpointError(
            f"{path}: holds {len(inside)} checkpoint folder(s) of its own ({shown}); commit each of them (",
            Call("commit", str(path / inside[-1])),
            "), not the folder that holds them.",
        )


def is_dcp_folder(path: Path) -> bool:
    """``dcp.save``'s output: a ``.metadata`` file and ``.distcp`` files beside it."""
    return (path / DCP_METADATA).is_file() and any(p.suffix == ".distcp" and p.is_file() for p in path.iterdir())


def _megatron_step(tag: str) -> int | None:
    return mg.step_of(tag) if mg.step_of(tag) is not None else step_from_name(tag)


def _megatron_files(folder: Path, prefix: str) -> list[str]:
    """A Megatron save folder's files, in commit order. Megatron writes no folders into one: a
    folder there is left out with a warning that names it, as in a DCP folder."""
    for p in folder.iterdir():
        if p.is_dir():
            log.warning("tailorstore: %s is a folder inside a Megatron checkpoint; it is not committed", p)
    return [f"{prefix}{n}" for n in _top_files(folder)]


def _megatron_run(run: Path) -> CheckpointLayout:
    """A Megatron-LM run folder: the iteration its ``latest_checkpointed_iteration.txt`` names, with
    that file (a checkout is then a folder ``--load`` resumes from); other iterations are not this step."""
    tag, step = mg.read_tracker(run)
    folder = run / tag
    if folder.is_symlink() or not folder.is_dir() or not is_dcp_folder(folder):
        raise BadCheckpointError(
            f"{run / mg.TRACKER}: names {tag}, but there is no Megatron torch_dist save {folder} beside it. "
            "Point at the iter_NNNNNNN folder itself, or fix the file."
        )
    mg.check_complete(folder)
    return CheckpointLayout(run, MEGATRON, step, tag, [mg.TRACKER, *_megatron_files(folder, f"{tag}/")])


def _detect(path: Path, part: bool = False) -> CheckpointLayout:
    if path.is_file() and not path.is_symlink() and path.suffix in PLAIN_SUFFIXES:
        # one torch.save or safetensors file; named "{tag}" in the index, so every step's file matches
        return CheckpointLayout(path.parent, PLAIN_FILE, step_from_name(path.stem), path.name, [path.name])
    if not path.is_dir():
        raise BadCheckpointError(
            f"{path}: not a directory, nor a .pt, .pth, .bin, .ckpt or .safetensors file. Pass the folder "
            "DeepSpeed, the HF Trainer or dcp.save saved."
        )
    if (path / "trainer_state.json").is_file():
        return _hf_layout(path, part)
    if has_latest(path):
        tag = read_latest(path)
        tag_dir = path / tag
        if not tag or "/" in tag or tag in (".", "..") or not tag_dir.is_dir():
            raise BadCheckpointError(
                f"{path / 'latest'}: names tag {tag!r}, but there is no such folder beside it. "
                "Point at the tag folder itself, or fix 'latest'."
            )
        files = _top_files(path) + _tag_files(tag_dir, f"{tag}/", part)
        return CheckpointLayout(path, DEEPSPEED, step_from_name(tag), tag, files)
    if _is_accelerate_state(path):
        return _hf_layout(path, part, ACCELERATE)
    if (path / mg.TRACKER).is_file():
        return _megatron_run(path)
    names = [p.name for p in path.iterdir() if _listed(p)]
    if is_dcp_folder(path) and mg.is_megatron_folder(path):
        mg.check_complete(path)
        tag = path.name
        return CheckpointLayout(path.parent, MEGATRON, _megatron_step(tag), tag, _megatron_files(path, f"{tag}/"))
    if is_dcp_folder(path):
        tag = path.name
        for p in path.iterdir():
            if p.is_dir():
                log.warning("tailorstore: %s is a folder inside a DCP checkpoint; it is not committed", p)
        return CheckpointLayout(
            path.parent, DCP_FOLDER, step_from_name(tag), tag, [f"{tag}/{n}" for n in sorted(names)]
        )
    if any(is_model_states(n) for n in names) or (part and any(is_optim_states(n) for n in names)):
        tag = path.name
        return CheckpointLayout(path.parent, DEEPSPEED_TAG, step_from_name(tag), tag, _tag_files(path, f"{tag}/", part))
    if any(Path(n).suffix in PLAIN_SUFFIXES for n in names):
        _refuse_checkpoints_inside(path)
        tag = path.name
        return CheckpointLayout(path.parent, PLAIN_FOLDER, step_from_name(tag), tag, _walk(path.parent, path))
    _refuse_checkpoints_inside(path)  # a folder of checkpoints is told so, not "not a checkpoint"
    raise BadCheckpointError(
        f"{path}: not a checkpoint. Expected a DeepSpeed save directory (with 'latest'), a DeepSpeed tag "
        "folder (with *_model_states.pt), an HF Trainer checkpoint-N folder (with trainer_state.json), an "
        "Accelerate save_state folder (with pytorch_model_fsdp_0/), or a DCP folder (with .metadata and *.distcp "
        "files)."
    )


ACCELERATE_FOLDERS = re.compile(r"(pytorch_model_fsdp|optimizer)_\d+")
"""The DCP folders Accelerate's FSDP saves are named so (``save_fsdp_model``, ``save_fsdp_optimizer``)."""


def _is_accelerate_state(path: Path) -> bool:
    """A folder that holds Accelerate's FSDP DCP folders and no other checkpoint of its own."""
    subs = [p for p in path.iterdir() if p.is_dir() and not p.is_symlink()]
    ours = [p for p in subs if ACCELERATE_FOLDERS.fullmatch(p.name) and is_dcp_folder(p)]
    return bool(ours) and not any(_is_checkpoint(p) for p in subs if p not in ours)


def _hf_layout(path: Path, part: bool = False, kind: str = HF_TRAINER) -> CheckpointLayout:
    step = step_from_name(path.name)
    if step is None and kind == HF_TRAINER:  # Accelerate's folder says no step but in its name
        try:
            state = read_small_text(Beneath(path, "trainer_state.json"), "an HF Trainer's trainer_state.json")
            step = json.loads(state)["global_step"]
            if not isinstance(step, int) or isinstance(step, bool):  # 1e400 is a float (inf), "7" a string
                raise ValueError(f"global_step is {step!r:.40}, not a whole number")
        except (ValueError, KeyError, TypeError) as exc:
            raise BadCheckpointError(
                f"{path / 'trainer_state.json'}: unreadable ({exc}); pass ", Call(step="N"), "."
            ) from None
    ds_tag = None
    if has_latest(path):
        ds_tag = read_latest(path)
    files = _top_files(path)
    for sub in sorted(p for p in path.iterdir() if p.is_dir()):
        if sub.is_symlink():
            raise BadCheckpointError(
                f"{sub}: a symbolic link to a directory; tailorstore does not follow links inside a checkpoint. "
                "Replace it with the files themselves, or remove it."
            )
        inside = [p.name for p in sub.iterdir() if p.is_file()]  # _walk or _tag_files says what it leaves out
        if any(is_model_states(n) for n in inside) or (part and any(is_optim_states(n) for n in inside)):
            ds_tag = ds_tag or sub.name
            files += _tag_files(sub, f"{sub.name}/", part)
        else:
            files += _walk(path, sub)
    return CheckpointLayout(path, kind, step, ds_tag, files)
