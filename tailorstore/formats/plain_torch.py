"""Plain ``torch.save`` files: a training state or a weights file, cut into atoms by parameter.

The checkpoint guides' everyday save is ``torch.save({"model": model.state_dict(),
"optimizer": optimizer.state_dict(), "step": step}, "ckpt.pt")``; HF's ``pytorch_model.bin``
is a bare state dict. Each tensor becomes one atom, named so that layer-wise tailoring and
diff work as they do for DeepSpeed:

- a tensor of the model state dict (the file's root, or its ``model`` / ``state_dict`` /
  ``model_state_dict`` / ``module`` entry) is its parameter: a master when FP32, else a weight;
- optimizer state (``optimizer`` / ``optimizer_state_dict`` / ``optim``) is keyed by parameter
  *index* in torch. The index is named after the model's parameter when the file says which
  (one param group listing as many parameters as the model has floating tensors, in order);
  otherwise it stays ``optimizer.state.<index>``, labelled ``state`` and never inherited;
- anything else keeps its path in the file as its name, labelled ``state``.
"""

from __future__ import annotations

from typing import Any

from tailorstore.core import atom_types as A
from tailorstore.core.layers import STATE, layer_of
from tailorstore.formats.deepspeed import generic, whole

MODEL_KEYS = ("model", "state_dict", "model_state_dict", "module")
OPTIMIZER_KEYS = ("optimizer", "optimizer_state_dict", "optim")
_STATE_KINDS = {A.EXP_AVG, A.EXP_AVG_SQ, A.STEP, "momentum_buffer", "max_exp_avg_sq", "sum", "square_avg"}


def _model_prefix(obj: Any, entries: list[A.TensorEntry]) -> str | None:
    """The path under which the model's tensors sit: "" for a bare state dict, else its key."""
    if not isinstance(obj, dict):
        return None
    for key in MODEL_KEYS:
        if isinstance(obj.get(key), dict):
            return f"{key}/"
    if entries and all("/" not in e.path for e in entries):
        return ""  # a bare state dict: pytorch_model.bin
    return None


def _index_names(obj: Any, optimizer_key: str | None, model_names: list[str]) -> dict[str, str]:
    """Optimizer index -> parameter name, where the file makes it certain."""
    if optimizer_key is None:
        return {}
    groups = obj[optimizer_key].get("param_groups") if isinstance(obj[optimizer_key], dict) else None
    if not isinstance(groups, list) or len(groups) != 1 or not isinstance(groups[0], dict):
        return {}
    params = groups[0].get("params")
    if not isinstance(params, list) or len(params) != len(model_names):
        return {}
    return {str(index): name for index, name in zip(params, model_names, strict=True)}


def segment_plain(obj: Any, entries: list[A.TensorEntry]) -> bool:
    """Name every entry's one atom (see the module's docstring); False, leaving the entries alone,
    when the file is not a model state dict or a training state that holds one."""
    prefix = _model_prefix(obj, entries)
    if prefix is None:
        return False

    def in_model(entry: A.TensorEntry) -> bool:
        return entry.path.startswith(prefix) and (bool(prefix) or "/" not in entry.path)

    model_names = [e.path[len(prefix) :] for e in entries if in_model(e) and e.tensor.is_floating_point()]
    optimizer_key = next((k for k in OPTIMIZER_KEYS if isinstance(obj.get(k), dict)), None)
    names = _index_names(obj, optimizer_key, model_names)
    for entry in entries:
        if in_model(entry):
            name = entry.path[len(prefix) :]
            kind = A.MASTER if A.dtype_name(entry.tensor.dtype) == "float32" else A.WEIGHT
            whole(entry, name, kind if entry.tensor.is_floating_point() else A.BUFFER, 0)
            continue
        parts = entry.path.split("/")
        if optimizer_key and len(parts) == 4 and parts[0] == optimizer_key and parts[1] == "state":
            index, kind = parts[2], parts[3]
            if index in names and kind in _STATE_KINDS:
                whole(entry, names[index], kind, 0, layer_of(names[index]))
            else:
                whole(entry, f"optimizer.state.{index}", kind, 0, STATE)
            continue
        generic(entry, 0)
    return True
