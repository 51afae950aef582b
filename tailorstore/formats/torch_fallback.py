"""The torch fallback of the checkpoint reader: files the torch-free reader does not take.

A file goes through torch only when it needs it: a pickle with globals outside the allowlist
that the user trusts (``trust_pickles=True``), or a file that is not a plain ``torch.save``
zip (compressed records, the legacy format, a non-contiguous tensor or a dtype tailorstore
does not cut). Importing this module imports torch (about two seconds), so the reader
imports it only for such a file.
"""

from __future__ import annotations

import io
from typing import Any

import torch

from tailorstore.core.atom_types import TensorEntry
from tailorstore.formats.safe_load import load_torch_file
from tailorstore.formats.skeleton import split_tensors
from tailorstore.formats.source import InputFile
from tailorstore.formats.tensors import byte_view
from tailorstore.formats.torch_zip import locate_tensors


def load_with_torch(
    src: InputFile, where: str, size: int, trust_pickles: bool
) -> tuple[Any, Any, list[TensorEntry], bool, bool]:
    """(object tree, skeleton, entries, located, trusted) of a file loaded by torch.

    Unpickled mapped, so no tensor byte is read; every tensor is located, then replaced by a
    meta tensor, so nothing can read the input's mapping later (a truncated file would turn
    that read into SIGBUS). A file whose tensors cannot be located is loaded again into
    private memory, the one case where a file's tensors are held whole.
    """
    obj, trusted = load_torch_file(src.by_descriptor, trust_pickles=trust_pickles, where=where)
    skeleton, entries = split_tensors(obj, where=where, file_size=size)
    located = locate_tensors(src.by_descriptor, entries)
    if located:
        for entry in entries:
            entry.tensor = torch.empty_like(entry.tensor, device="meta")
    else:
        obj, trusted = load_torch_file(src.by_descriptor, trust_pickles=trust_pickles, where=where, mmap=False)
        skeleton, entries = split_tensors(obj, where=where, file_size=size)
    return obj, skeleton, entries, located, trusted


def skeleton_bytes(skeleton: object) -> bytes:
    """The skeleton of a file torch loaded, saved with torch.save (re-pickling checkout loads it)."""
    buf = io.BytesIO()
    torch.save(skeleton, buf)
    return buf.getvalue()


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    return byte_view(tensor)
