"""The demo: train with DeepSpeed, commit every save, delete the originals, resume from the store.

Run it with ``make demo`` (or ``python -m examples.demo``). It trains a tiny Llama-style
model on the CPU with 2 ranks, ZeRO-2 and bf16, commits each checkpoint into a fresh store
right after DeepSpeed saves it and deletes the original, then checks out a middle step,
resumes training from it and shows that the losses match the uninterrupted run bit for bit.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from tailorstore.report.inspect import log
from tailorstore.store.repo import Repository
from testbed.runs import train_tiny


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000:
            return f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def store_bytes(root: Path) -> int:
    """Everything the store holds on disk: blobs, packs, manifest and ref objects, the index."""
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file() and "tmp" not in p.relative_to(root).parts)


def tailor(store: Path, *args: str) -> str:
    """Run the `tailor` command as a user would type it, echo the command and its output."""
    print(f"   $ tailor {shlex.join(args)}")
    installed = shutil.which("tailor")
    command = [installed] if installed else [sys.executable, "-m", "tailorstore.cli.app"]
    done = subprocess.run(
        [*command, *args], capture_output=True, text=True, env=dict(os.environ, TAILOR_STORE=str(store)), check=False
    )
    for line in (done.stdout + done.stderr).splitlines():
        print(f"     {line}")
    if done.returncode != 0:
        raise SystemExit(f"`tailor {shlex.join(args)}` failed with exit code {done.returncode}")
    return done.stdout


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--workdir", type=Path, default=None, help="keep the run here instead of a temp dir")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--save-every", type=int, default=3)
    args = parser.parse_args(argv)
    work = args.workdir or Path(tempfile.mkdtemp(prefix="tailor-demo-"))
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    store_root = work / "store"
    Repository.init(store_root).close()
    model = {"stage": 2, "dtype": "bf16", "layers": 6, "dim": 96, "hidden": 256}

    print(
        f"1. training {args.steps} steps (DeepSpeed ZeRO-2, bf16, 2 CPU ranks), committing every "
        f"{args.save_every} steps into {store_root} and deleting each original..."
    )
    losses = train_tiny(
        work / "save",
        losses_out=work / "losses.json",
        steps=args.steps,
        save_every=args.save_every,
        commit_to=store_root,
        delete_after_commit=True,
        **model,
    )
    left = [p.name for p in (work / "save").iterdir() if p.name.startswith("global_step")]
    print(f"   original tag folders left on disk: {left or 'none'}")

    with Repository.open(store_root) as store:
        steps = log(store)
    raw_total = sum(s.raw_bytes for s in steps)
    middle = steps[len(steps) // 2 - 1].step
    out = work / f"checkout-step{middle}"
    print(f"2. the store, through the command line (export TAILOR_STORE={store_root}):")
    tailor(store_root, "log")
    tailor(store_root, "show", f"step={middle}")
    tailor(store_root, "checkout", f"step={middle}", "--out", str(out))
    tailor(store_root, "verify", "--deep")
    tailor(store_root, "du")
    print(f"3. {out} is what engine.load_checkpoint() takes as it is: it holds `latest` and the tag folder")

    print(f"4. resuming DeepSpeed from the checkout at step {middle} and training to step {args.steps}...")
    resumed = train_tiny(
        work / "resumed-save",
        losses_out=work / "resumed.json",
        resume_from=out,
        steps=args.steps,
        save_every=0,
        **model,
    )
    expected = {s: losses[s] for s in resumed}
    match = resumed == expected and len(resumed) == args.steps - middle
    for s in sorted(resumed):
        mark = "==" if resumed[s] == losses[s] else "!="
        print(f"   step {s:>3}: resumed {float.fromhex(resumed[s]):.6f} {mark} original {float.fromhex(losses[s]):.6f}")
    held = store_bytes(store_root)
    print(f"5. resumed losses match the uninterrupted run bit for bit: {'YES' if match else 'NO'}")
    print(
        f"   raw checkpoints: {_human(raw_total)} in {len(steps)} steps; store on disk: {_human(held)} "
        f"({raw_total / held:.2f}x smaller)"
    )
    if args.workdir is None:
        print(f"   removing {work} (pass --workdir DIR to keep the store, the checkout and the logs)")
        shutil.rmtree(work)
    return 0 if match else 1


if __name__ == "__main__":
    sys.exit(main())
