"""A tensor described, not loaded: what a commit needs to know about a tensor in a file.

A commit never needs a tensor's values in memory as a tensor: it needs the dtype, the shape
and where the bytes sit in the file, and it reads the bytes piece by piece. :class:`TensorRef`
carries exactly that, with the few methods of ``torch.Tensor`` the layout code calls
(``numel``, ``dim``, ``element_size``, ``is_floating_point``), so the torch-free readers
(torch.save zips, safetensors) and the torch fallback feed the same code.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DType:
    name: str  # torch's name without "torch.": what the index records
    itemsize: int
    is_float: bool


# Every dtype a DeepSpeed, torch or safetensors checkpoint can hold that tailorstore cuts
# into atoms; a tensor of any other dtype sends its file to the torch fallback.
DTYPES = {
    d.name: d
    for d in (
        DType("float64", 8, True),
        DType("float32", 4, True),
        DType("float16", 2, True),
        DType("bfloat16", 2, True),
        DType("int64", 8, False),
        DType("int32", 4, False),
        DType("int16", 2, False),
        DType("int8", 1, False),
        DType("uint8", 1, False),
        DType("bool", 1, False),
    )
}


def numel_of(shape: tuple[int, ...]) -> int:
    """Elements of a tensor of ``shape`` (1 for a scalar)."""
    n = 1
    for d in shape:
        n *= d
    return n


def nbytes_of(dtype: str, shape: tuple[int, ...]) -> int:
    return DTYPES[dtype].itemsize * numel_of(shape)


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The strides of a contiguous (row-major) tensor of ``shape``, in elements."""
    strides, step = [], 1
    for d in reversed(shape):
        strides.append(step)
        step *= d
    return tuple(reversed(strides))


@dataclass
class TensorRef:
    """dtype, shape and the offset of the bytes in their file (None until known)."""

    dtype: str
    shape: tuple[int, ...]
    file_offset: int | None = None

    def numel(self) -> int:
        return numel_of(self.shape)

    def dim(self) -> int:
        return len(self.shape)

    def element_size(self) -> int:
        return DTYPES[self.dtype].itemsize

    def is_floating_point(self) -> bool:
        return DTYPES[self.dtype].is_float

    def nbytes(self) -> int:
        return self.numel() * self.element_size()
