"""Launching the tiny DeepSpeed trainings as real 2-rank torchrun jobs.

Shared by the tests, the demo and the benchmarks, so that every one of them works on
checkpoints that DeepSpeed itself wrote.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path


class TrainingFailed(RuntimeError):
    pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def torchrun_command(module: str, args: list[str], *, nproc: int = 2) -> tuple[list[str], dict[str, str]]:
    """The command and environment of a CPU torchrun job on 127.0.0.1 (benchmarks poll it while it runs)."""
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    env.pop("CUDA_VISIBLE_DEVICES", None)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(nproc),
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(_free_port()),
        "-m",
        module,
        *args,
    ]
    return cmd, env


def torchrun(module: str, args: list[str], *, nproc: int = 2, log: Path | None = None, timeout: float = 900) -> None:
    cmd, env = torchrun_command(module, args, nproc=nproc)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if log is not None:
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-40:])
        raise TrainingFailed(f"{' '.join(cmd)} failed with exit code {proc.returncode}:\n{tail}")


def _flags(options: dict[str, object]) -> list[str]:
    """step=3 -> --step 3; True -> a bare flag; None and False -> nothing."""
    out: list[str] = []
    for key, value in options.items():
        flag = f"--{key.replace('_', '-')}"
        if value is True:
            out.append(flag)
        elif value is not None and value is not False:
            out += [flag, str(value)]
    return out


def train_tiny(
    save_dir: Path, *, losses_out: Path, resume_from: Path | None = None, nproc: int = 2, **options: object
) -> dict[int, str]:
    """Run train_tiny; options map to its flags (stage=3 -> --stage 3). Returns losses as float.hex."""
    losses_out.parent.mkdir(parents=True, exist_ok=True)
    args = ["--save-dir", str(save_dir), "--losses-out", str(losses_out)]
    if resume_from is not None:
        args += ["--resume-from", str(resume_from)]
    args += _flags(options)
    torchrun("tailorstore.testing.train_tiny", args, nproc=nproc, log=losses_out.with_suffix(".log"))
    return {int(k): v for k, v in json.loads(losses_out.read_text()).items()}


def train_hf(output_dir: Path, *, final_weights: Path, resume_from: Path | None = None, **options: object) -> None:
    args = ["--output-dir", str(output_dir), "--final-weights", str(final_weights)]
    if resume_from is not None:
        args += ["--resume-from", str(resume_from)]
    args += _flags(options)
    torchrun("tailorstore.testing.train_hf", args, log=final_weights.with_suffix(".log"))
