"""The archive tier on a long series: the store against the raw series, and each archived step's
held-out loss against that step's exact one.

``python -m benchmarks.archive [--steps 350 --every 5 --eval-batches 16]`` (and ``--archive-levels L
--keyframe-every K`` for a coarser tier) trains the headline's model (benchmarks/headline.py,
``MODEL``: 55M parameters, ZeRO-2 bf16, 2 ranks, text-like data) through ``attach``, every save
committed into a store as training runs. Then:

1. every step is exported (bf16 safetensors) and its held-out loss evaluated: the exact loss;
2. ``gc --keep-last 3 --thin archive``: every other step archived (timed);
3. every archived step is exported again and evaluated the same way.

Reported: the raw series, the store before and after, their ratio, the worst step's relative
difference of held-out loss (not the mean), ``verify --deep``, and how many archived weights
are keyframes and residuals. The evaluator is the same for both sides: the exported weights
loaded into the training's model, in bf16 with fp32 arithmetic, over the same held-out batches.
Prints one JSON line and writes it to ``<work>/archive.json``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file

from benchmarks.headline import MODEL
from tailorstore import Retention, Store
from tailorstore.access.contents import Contents
from tailorstore.store import archive_codec
from testbed.runs import train_tiny
from testbed.train_tiny import DATA, HELD_OUT, TinyLlama

DIMS = ("vocab", "dim", "layers", "heads", "hidden")


def evaluator(batches: int) -> Callable[[Path], float]:
    """The held-out loss of an exported folder's weights, in the training's model."""
    model = TinyLlama(**{k: int(MODEL[k]) for k in DIMS}, fp32_compute=True).to(torch.bfloat16).eval()
    make = DATA[str(MODEL["data"])]
    shape = (int(MODEL["micro_batch"]), int(MODEL["seq"]), int(MODEL["vocab"]))
    data = [make(HELD_OUT + i, 0, *shape) for i in range(batches)]
    names = {n for n, _ in model.named_parameters()}

    def loss(weights: Path) -> float:
        tensors = load_file(weights / "model.safetensors")
        missing = names - set(tensors)
        if missing:
            raise SystemExit(f"the export lacks {sorted(missing)[:3]}")
        model.load_state_dict(tensors, strict=False)
        with torch.no_grad():
            return sum(model(t).item() for t in data) / len(data)

    return loss


def held_out(store: Store, steps: list[int], work: Path, loss: Callable[[Path], float]) -> dict[int, float]:
    out = {}
    for step in steps:
        folder = work / f"export-{step}"
        shutil.rmtree(folder, ignore_errors=True)
        store.export(f"step={step}", folder, dtype="bf16")
        out[step] = loss(folder)
        shutil.rmtree(folder)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=350)
    p.add_argument("--every", type=int, default=5)
    p.add_argument("--eval-batches", type=int, default=16)
    p.add_argument("--keep-last", type=int, default=3)
    p.add_argument("--archive-levels", type=int, default=None, help="the archive grid (default: the tier's)")
    p.add_argument("--keyframe-every", type=int, default=None, help="the keyframe interval (default: the tier's)")
    p.add_argument("--work", default=".bench/archive")
    args = p.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    path = work / "store"
    if not path.exists():
        Store.init(path).close()
        began = time.perf_counter()
        train_tiny(
            work / "save", losses_out=work / "losses.json", steps=args.steps, save_every=args.every,
            commit_to=path, tailor_engine=True, timeout=6 * 3600, **MODEL,
        )  # fmt: skip
        print(f"trained and committed in {time.perf_counter() - began:.0f} s", flush=True)
    loss = evaluator(args.eval_batches)
    with Store.open(path) as store:
        log = store.log()
        steps = sorted(s.step for s in log)
        raw = sum(s.raw_bytes for s in log)
        exact_path = work / "exact.json"
        if exact_path.exists():
            exact = {int(k): v for k, v in json.loads(exact_path.read_text()).items()}
        else:
            exact = held_out(store, steps, work, loss)
            exact_path.write_text(json.dumps(exact))
        before = store.usage().stored_bytes
        began = time.perf_counter()
        store.gc(
            Retention(
                keep_last=args.keep_last, thin="archive", archive_levels=args.archive_levels,
                keyframe_every=args.keyframe_every,
            )
        )
        gc_seconds = time.perf_counter() - began
        after = store.usage().stored_bytes
        tiers = {s.step: s.tier for s in store.log()}
        archived = [s for s in steps if tiers.get(s) == "archive"]
        got = held_out(store, archived, work, loss)
        verified = store.verify(deep=True).ok
        chains = [
            len(archive_codec.parse(b.codec, b.raw_size, "bench").bases)
            for s in store.log()
            if s.tier == "archive"
            for a in store.repo.view(Contents).atoms(s.manifest)
            if (b := store.repo.blob(a.blob)) is not None and archive_codec.is_archive(b.codec)
        ]
    diffs = {s: abs(got[s] - exact[s]) / exact[s] for s in archived}
    worst = max(diffs, key=lambda s: diffs[s])
    result = {
        "model": MODEL, "steps": args.steps, "every": args.every, "saves": len(steps), "kept_whole": args.keep_last,
        "archive_levels": args.archive_levels, "keyframe_every": args.keyframe_every,
        "archived_steps": len(archived), "raw_series_bytes": raw, "store_bytes_whole": before,
        "ratio_whole": raw / before, "store_bytes_after": after, "ratio_after": raw / after,
        "gc_seconds": gc_seconds, "worst_step": worst, "worst_relative_loss_difference": diffs[worst],
        "worst_exact_loss": exact[worst], "worst_archived_loss": got[worst],
        "mean_relative_loss_difference": sum(diffs.values()) / len(diffs),
        "keyframes": sum(1 for n in chains if n == 0), "residuals": sum(1 for n in chains if n > 0),
        "verify_deep_ok": verified, "exact_loss": exact, "archived_loss": got,
    }  # fmt: skip
    (work / "archive.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
