"""Peak memory of archiving one large weight: ``python -m benchmarks.archive_memory [--mib 128]``.

Encodes one random bf16 weight of ``--mib`` MiB as a keyframe of the archive codec
(store/archive_codec.py) and reports how far this process's peak RSS grew while it did, against
the weight's own size. The weight is made in small runs first, so the peak before is the weight
and the interpreter.
"""

from __future__ import annotations

import argparse
import json
import resource

import numpy as np

from tailorstore.store import archive_codec


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mib", type=int, default=128)
    args = parser.parse_args()
    n = (args.mib << 20) // 2
    rng = np.random.default_rng(0)
    raw = bytearray(2 * n)
    view = np.frombuffer(raw, dtype=np.uint16)
    for lo in range(0, n, 1 << 20):
        values = rng.standard_normal(min(1 << 20, n - lo)).astype(np.float32)
        view[lo : lo + values.size] = (values.view(np.uint32) >> 16).astype(np.uint16)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10
    out = archive_codec.encode(memoryview(raw), "bfloat16", None, ())
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10
    assert out is not None
    report = {"weight_bytes": len(raw), "peak_rss_growth_bytes": after - before, "payload_bytes": len(out.payload)}
    print(json.dumps(report | {"growth_over_weight": (after - before) / len(raw)}))


if __name__ == "__main__":
    main()
