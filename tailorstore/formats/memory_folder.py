"""Files held in memory that a commit reads as one checkpoint folder: what the DCP writer
(``integrations/dcp_writer.py``) serializes a rank's items into, so that no raw file is written.

Each file is an anonymous memory file (``memfd_create``): it has a descriptor and an identity
like any file, so the commit reads it through :class:`tailorstore.formats.source.InputFile`
exactly as it reads a folder on disk (one descriptor, private copies, the identity checked after
the last read), and the step it records is the one a commit of the same files on disk records.
No other process can reach the memory, and it is freed when the folder is closed. Where the
system has no ``memfd_create`` (not Linux), an unnamed temporary file stands in.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from tailorstore.formats.layout import DCP_FOLDER, CheckpointLayout

FILE_MODE = 0o644  # what a save's file gets under the usual umask, and what a checkout writes back
MEMORY_ROOT = Path("<memory>")  # the root a memory folder's paths are relative to; never opened


class MemoryFile:
    """One file in anonymous memory, written once through :meth:`writer`, then read by path."""

    def __init__(self, name: str) -> None:
        memfd = getattr(os, "memfd_create", None)
        if memfd is not None:
            self.fd = memfd(name, getattr(os, "MFD_CLOEXEC", 0))
            os.fchmod(self.fd, FILE_MODE)  # a memory file starts at 0o777, which a checkout would apply
        else:  # pragma: no cover - not Linux
            with tempfile.TemporaryFile(prefix="tailor-") as spare:
                self.fd = os.dup(spare.fileno())

    def writer(self) -> IO[bytes]:
        """A buffered binary stream at the file's start; the caller closes it."""
        return os.fdopen(os.dup(self.fd), "wb")

    @property
    def size(self) -> int:
        return os.fstat(self.fd).st_size

    @property
    def path(self) -> Path:
        """A path that opens this very file in this process."""
        return Path(f"/proc/self/fd/{self.fd}")

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


@dataclass
class MemoryFolder:
    """Named memory files that a commit reads as the folder ``tag`` (``step-N``), with the DCP
    metadata that cuts its ``.distcp`` files when no ``.metadata`` file is among them."""

    tag: str
    step: int
    kind: str = DCP_FOLDER
    files: dict[str, MemoryFile] = field(default_factory=dict)
    dcp_metadata: Any = None  # formats/dcp.DcpMetadata

    def add(self, name: str) -> MemoryFile:
        self.files[name] = MemoryFile(name)
        return self.files[name]

    def layout(self) -> CheckpointLayout:
        rel = {name: f"{self.tag}/{name}" for name in sorted(self.files)}
        return CheckpointLayout(
            MEMORY_ROOT,
            self.kind,
            self.step,
            self.tag,
            list(rel.values()),
            memory={rel[name]: f.path for name, f in self.files.items()},
            dcp_metadata=self.dcp_metadata,
        )

    def close(self) -> None:
        for f in self.files.values():
            f.close()

    def __enter__(self) -> MemoryFolder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
