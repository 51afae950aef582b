"""A model's structure: which parameters it has and how many elements each holds.

Layer inheritance, merges and ``diff`` compare pieces of the same parameter across steps, so
they only make sense between steps of one model. A commit reads the structure off the
pieces it cuts (weights and FP32 masters, whatever the ZeRO stage), and the store's earlier
steps give theirs from their atom rows; a commit of another model is refused unless forced.
"""

from __future__ import annotations

from typing import Protocol

from tailorstore.core import atom_types as A
from tailorstore.core.errors import Call, StoreError
from tailorstore.core.records import AtomRecord, ManifestRecord
from tailorstore.formats.layout import (
    ACCELERATE,
    DCP_FOLDER,
    DEEPSPEED,
    DEEPSPEED_TAG,
    HF_TRAINER,
    MEGATRON,
    PLAIN_FILE,
    PLAIN_FOLDER,
)


class ModelShape(Protocol):
    """The index as the model-shape check sees it: the run's newest commit, and a manifest's parameter sizes."""

    def last_recorded_commit(self, run: str) -> ManifestRecord | None: ...

    def param_sizes(self, manifest: int, kinds: tuple[str, str]) -> dict[str, int]: ...


Structure = dict[str, int]  # parameter -> elements


def from_segments(segments: list[A.Segment]) -> Structure:
    """Pure: each parameter's element count, as the end of its furthest weight or master piece."""
    out: Structure = {}
    for seg in segments:
        if seg.kind in (A.WEIGHT, A.MASTER) and seg.numel:
            out[seg.param] = max(out.get(seg.param, 0), seg.start + seg.numel)
    return out


def from_atoms(atoms: list[AtomRecord]) -> Structure:
    """Pure: the same, from atom records (a step assembled from parts)."""
    out: Structure = {}
    for a in atoms:
        if a.kind in (A.WEIGHT, A.MASTER) and a.numel:
            out[a.param] = max(out.get(a.param, 0), a.start + a.numel)
    return out


def of_manifest(index: ModelShape, manifest: int) -> Structure:
    return index.param_sizes(manifest, (A.WEIGHT, A.MASTER))


def differences(old: Structure, new: Structure, limit: int = 3) -> list[str]:
    """Pure: what differs, in words, at most ``limit`` items (empty when the structures agree)."""
    out = [f"{p} is new" for p in sorted(set(new) - set(old))]
    out += [f"{p} is gone" for p in sorted(set(old) - set(new))]
    out += [f"{p} has {new[p]} elements, not {old[p]}" for p in sorted(set(old) & set(new)) if old[p] != new[p]]
    return out[:limit] + ([f"and {len(out) - limit} more"] if len(out) > limit else [])


# Layouts by the framework that resumes from them: a run's steps are one framework's saves.
FRAMEWORKS = {
    DEEPSPEED: "a DeepSpeed save",
    DEEPSPEED_TAG: "a DeepSpeed save",
    HF_TRAINER: "an HF Trainer checkpoint",
    ACCELERATE: "an Accelerate save_state folder",
    DCP_FOLDER: "a DCP (torch.distributed.checkpoint) folder",
    MEGATRON: "a Megatron-Core torch_dist save",
    PLAIN_FOLDER: "a folder of plain weight files",
    PLAIN_FILE: "a plain weight file",
}


def refuse_other_model(
    index: ModelShape, new: Structure, run: str, base: ManifestRecord | None = None, layout: str | None = None
) -> None:
    """Refuse a commit whose model differs from the run's newest committed step (or, for a run
    with no commits yet, from the step it branched from): another model belongs in a run of its own.
    So does another framework's save of the same model (``layout``): a DCP step that became a
    DeepSpeed run's newest step was what that run's next resume read, and failed on."""
    newest = index.last_recorded_commit(run) or base
    if newest is None:
        return
    before = FRAMEWORKS.get(newest.layout, newest.layout)
    now = FRAMEWORKS.get(layout, layout) if layout is not None else before
    if now != before:
        raise StoreError(
            f"this checkpoint is {now}, and step {newest.step} of run {newest.run!r} is {before}: a run's steps "
            "are what its training resumes from. Commit it to a run of its own with ",
            Call(run="NAME"),
            ", or pass ",
            Call(force=True),
            " to commit it here anyway.",
        )
    if not new:
        return
    old = of_manifest(index, newest.id)
    diff = differences(old, new)
    if old and diff:
        where = f"step {newest.step} of run {newest.run!r}"
        raise StoreError(
            f"this checkpoint holds a different model from {where} ({'; '.join(diff)}). "
            "Commit it to a run of its own with ",
            Call(run="NAME"),
            " (steps are numbered per run, blobs are shared), or pass ",
            Call(force=True),
            " to commit it here anyway.",
        )
