"""Export (restore/export.py): what it refuses to write as weights."""

from __future__ import annotations

import pytest

from tailorstore.core.errors import BadCheckpointError


@pytest.mark.parametrize(
    ("names", "refused"),
    [
        (["layers.0.weight", "model.embed_tokens.weight", "lm_head.weight"], False),
        (["layers.0.weight", "optim.state.layers.0.weight.exp_avg"], True),
        (["app.optim.state.0.exp_avg_sq"], True),
        (["layers.0.weight.exp_avg"], True),
        (["optimizer.param_groups.0.lr"], True),
        (["model.optimal.weight", "state_proj.weight"], False),
    ],
)
def test_an_export_refuses_names_of_optimizer_state(names: list[str], refused: bool) -> None:
    """An export that would write Adam's moments as weights stops, naming one."""
    from tailorstore.restore.export import refuse_optimizer_names

    if refused:
        with pytest.raises(BadCheckpointError, match="named as optimizer state"):
            refuse_optimizer_names(6, names)
    else:
        refuse_optimizer_names(6, names)
