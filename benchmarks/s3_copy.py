"""The baseline of the S3 benchmark: upload or download a checkpoint's files with obstore as
they are, one object per file, as a user copying checkpoints to S3 would.

    python -m benchmarks.s3_copy up DIR s3://bucket/prefix
    python -m benchmarks.s3_copy down s3://bucket/prefix DIR

Endpoint and credentials come from the AWS_* variables. Downloads are written and synced,
as a checkout's are.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import obstore
from obstore.store import from_url


def _store(location: str) -> obstore.store.S3Store:
    return from_url(location, client_options={"allow_http": True})


def up(src: Path, location: str) -> None:
    store = _store(location)
    for path in sorted(p for p in src.rglob("*") if p.is_file()):
        obstore.put(store, path.relative_to(src).as_posix(), path)


def down(location: str, dst: Path) -> None:
    store = _store(location)
    for batch in obstore.list(store):
        for meta in batch:
            target = dst / meta["path"]
            target.parent.mkdir(parents=True, exist_ok=True)
            with open(target, "wb") as f:
                for chunk in obstore.get(store, meta["path"]).stream():
                    f.write(chunk)
    subprocess.run(["sync"], check=True)


if __name__ == "__main__":
    op, a, b = sys.argv[1:4]
    up(Path(a), b) if op == "up" else down(a, Path(b))
    os._exit(0)
