"""What the DeepSpeed integration's modules share: the logger, the engine's name, where staging
goes by default, and the step a DeepSpeed tag names."""

from __future__ import annotations

import logging
import os
import re
import tempfile
from pathlib import Path
from typing import Any, TypeVar

from tailorstore.core.environment import STAGING_ENV

log = logging.getLogger("tailorstore")
T = TypeVar("T")
ENGINE_NAME = "TailorCheckpointEngine"
RESTORE_PREFIX = "restore-"  # the engine's folders for the files of a resume, inside its staging


def default_staging() -> Path:
    """Memory-backed staging: ``$TAILOR_STAGING``, else ``/dev/shm`` where it exists, else the temp dir."""
    configured = os.environ.get(STAGING_ENV)
    if configured:
        return Path(configured)
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        return shm
    return Path(tempfile.gettempdir())


def step_of_tag(tag: str) -> int | None:
    """``global_step120`` -> 120: DeepSpeed's default tag names the step."""
    match = re.fullmatch(r"global_step(\d+)", tag)
    return int(match.group(1)) if match else None


def shape_of(engine: Any) -> tuple[int, int]:
    """(data-parallel world size, ZeRO stage) that ``engine`` trains at now."""
    return int(engine.dp_world_size), int(engine.zero_optimization_stage())
