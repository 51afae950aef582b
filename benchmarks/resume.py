"""Time to resume: from ``load_checkpoint`` called to the first training step done.

``python -m benchmarks.resume SAVE_DIR TAG [--size medium]`` resumes the same DeepSpeed training
(2 ranks, ZeRO-2 bf16, the stall benchmark's model) from the save ``SAVE_DIR/TAG`` four ways:

* ``raw``: DeepSpeed loads its own save from local disk (page cache warm);
* ``store``: through ``attach`` from a local store holding the step: each rank builds the files it
  loads straight from the store, in memory (nothing staged);
* ``store-staged``: the same with ``staged_resume=True``: the step checked out into staging first;
* ``store-s3``: the same from a store on a local S3 server (moto, 127.0.0.1);
* ``download-then-load``: the raw save's files fetched from that server, then ``raw``.

With ``--cold`` the page cache is dropped before each resume, as when a job restarts on a node
that did not write the save (the download's own files are then cold too).

Each way's time is the training's own (``resume_seconds``), the download's added for the last;
median of ``--repeats``. The losses after the resume must be the same every way.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import boto3

from tailorstore import Store
from testbed.local_s3 import BUCKET, local_s3
from testbed.runs import train_tiny

from .suite import SIZES, drop_caches

WAYS = ("raw", "store", "store-staged", "store-s3", "download-then-load")


def model_options(size_name: str) -> dict[str, object]:
    size = SIZES[size_name]
    return {
        "stage": 2, "dtype": "bf16", "seq": 64, "micro_batch": 2, "lr": 1e-3, "dim": size.dim, "layers": size.layers,
        "hidden": size.hidden, "vocab": size.vocab, "heads": size.heads, "fp32_compute": True,
    }  # fmt: skip


def resume(work: Path, step: int, tag: str, **how: object) -> tuple[float, dict]:
    timings = work / "timings.json"
    losses = train_tiny(
        work / "save", losses_out=work / "losses.json", steps=step + 1, save_every=0, resume_tag=tag,
        timings_out=timings, **how,
    )  # fmt: skip
    return json.loads(timings.read_text())["resume_seconds"], losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("save", type=Path)
    parser.add_argument("tag")
    parser.add_argument("--size", default="medium", choices=sorted(SIZES))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cold", action="store_true", help="drop the page cache before each resume (root)")
    parser.add_argument("--ways", default=",".join(WAYS), help="which ways, comma-separated (default: all)")
    parser.add_argument("--make", action="store_true", help="first train the model 12 steps and save it at SAVE")
    args = parser.parse_args()
    if args.make:
        train_tiny(
            args.save, losses_out=args.save.parent / "made.json", steps=12, save_every=12, **model_options(args.size)
        )
    ways = [w for w in args.ways.split(",") if w]
    if not ways or set(ways) - set(WAYS) or "raw" not in ways:
        raise SystemExit(f"--ways: give raw and any of {', '.join(WAYS)}")
    step = int(args.tag.removeprefix("global_step"))
    options = model_options(args.size)
    raw_bytes = sum(p.stat().st_size for p in (args.save / args.tag).rglob("*") if p.is_file())
    results: dict[str, list[float]] = {}
    losses: dict[str, dict] = {}
    work = Path(tempfile.mkdtemp(prefix="tailor-resume-"))
    with local_s3() as server:
        local, remote = work / "store", server.new_location()
        for location in (local, remote):
            with Store.init(location) as store:
                store.commit(args.save / args.tag)
        client = boto3.client("s3", endpoint_url=server.endpoint, region_name="us-east-1")
        prefix = server.new_location().split(f"s3://{BUCKET}/", 1)[1]
        files = [p for p in (args.save / args.tag).rglob("*") if p.is_file()]
        for path in files:
            client.upload_file(str(path), BUCKET, f"{prefix}/{path.relative_to(args.save)}")
        for repeat in range(args.repeats):
            for way in ways:
                run = work / f"{way}-{repeat}"
                run.mkdir()
                extra = 0.0
                if way == "raw":
                    how: dict[str, object] = {"resume_from": args.save}
                elif way == "download-then-load":
                    began = time.perf_counter()
                    for path in files:
                        target = run / "fetched" / path.relative_to(args.save)
                        target.parent.mkdir(parents=True, exist_ok=True)
                        client.download_file(BUCKET, f"{prefix}/{path.relative_to(args.save)}", str(target))
                    extra = time.perf_counter() - began
                    how = {"resume_from": run / "fetched"}
                else:
                    how = {"tailor_engine": True, "commit_to": remote if way == "store-s3" else local,
                           "resume_from": run / "nothing-on-disk", "staged_resume": way == "store-staged"}  # fmt: skip
                if args.cold and not drop_caches():
                    raise SystemExit("--cold needs to write /proc/sys/vm/drop_caches (root)")
                seconds, found = resume(run, step, args.tag, **how, **options)
                results.setdefault(way, []).append(seconds + extra)
                losses.setdefault(way, found)
                shutil.rmtree(run, ignore_errors=True)
    shutil.rmtree(work, ignore_errors=True)
    same = all(v == losses["raw"] for v in losses.values())
    report = {
        "raw_bytes": raw_bytes,
        "median_seconds": {way: statistics.median(v) for way, v in results.items()},
        "all": results,
        "losses_equal": same,
    }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
