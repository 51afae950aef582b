"""A job killed between its last part and the finalize leaves a whole save in parts: the next
engine's rank 0 finalizes it (``nodes.finish_pending``), and leaves alone a save with a part
missing, and parts it did not label."""

from __future__ import annotations

import shutil
from pathlib import Path

from tailorstore import Store
from tailorstore.integrations.common import StoreSession
from tailorstore.integrations.deepspeed.nodes import finish_pending, save_label
from testbed.compare import same_tree
from tests.conftest import TEST_DATA

SAVE = TEST_DATA / "format1" / "checkpoint" / "global_step3"


def node_share(root: Path, rank: int) -> Path:
    """What node ``rank`` of a two-node job staged: the model states and its own optimizer file."""
    folder = root / f"node{rank}" / "global_step3"
    folder.mkdir(parents=True)
    for name in ("mp_rank_00_model_states.pt", f"bf16_zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"):
        shutil.copy(SAVE / name, folder / name)
    return folder


def test_a_whole_save_left_in_parts_is_finalized_and_a_partial_one_is_not(tmp_path: Path) -> None:
    label = save_label("tailor-staging-1-abcd", 1, 2)
    with Store.init(tmp_path / "store") as store:
        store.commit(node_share(tmp_path, 0), part=True, part_label=f"{label}-n0")
        store.commit(node_share(tmp_path / "other", 1), part=True)  # a host's part, no save label
        assert finish_pending(store) == [] and store.log() == [], "one of two parts: left for gc"
        assert len(StoreSession(store).parts(3)) == 2
        store.commit(node_share(tmp_path, 1), part=True, part_label=f"{label}-n1")
        assert finish_pending(store) == [3]
        assert [s.step for s in store.log()] == [3]
        assert len(StoreSession(store).parts(3)) == 1, "the unlabelled part is not the save's: it stays for gc"
        assert finish_pending(store) == [], "nothing twice"
        store.checkout(3, tmp_path / "out")
        assert store.verify(deep=True).ok
    assert same_tree(tmp_path / "out" / "global_step3", SAVE)
