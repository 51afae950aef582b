"""A soak of many saves through the DCP writer: host memory stays flat, and every checked save is
the bytes ``dcp.save`` writes of the same state.

``python -m benchmarks.dcp_soak [--saves 1000]`` trains the tiny Llama of ``testbed.train_fsdp``
(FSDP2, AdamW, 2 CPU ranks) for ``--saves`` steps, saving every step with ``dcp.async_save`` through
TailorStorageWriter (DCP's thread checkpointer and stager: the next step trains while the save is
written), and records rank 0's resident memory after each save. It trains the same model again
with plain ``dcp.save`` to folders every ``saves / 10`` steps. Then:

- each of those steps is checked out of the store and its ``.distcp`` files compared byte for
  byte with the plain save's (a staging buffer reused too early, as Megatron-LM once found, would
  put another step's bytes into this one);
- the two runs' losses must be equal, bit for bit;
- memory: the mean resident size over the last tenth of the saves against saves in the second
  tenth (for 1,000 saves: the last 100 against saves 100-200), target within 5%.

Prints one JSON line; ``tests/system/test_dcp_soak.py`` runs 100 saves.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.save_soak import memory_figures
from tailorstore import Store
from testbed.runs import torchrun

MODEL = ["--layers", "1", "--hidden", "32", "--vocab", "128"]


def soak(work: Path, saves: int) -> dict:
    """Run the soak in ``work``; its figures, and whether each check held."""
    every = max(1, saves // 10)
    store = work / "store"
    Store.init(store).close()
    began = time.perf_counter()
    torchrun(
        "testbed.train_fsdp",
        [*MODEL, "--steps", str(saves), "--save-every", "1", "--output-dir", str(work / "tailor"),
         "--save-to-store", str(store), "--async-save", "thread", "--rss-out", str(work / "rss.json"),
         "--losses-out", str(work / "tailor-losses.json")],
        log=work / "tailor.log",
        timeout=3600,
    )  # fmt: skip
    soak_seconds = time.perf_counter() - began
    torchrun(
        "testbed.train_fsdp",
        [*MODEL, "--steps", str(saves), "--save-every", str(every), "--output-dir", str(work / "plain"),
         "--losses-out", str(work / "plain-losses.json")],
        log=work / "plain.log",
        timeout=3600,
    )  # fmt: skip
    compared = {}
    with Store.open(store) as st:
        steps = [s.step for s in st.log()]
        for step in range(every, saves + 1, every):
            out = work / f"out-{step}"
            st.checkout(f"step={step}", out)
            plain = sorted((work / "plain" / f"step-{step}").glob("*.distcp"))
            compared[step] = bool(plain) and all((out / f.name).read_bytes() == f.read_bytes() for f in plain)
        verified = st.verify(deep=True).ok
    return {
        "saves": saves,
        "steps_in_store": len(steps),
        "byte_exact": compared,
        "verified": verified,
        "losses_equal": json.loads((work / "tailor-losses.json").read_text())
        == json.loads((work / "plain-losses.json").read_text()),
        **memory_figures(json.loads((work / "rss.json").read_text())),
        "soak_seconds": round(soak_seconds, 1),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--saves", type=int, default=1000)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="dcp-soak-") as work:
        print(json.dumps(soak(Path(work), args.saves)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
