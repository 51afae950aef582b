"""One node's share of a step (``checkout(..., ranks=)``, what a node writes when training resumes
at the world size it saved at): its ranks' optimizer files and the shared files, byte for byte
the whole checkout's, and nothing of the other ranks."""

from __future__ import annotations

from pathlib import Path

from tailorstore import Store
from tests.conftest import TEST_DATA

SAVE = TEST_DATA / "format1" / "checkpoint"


def files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def test_a_node_checks_out_only_what_its_ranks_load(tmp_path: Path) -> None:
    with Store.init(tmp_path / "store") as store:
        store.commit(SAVE)
        store.checkout("latest", tmp_path / "whole")
        store.checkout("latest", tmp_path / "node", ranks=[1])
    whole, node = files(tmp_path / "whole"), files(tmp_path / "node")
    assert "global_step3/bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt" in node
    assert "global_step3/mp_rank_00_model_states.pt" in node, "every rank loads the model states"
    assert not any("rank_0_mp_rank_00_optim" in name for name in node), "rank 0's optimizer file is another node's"
    assert set(whole) - set(node) == {"global_step3/bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"}
    assert all(whole[name] == data for name, data in node.items())
