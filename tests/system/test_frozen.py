"""Frozen layers cost nothing after the first save: a real DeepSpeed run (ZeRO-2, bf16, 2 ranks)
with the embedding and the lower half of the blocks frozen (``requires_grad=False``), saved
every 3 steps. Content addressing must store the frozen layers' bytes once for the whole run."""

from __future__ import annotations

from pathlib import Path

import pytest

from tailorstore import Store
from tailorstore.store.index.catalogue import Catalogue
from testbed.runs import train_tiny

pytestmark = pytest.mark.slow

FROZEN = {"embedding", "block.0", "block.1"}


def test_frozen_layers_are_written_once(tmp_path: Path) -> None:
    save = tmp_path / "save"
    train_tiny(save, losses_out=tmp_path / "losses.json", steps=9, save_every=3, freeze_bottom=True, layers=4)
    with Store.init(tmp_path / "store") as store:
        results = [store.commit(save / f"global_step{step}") for step in (3, 6, 9)]
        blobs: dict[int, dict[str, set[str]]] = {}
        for result in results:
            by_layer: dict[str, set[str]] = {}
            for atom in store.repo.view(Catalogue).atoms(result.manifest):
                by_layer.setdefault(atom.layer, set()).add(atom.blob)
            blobs[result.step] = by_layer
        raw = sum(r.raw_bytes for r in results)
        stored = store.usage().stored_bytes
    # the same bytes at every step: the same blobs, written once, by step 3's commit (a blob's name is its hash)
    for layer in FROZEN:
        assert blobs[3][layer] == blobs[6][layer] == blobs[9][layer], layer
    for layer in ("block.2", "block.3", "lm_head"):  # the trained layers did change
        assert blobs[3][layer] != blobs[6][layer] != blobs[9][layer], layer
    print(f"frozen bottom half: raw series {raw} bytes, store {stored} bytes ({raw / stored:.2f}x)")
