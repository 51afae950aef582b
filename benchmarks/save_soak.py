"""A soak of many saves through ``attach`` with the snapshot: host memory stays flat, and the saves
are the bytes a plain save writes.

``python -m benchmarks.save_soak [--saves 1000]`` trains a tiny DeepSpeed model (ZeRO-2 bf16, 2 CPU
ranks) for ``--saves`` steps through ``attach`` with a save every step, each committed in the
background, and records rank 0's resident memory after each save. It trains the same model again
with plain ``save_checkpoint`` every ``saves / 10`` steps. Then:

- every one of those steps is checked out of the store and compared, file by file, with the plain
  save of the same state (the snapshot reuses its buffers two saves later; a buffer reused too
  early, as Megatron-LM once found, would write another step's bytes into this one);
- the two runs' losses must be equal, bit for bit;
- memory: the mean resident size over the last tenth of the saves against saves in the second
  tenth (for 1,000 saves: the last 100 against saves 100-200), target within 5%.

Prints one JSON line; ``tests/system/test_save_soak.py`` runs 100 saves.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from tailorstore import Store
from testbed.compare import same_tree
from testbed.runs import torchrun

MODEL = [
    "--dim", "32", "--layers", "1", "--heads", "2", "--hidden", "64", "--vocab", "256",
    "--seq", "16", "--micro-batch", "2", "--stage", "2", "--dtype", "bf16",
]  # fmt: skip


def memory_figures(rss: list[int]) -> dict:
    """A soak's resident memory (bytes after each save): the mean of the last tenth of the saves
    against the second tenth, the first and the largest, and the mean of each tenth."""
    tenth = max(1, len(rss) // 10)
    early, late = statistics.mean(rss[tenth : 2 * tenth]), statistics.mean(rss[-tenth:])
    return {
        "rss_second_tenth_mb": round(early / 2**20, 1),
        "rss_last_tenth_mb": round(late / 2**20, 1),
        "rss_ratio": round(late / early, 4),
        "rss_first_mb": round(rss[0] / 2**20, 1),
        "rss_max_mb": round(max(rss) / 2**20, 1),
        "rss_by_tenth_mb": [round(statistics.mean(rss[i : i + tenth]) / 2**20, 1) for i in range(0, len(rss), tenth)],
    }


def soak(work: Path, saves: int) -> dict:
    """Run the soak in ``work``; its figures, and whether each check held."""
    every = max(1, saves // 10)
    store = work / "store"
    Store.init(store).close()
    began = time.perf_counter()
    torchrun(
        "testbed.train_tiny",
        [*MODEL, "--steps", str(saves), "--save-every", "1", "--save-dir", str(work / "tailor"),
         "--commit-to", str(store), "--tailor-engine", "--rss-out", str(work / "rss.json"),
         "--losses-out", str(work / "tailor-losses.json")],
        log=work / "tailor.log",
        timeout=3600,
    )  # fmt: skip
    soak_seconds = time.perf_counter() - began
    torchrun(
        "testbed.train_tiny",
        [*MODEL, "--steps", str(saves), "--save-every", str(every), "--save-dir", str(work / "plain"),
         "--losses-out", str(work / "plain-losses.json")],
        log=work / "plain.log",
        timeout=3600,
    )  # fmt: skip
    compared = {}
    with Store.open(store) as st:
        steps = [s.step for s in st.log()]
        for step in range(every, saves + 1, every):
            out = work / f"out-{step}"
            st.checkout(step, out)
            compared[step] = same_tree(out / f"global_step{step}", work / "plain" / f"global_step{step}")
    return {
        "saves": saves,
        "steps_in_store": len(steps),
        "byte_exact": compared,
        "losses_equal": (work / "tailor-losses.json").read_text() == (work / "plain-losses.json").read_text(),
        **memory_figures(json.loads((work / "rss.json").read_text())),
        "soak_seconds": round(soak_seconds, 1),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--saves", type=int, default=1000)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="save-soak-") as work:
        print(json.dumps(soak(Path(work), args.saves)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
