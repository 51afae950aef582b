"""Change between steps, as numbers and as a picture: how much each layer moved between steps.

The measure is the relative change ||w_B - w_A|| / ||w_A||, per layer, of the FP32 master
and of the model weight, computed from the stored atoms (derived weights are rebuilt).
"""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path
from types import ModuleType
from typing import NamedTuple, Protocol

import numpy as np

from tailorstore.access import structure
from tailorstore.access.changes import PieceKey, relative_change, stored_pieces
from tailorstore.access.output_dir import partial_prefix, refuse_inside_store
from tailorstore.core import atom_types as A
from tailorstore.core.errors import MissingDependencyError, StoreError
from tailorstore.core.layers import STATE, sort_key
from tailorstore.core.records import COMMIT, MAIN_RUN, LayerRecord, ManifestRecord
from tailorstore.store.repo import Repository, StepReader


class DiffView(Protocol):
    """The index as diff compares steps: their layers, and the run's commits."""

    def manifests(self, run: str | None = None) -> list[ManifestRecord]: ...

    def layers(self, manifest: int) -> list[LayerRecord]: ...

    def layer_names(self) -> set[str]: ...


@dataclass(frozen=True)
class LayerDiff:
    layer: str
    master: float | None
    weight: float | None


class DiffResult(NamedTuple):
    """Per layer, the change from step ``step_a`` to ``step_b`` (a merge carries its base's step)."""

    step_a: int
    step_b: int
    layers: list[LayerDiff]


def diff(repo: Repository, selector_a: str, selector_b: str) -> DiffResult:
    """Per layer, the change from A to B; refused, with the reason, where the two cannot be compared."""
    a, b = repo.resolve(selector_a), repo.resolve(selector_b)
    ma, mb = repo.manifest(a), repo.manifest(b)
    step_a, step_b = ma.step, mb.step
    other = structure.differences(
        structure.of_manifest(repo.view(structure.ModelShape), a),
        structure.of_manifest(repo.view(structure.ModelShape), b),
    )
    if other:
        raise StoreError(
            f"cannot compare {_named(ma, mb)} with {_named(mb, ma)}: they hold different models ({'; '.join(other)})"
        )
    by_name = (ma.world_size, ma.zero_stage) != (mb.world_size, mb.zero_stage)
    layers_a = {x.layer for x in repo.view(DiffView).layers(a)}
    layers_b = {x.layer for x in repo.view(DiffView).layers(b)}
    out = []
    for layer in sorted((layers_a & layers_b) - {STATE}, key=sort_key):
        values = [_change(repo, a, b, layer, kind, by_name) for kind in (A.MASTER, A.WEIGHT)]
        out.append(LayerDiff(layer, values[0], values[1]))
    return DiffResult(step_a, step_b, out)


def _named(m: ManifestRecord, other: ManifestRecord) -> str:
    """A step as a message names it beside another: with its run unless both are main's."""
    return f"step {m.step}" if m.run == other.run == MAIN_RUN else f"run {m.run} step {m.step}"


def _change(repo: StepReader, a: int, b: int, layer: str, kind: str, by_name: bool) -> float | None:
    """A layer's relative change of one kind from manifest ``a`` to ``b``: piece by piece where both
    were saved in one partitioning, else parameter by parameter (each parameter's pieces joined by
    their first element, whatever rank held them), which any two partitionings of one model allow."""
    return _between((kind, stored_pieces(repo, a, layer, kind)), (kind, stored_pieces(repo, b, layer, kind)), by_name)


def by_parameter(pieces: dict[PieceKey, np.ndarray]) -> dict[PieceKey, np.ndarray] | None:
    """Pure: pieces keyed (parameter, rank, start) joined into one flat array per parameter, keyed
    (parameter, 0, 0); None where a parameter's pieces do not lie end to end (a range held twice,
    as two ranks' copies, is taken once)."""
    ranges: dict[str, dict[int, np.ndarray]] = {}
    for (param, _rank, start), values in pieces.items():
        ranges.setdefault(param, {}).setdefault(start, values)
    out: dict[PieceKey, np.ndarray] = {}
    for param, by_start in ranges.items():
        cursor, parts = 0, []
        for start in sorted(by_start):
            if start != cursor:
                return None
            parts.append(by_start[start])
            cursor += len(by_start[start])
        out[(param, 0, 0)] = np.concatenate(parts) if len(parts) > 1 else parts[0]
    return out


@dataclass
class ChangeMatrix:
    columns: list[str]  # one per manifest after the first, in step order: "step N" or "step N (tag T)"
    layers: list[str]  # every layer but state, in model order
    values: list[list[float | None]]  # [layer][column]: change since the previous column; None: not comparable
    inherited: list[list[bool]]  # [layer][column]: the layer was not stored at that manifest
    steps: list[int] = field(default_factory=list)  # each column's step (the report page's x axis)
    ids: list[str] = field(default_factory=list)  # each column's manifest id


