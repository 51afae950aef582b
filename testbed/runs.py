"""Launching the tiny DeepSpeed trainings as real 2-rank jobs, the way torchrun starts them.

Shared by the tests, the demo and the benchmarks, so that every one of them works on
checkpoints that DeepSpeed itself wrote.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path


class TrainingFailed(RuntimeError):
    pass


REPOSITORY = Path(__file__).resolve().parents[1]  # testbed/ is not installed: its jobs find it here


def _with_repository(path: str | None) -> str:
    return os.pathsep.join([str(REPOSITORY), *([path] if path else [])])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def torchrun_command(module: str, args: list[str], *, nproc: int = 2) -> tuple[list[str], dict[str, str]]:
    """The command and environment of a CPU torchrun job on 127.0.0.1 (benchmarks poll it while it runs)."""
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = _with_repository(env.get("PYTHONPATH"))
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


def torchrun(
    module: str,
    args: list[str],
    *,
    nproc: int = 2,
    log: Path | None = None,
    timeout: float = 900,
    node_env: list[dict[str, str]] | None = None,
) -> None:
    """Run ``python -m module`` as ``nproc`` ranks on 127.0.0.1, as torchrun would, without torchrun.

    torchrun's own process imports torch before it starts a rank, seconds once per job
    (docs/PERFORMANCE.md, "Start-up: importing on first use"), and the test suite runs some fifty
    jobs. The ranks get the environment torchrun gives them (RANK, LOCAL_RANK, WORLD_SIZE,
    MASTER_ADDR/PORT, ...). As torchrun does, a rank that fails ends the job: the others are
    killed rather than left waiting in a collective for gloo's timeout.

    ``node_env`` simulates nodes, as ``torchrun --nnodes N --node_rank R`` on each would: one
    environment overlay per node (its own ``TAILOR_STAGING``, ``TAILOR_CACHE``), ``nproc`` ranks
    on each, numbered node by node.
    """
    base = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    base["PYTHONPATH"] = _with_repository(base.get("PYTHONPATH"))
    base.pop("CUDA_VISIBLE_DEVICES", None)
    port = str(_free_port())
    overlays = node_env or [{}]
    world = nproc * len(overlays)
    with tempfile.TemporaryDirectory(prefix="tailor-ranks-") as tmp:
        outputs = [Path(tmp) / f"rank{rank}.log" for rank in range(world)]
        procs = []
        for rank, output in enumerate(outputs):
            node, local = divmod(rank, nproc)
            env = dict(
                base, RANK=str(rank), LOCAL_RANK=str(local), GROUP_RANK=str(node), ROLE_RANK=str(rank),
                WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(nproc), ROLE_WORLD_SIZE=str(world),
                MASTER_ADDR="127.0.0.1", MASTER_PORT=port, **overlays[node],
            )  # fmt: skip
            with output.open("wb") as sink:
                procs.append(
                    subprocess.Popen(
                        [sys.executable, "-m", module, *args], env=env, stdout=sink, stderr=subprocess.STDOUT
                    )
                )
        failed = _wait_all(procs, timeout)
        text = "".join(f"[rank {rank}]\n{output.read_text(errors='replace')}" for rank, output in enumerate(outputs))
    if log is not None:
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text(text)
    if failed is not None:
        tail = "\n".join(text.splitlines()[-40:])
        raise TrainingFailed(f"python -m {module} {' '.join(args)}: {failed}:\n{tail}")


def _wait_all(procs: list[subprocess.Popen[bytes]], timeout: float) -> str | None:
    """Wait for every rank; on the first failure (or the timeout) kill the rest. Returns what went wrong."""
    deadline = time.monotonic() + timeout
    failed = None
    while failed is None and None in [p.poll() for p in procs]:  # a list: every rank polled each time
        bad = [(rank, p.returncode) for rank, p in enumerate(procs) if p.returncode not in (None, 0)]
        if bad:
            failed = f"rank {bad[0][0]} exited with code {bad[0][1]}"
        elif time.monotonic() > deadline:
            failed = f"no end after {timeout:.0f} s"
        else:
            time.sleep(0.05)
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()
    if failed is None and any(p.returncode != 0 for p in procs):
        rank, code = next((r, p.returncode) for r, p in enumerate(procs) if p.returncode != 0)
        failed = f"rank {rank} exited with code {code}"
    return failed


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
    save_dir: Path,
    *,
    losses_out: Path,
    resume_from: Path | None = None,
    nproc: int = 2,
    timeout: float = 900,
    node_env: list[dict[str, str]] | None = None,
    **options: object,
) -> dict[int, str]:
    """Run train_tiny; options map to its flags (stage=3 -> --stage 3). Returns losses as float.hex."""
    losses_out.parent.mkdir(parents=True, exist_ok=True)
    args = ["--save-dir", str(save_dir), "--losses-out", str(losses_out)]
    if resume_from is not None:
        args += ["--resume-from", str(resume_from)]
    args += _flags(options)
    log = losses_out.with_suffix(".log")
    torchrun("testbed.train_tiny", args, nproc=nproc, log=log, timeout=timeout, node_env=node_env)
    return {int(k): v for k, v in json.loads(losses_out.read_text()).items()}


def train_hf(
    output_dir: Path, *, final_weights: Path, resume_from: Path | None = None, nproc: int = 2, **options: object
) -> None:
    args = ["--output-dir", str(output_dir), "--final-weights", str(final_weights)]
    if resume_from is not None:
        args += ["--resume-from", str(resume_from)]
    args += _flags(options)
    torchrun("testbed.train_hf", args, nproc=nproc, log=final_weights.with_suffix(".log"))
