"""How long a save with a stalled request takes to fail, against its bound (``TAILOR_SAVE_SECONDS``).

    python -m benchmarks.save_bound --servers moto,seaweedfs --bound 60
    python -m benchmarks.save_bound --servers seaweedfs --bound 300 --held manifest   # the default bound

A relay (testbed/s3_relay.py) in front of the server holds, every try of it, one upload part of a
96 MiB blob (a multipart upload) or the PUT of the step's manifest; `tailor commit` runs with the
library's defaults otherwise (30 s a request try, 180 s of retries). Reported: the seconds from
the relay taking the held request to the command's exit, the exit code, and whether that is
within the bound plus 10%. Exits 1 if any run was not (docs/benchmarks.md holds the figures).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SMALL_SAVE = ROOT / "tests" / "data" / "format1" / "checkpoint"
HELD = {"upload-part": r"/blobs/.*partNumber=2&", "manifest": r"/manifests/main/step-"}


def server_of(kind: str, work: Path):  # type: ignore[no-untyped-def]
    if kind == "seaweedfs":
        from testbed.seaweed_s3 import SeaweedS3

        return SeaweedS3(work / "seaweedfs").start()
    from testbed.local_s3 import LocalS3

    return LocalS3().start()


def one(server, held: str, bound: float, big: Path, work: Path) -> dict:  # type: ignore[no-untyped-def]
    from testbed.s3_relay import Relay, Rule

    cli = [sys.executable, "-m", "tailorstore.cli.app"]
    location = server.new_location()
    with Relay(server.port) as relay:
        env = {**os.environ, **server.environ(), "AWS_ENDPOINT_URL": relay.endpoint}
        env.update(TAILOR_CACHE=str(work / f"cache-{time.monotonic_ns()}"), TAILOR_SAVE_SECONDS=f"{bound:g}")
        subprocess.run([*cli, "init", location], env=env, check=True, capture_output=True)
        rule = relay.add(Rule("hold", method="PUT", target=HELD[held], times=None))
        save = big if held == "upload-part" else SMALL_SAVE
        began = time.monotonic()
        done = subprocess.run([*cli, "commit", str(save), "--store", location, "--step", "5"], env=env,
                              capture_output=True, text=True, timeout=bound * 3 + 300)  # fmt: skip
        ended = time.monotonic()
    held_at = rule.first_at or began
    seconds = ended - held_at
    return {
        "held": held,
        "bound": bound,
        "exit": done.returncode,
        "seconds": seconds,
        "whole": ended - began,
        "within": done.returncode == 5 and seconds <= bound * 1.1,
        "said": done.stderr.strip().splitlines()[-1][:160] if done.stderr.strip() else "",
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--servers", default="moto,seaweedfs")
    parser.add_argument("--bound", type=float, default=60.0)
    parser.add_argument("--held", default="upload-part,manifest")
    args = parser.parse_args(argv)
    import logging

    import torch

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    ok = True
    with tempfile.TemporaryDirectory(prefix="save-bound-") as scratch:
        work = Path(scratch)
        big = work / "big"
        big.mkdir()
        torch.save({"w": torch.randn(24 << 20, generator=torch.Generator().manual_seed(0))}, big / "model.pt")
        print("| server | held request | bound | exit | seconds from the held request to the exit | "
              "whole command | within bound + 10% |")  # fmt: skip
        print("|---|---|---|---|---|---|---|")
        for kind in args.servers.split(","):
            server = server_of(kind, work)
            try:
                for held in args.held.split(","):
                    r = one(server, held, args.bound, big, work)
                    ok &= r["within"]
                    print(f"| {kind} | {held} | {r['bound']:g} s | {r['exit']} | {r['seconds']:.1f} s | "
                          f"{r['whole']:.1f} s | {'yes' if r['within'] else 'NO'} |", flush=True)  # fmt: skip
                    print(f"<!-- {r['said']} -->", flush=True)
            finally:
                server.stop()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
