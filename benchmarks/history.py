"""History worth keeping: keep-best retention by held-out loss, and frozen layers stored once.

``python -m benchmarks.history [--steps 60 --every 6 --eval-batches 8]`` trains the headline's
model (benchmarks/headline.py, ``MODEL``: 55M parameters, ZeRO-2 bf16, 2 ranks, text-like data)
twice through ``attach``, every save committed into a store of its own as training runs:

- **keep-best**: the held-out loss is evaluated before each save and recorded with its step
  (``set_metrics``). Then ``gc --keep-last 3 --keep-best eval_loss:min:3``: the store against the
  raw series before and after, and whether the steps that remain are exactly the last 3 and the
  3 best by the losses the training itself printed;
- **frozen**: the same model with the embedding and the lower half of the blocks frozen
  (``requires_grad=False``): the store against the raw series, beside the unfrozen run's, and the
  frozen layers' stored bytes against one save's worth of them.

Prints one JSON line and writes it to ``.bench/history.json``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks.headline import MODEL
from tailorstore import Retention, Store
from tailorstore.access.contents import Contents
from testbed.runs import train_tiny

FROZEN = {"embedding"}  # and the lower half of the blocks, added below


def run(work: Path, name: str, steps: int, every: int, eval_batches: int, **extra: object) -> tuple[Path, dict]:
    """Train and commit through attach once (a later call reuses the store), with the held-out
    loss recorded at each save; returns the store and those losses."""
    store = work / f"store-{name}"
    if not store.exists():
        Store.init(store).close()
        train_tiny(
            work / f"save-{name}", losses_out=work / f"losses-{name}.json", steps=steps, save_every=every,
            commit_to=store, tailor_engine=True, eval_batches=eval_batches, eval_at_save=True,
            evals_out=work / f"evals-{name}.json", timeout=4 * 3600, **{**MODEL, **extra},
        )  # fmt: skip
    evals = {int(k): v for k, v in json.loads((work / f"evals-{name}.json").read_text()).items()}
    return store, evals


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--every", type=int, default=6)
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--work", default=".bench/history")
    p.add_argument("--lr", type=float, default=None, help="the keep-best run's learning rate (default: the headline's)")
    args = p.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    result: dict = {"model": MODEL, "steps": args.steps, "every": args.every, "keep_best_lr": args.lr or MODEL["lr"]}

    store_path, evals = run(work, "plain", args.steps, args.every, args.eval_batches, lr=args.lr or MODEL["lr"])
    with Store.open(store_path) as store:
        steps = store.log()
        raw = sum(s.raw_bytes for s in steps)
        recorded = {s.step: s.metrics.get("eval_loss") for s in steps}
        before = store.usage().stored_bytes
        store.gc(Retention(keep_last=3, keep_best="eval_loss:min:3"))
        left = sorted(s.step for s in store.log())
        after = store.usage().stored_bytes
        verified = store.verify(deep=True).ok
    order = sorted(evals, key=lambda s: (evals[s], -s))
    expected = sorted(set(sorted(evals)[-3:]) | set(order[:3]))
    result["keep_best"] = {
        "saves": len(steps), "raw_series_bytes": raw, "store_bytes_all": before, "ratio_all": raw / before,
        "store_bytes_kept": after, "ratio_after_gc": raw / after, "kept_steps": left, "expected_steps": expected,
        "best_3_by_held_out_loss": order[:3], "held_out_loss": evals, "recorded_equals_evaluated": recorded == evals,
        "verify_deep_ok": verified,
    }  # fmt: skip

    layers = int(MODEL["layers"])
    frozen_layers = FROZEN | {f"block.{i}" for i in range(layers // 2)}
    frozen_path, _ = run(work, "frozen", args.steps, args.every, args.eval_batches, freeze_bottom=True)
    with Store.open(frozen_path) as store:
        steps = store.log()
        raw_frozen = sum(s.raw_bytes for s in steps)
        stored_frozen = store.usage().stored_bytes
        first = store.show(f"step={steps[0].step}")
        frozen_stored = sum(x.stored_bytes for x in first.layers if x.layer in frozen_layers)
        blobs_by_step = [
            {a.blob for a in store.repo.view(Contents).atoms(s.manifest) if a.layer in frozen_layers} for s in steps
        ]
    result["frozen"] = {
        "saves": len(steps), "raw_series_bytes": raw_frozen, "store_bytes": stored_frozen,
        "ratio": raw_frozen / stored_frozen, "unfrozen_ratio": raw / before,
        "frozen_layers_stored_bytes_one_save": frozen_stored,
        "frozen_blobs_the_same_every_save": all(b == blobs_by_step[0] for b in blobs_by_step),
    }  # fmt: skip
    (work / "history.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
