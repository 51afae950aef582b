"""Atoms: the unit that flows between reading a checkpoint and writing one.

An atom is a contiguous run of elements of one tensor in one file, keyed by the parameter
it belongs to, its kind (weight, master, exp_avg, ...), the data-parallel rank that owns
it and the first element it covers within the parameter. Everything that is not a tensor
stays in a small *skeleton*: the file's object tree with every tensor replaced by a
:class:`TensorSlot`. Readers in ``formats/`` produce skeleton plus atoms; writers consume
them; the store only ever sees these two things.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from tailorstore.core.tensor_ref import TensorRef

# Kinds of tensor state. Anything else keeps the key it had in the optimizer state.
WEIGHT = "weight"
MASTER = "master"
EXP_AVG = "exp_avg"
EXP_AVG_SQ = "exp_avg_sq"
STEP = "step"
PADDING = "padding"
BUFFER = "buffer"
TENSOR = "tensor"


@dataclass(frozen=True)
class TensorSlot:
    """Stands in the skeleton where a tensor was; ``slot`` indexes the file's tensor table."""

    slot: int
    dtype: str
    shape: tuple[int, ...]


# Stored skeletons (pickles, FORMAT.md 3.2) name this class by the module it was first defined in.
# That name is part of the format, so it stays when the module moves; tailorstore/atoms.py keeps it
# importable for the pickler, which looks the class up by that name.
TensorSlot.__module__ = "tailorstore.atoms"


@dataclass(frozen=True)
class Segment:
    """A contiguous run of a tensor's elements that becomes one atom."""

    offset: int  # first element within the containing tensor
    numel: int
    param: str  # parameter name, or a synthetic name for what is not a parameter
    kind: str
    rank: int
    start: int  # first element within the parameter's flattened tensor
    layer: str


@dataclass
class TensorEntry:
    """One tensor of a file, with the segments it is cut into."""

    slot: int
    path: str  # where it sits in the file's object tree, keys joined by '/'
    tensor: TensorRef | torch.Tensor  # described (torch-free readers) or loaded (the torch fallback)
    segments: list[Segment] = field(default_factory=list)
    file_offset: int | None = None  # where the tensor's bytes start in its file, when known

    @property
    def dtype_name(self) -> str:
        return dtype_name(self.tensor.dtype)


def dtype_name(dtype: torch.dtype | Any) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``: the name the index records (no torch import needed)."""
    return str(dtype).removeprefix("torch.")