def change_matrix(repo: StepReader, run: str = MAIN_RUN) -> ChangeMatrix:
    """Per committed step and layer: change since the previous committed step. Merges and averages are
    no steps of training (one carries its base's step, and would read as a change in time), so they
    are left out.

    An inherited layer is flagged rather than shown as 0 change, which would read as a frozen layer.
    """
    rows = [r for r in repo.view(DiffView).manifests(run) if r.origin == COMMIT]
    if len(rows) < 2:
        raise StoreError("plotting change needs at least two committed steps")
    layers = sorted(repo.view(DiffView).layer_names() - {STATE}, key=sort_key)
    held = {(r.id, x.layer): x.source_step == r.step for r in rows for x in repo.view(DiffView).layers(r.id)}
    columns = [f"step {r.step}" + (f" ({', '.join(r.tags)})" if r.tags else "") for r in rows[1:]]
    values: list[list[float | None]] = []
    inherited: list[list[bool]] = []
    for layer in layers:
        line: list[float | None] = []
        flags: list[bool] = []
        previous = _measured(repo, rows[0].id, layer)
        for before, r in pairwise(rows):
            current = _measured(repo, r.id, layer)
            flags.append(not held.get((r.id, layer), True))
            by_name = (before.world_size, before.zero_stage) != (r.world_size, r.zero_stage)
            line.append(_between(previous, current, by_name))
            previous = current
        values.append(line)
        inherited.append(flags)
    return ChangeMatrix(columns, layers, values, inherited, [r.step for r in rows[1:]], [r.name for r in rows[1:]])


def _measured(repo: StepReader, manifest: int, layer: str) -> tuple[str, dict[PieceKey, np.ndarray]]:
    """What a layer's change is measured on at one step: its FP32 master, or its weights where the
    step holds no master (an HF Trainer or plain save, which keeps only the model's weights)."""
    for kind in (A.MASTER, A.WEIGHT):
        pieces = stored_pieces(repo, manifest, layer, kind)
        if pieces:
            return kind, pieces
    return A.MASTER, {}


def _between(
    old: tuple[str, dict[PieceKey, np.ndarray]], new: tuple[str, dict[PieceKey, np.ndarray]], by_name: bool
) -> float | None:
    """The change between two measurements of one kind (a master against a weight is no change)."""
    (old_kind, old_pieces), (new_kind, new_pieces) = old, new
    if old_kind != new_kind or not old_pieces or not new_pieces:
        return None
    if by_name:
        joined_old, joined_new = by_parameter(old_pieces), by_parameter(new_pieces)
        if joined_old is None or joined_new is None:
            return None
        if any(len(v) != len(joined_new.get(k, ())) for k, v in joined_old.items()):
            return None
        old_pieces, new_pieces = joined_old, joined_new
    return relative_change(new_pieces, old_pieces)


def plot(repo: Repository, out: Path, run: str = MAIN_RUN) -> Path:
    """A PNG heatmap of the change of each layer over the run's manifests, written whole at ``out``."""
    matplotlib = _matplotlib()
    _check_plot_out(repo, out)
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.patches import Patch, Rectangle

    m = change_matrix(repo, run)
    cells = zip(m.values, m.inherited, strict=True)
    data = np.array(
        [[np.nan if v is None or gone else v for v, gone in zip(line, flags, strict=True)] for line, flags in cells],
        dtype=float,
    )
    fig, ax = plt.subplots(figsize=(max(5.0, 0.6 * len(m.columns) + 3), max(3.0, 0.35 * len(m.layers) + 1.8)))
    cmap = matplotlib.colormaps["viridis"].with_extremes(bad="lightgrey")  # a copy: the registered map stays
    image = ax.imshow(data, aspect="auto", cmap=cmap, origin="lower")
    for y, flags in enumerate(m.inherited):
        for x, gone in enumerate(flags):
            if gone:
                ax.add_patch(Rectangle((x - 0.5, y - 0.5), 1, 1, fill=False, hatch="///", edgecolor="grey", lw=0))
    ax.set_xticks(range(len(m.columns)), m.columns, rotation=45, ha="right")
    ax.set_yticks(range(len(m.layers)), m.layers)
    ax.set_xlabel("manifest (change since the previous one)")
    ax.set_ylabel("layer")
    ax.set_title("change since the previous step (FP32 master, else weight)\n||w - w_prev|| / ||w_prev||", fontsize=10)
    fig.colorbar(image, ax=ax)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    inherited = Patch(facecolor="lightgrey", hatch="///", edgecolor="grey", label="inherited (not stored here)")
    fig.legend(handles=[inherited], loc="lower left", fontsize=8, frameon=False)
    tmp = out.parent / f"{partial_prefix(out)}{secrets.token_hex(4)}"
    try:
        fig.savefig(tmp, dpi=120, format="png")
        os.replace(tmp, out)  # a finished picture or none: never a cut one under the name
    finally:
        plt.close(fig)
        tmp.unlink(missing_ok=True)
    return out


def _matplotlib() -> ModuleType:
    """matplotlib, an optional dependency (the ``plot`` extra): its absence is the user's setup, said
    in one line with what to install, before the store or the output path is touched."""
    try:
        import matplotlib
    except ImportError:
        raise MissingDependencyError("plotting", "matplotlib", "plot") from None
    return matplotlib


def _check_plot_out(repo: StepReader, out: Path) -> None:
    """A new or existing .png file outside the store: matplotlib would otherwise pick the format
    from any suffix (a traceback for .sqlite), write ``DIR.png`` beside a directory named, and
    write into a device as if it were a file."""
    if out.suffix.lower() != ".png":
        raise StoreError(f"{out}: the plot is a PNG; give a path ending in .png.")
    if out.is_symlink() or (out.exists() and not out.is_file()):
        raise StoreError(f"{out}: exists and is not a regular file; give a new .png path or an old plot's.")
    refuse_inside_store(out, repo)
    out.parent.mkdir(parents=True, exist_ok=True)  # as checkout and export make their folder's parents
