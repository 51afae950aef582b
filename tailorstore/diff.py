"""``tailor diff`` and ``tailor plot``: how much each layer moved between steps.

The measure is the relative change ||w_B - w_A|| / ||w_A||, per layer, of the FP32 master
and of the model weight, computed from the stored atoms (derived weights are rebuilt).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from . import atoms as A
from .changes import relative_change, stored_pieces
from .errors import StoreError
from .layers import STATE, block_index, sort_key
from .store.repo import Store


@dataclass(frozen=True)
class LayerDiff:
    layer: str
    master: float | None
    weight: float | None


def diff(store: Store, selector_a: str, selector_b: str) -> tuple[int, int, list[LayerDiff]]:
    a, b = store.resolve(selector_a), store.resolve(selector_b)
    layers_a = {r["layer"] for r in store.conn.execute("SELECT layer FROM layers WHERE manifest=?", (a,))}
    layers_b = {r["layer"] for r in store.conn.execute("SELECT layer FROM layers WHERE manifest=?", (b,))}
    out = []
    for layer in sorted((layers_a & layers_b) - {STATE}, key=sort_key):
        values = []
        for kind in (A.MASTER, A.WEIGHT):
            old, new = stored_pieces(store, a, layer, kind), stored_pieces(store, b, layer, kind)
            values.append(relative_change(new, old) if old and new else None)
        out.append(LayerDiff(layer, values[0], values[1]))
    return store.manifest(a)["step"], store.manifest(b)["step"], out


def change_matrix(store: Store) -> tuple[list[int], list[str], list[list[float | None]]]:
    """Per committed step and block layer: change since the previous committed step."""
    rows = store.conn.execute("SELECT id, step FROM manifests WHERE origin='commit' ORDER BY step").fetchall()
    if len(rows) < 2:
        raise StoreError("plotting change needs at least two committed steps")
    layers = sorted(
        {
            r["layer"]
            for r in store.conn.execute("SELECT DISTINCT layer FROM layers")
            if block_index(r["layer"]) is not None
        },
        key=sort_key,
    )
    steps = [r["step"] for r in rows[1:]]
    matrix: list[list[float | None]] = []
    for layer in layers:
        line: list[float | None] = []
        previous = stored_pieces(store, rows[0]["id"], layer)
        for r in rows[1:]:
            current = stored_pieces(store, r["id"], layer)
            line.append(relative_change(current, previous))
            previous = current
        matrix.append(line)
    return steps, layers, matrix


def plot(store: Store, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    steps, layers, matrix = change_matrix(store)
    data = np.array([[np.nan if v is None else v for v in line] for line in matrix], dtype=float)
    fig, ax = plt.subplots(figsize=(max(4.0, 0.6 * len(steps) + 2), max(3.0, 0.35 * len(layers) + 1.5)))
    image = ax.imshow(data, aspect="auto", cmap="viridis", origin="lower")
    ax.set_xticks(range(len(steps)), [str(s) for s in steps], rotation=45)
    ax.set_yticks(range(len(layers)), layers)
    ax.set_xlabel("committed step (change since the previous commit)")
    ax.set_ylabel("layer")
    ax.set_title("FP32 master change since the previous commit\n||w - w_prev|| / ||w_prev||", fontsize=10)
    fig.colorbar(image, ax=ax)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
