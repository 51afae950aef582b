"""Run the benchmark suite and write docs/benchmarks.md.

    python -m benchmarks                      # small, medium (58M) and large (100M), 3 repeats
    python -m benchmarks --sizes medium --repeats 3
    python -m benchmarks --report-only        # re-render docs/benchmarks.md from saved results
    python -m benchmarks --sizes "" --s3 medium --repeats 1   # S3 (local moto server) against obstore copies

Trainings and results are kept under --workdir (default .bench/), so a re-run only
measures what is missing. Needs `pip install zipnn` for the zipnn column.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import re
import shlex
import sys
from pathlib import Path

from . import suite
from .report import render


def run_size(size: suite.Size, work: Path, repeats: int, saves: int, interval: int, codecs: bool) -> dict:
    save, steps, train_seconds = suite.train(size, work / "train", saves, interval)
    print(f"[{size.name}] trained {steps} in {train_seconds:.0f} s", flush=True)
    io = suite.measure_io(save, steps, work, repeats)
    print(f"[{size.name}] commit/checkout/copy measured", flush=True)
    result = {
        "size": size.__dict__,
        "params": suite.params_of(size),
        "steps": steps,
        "train_seconds": train_seconds,
        "repeats": repeats,
        **io,
        "by_kind": suite.store_by_kind(work / "store"),
        "merge_seconds": suite.time_merge(work / "store", steps, size.layers, repeats),
    }
    if codecs:
        result["codecs"] = suite.codec_comparison(save, steps)
        result["codec_speeds"] = suite.codec_speeds(save, steps[-1], repeats)
        result["io_paths"] = suite.io_paths(work / "io", repeats=repeats)
        print(f"[{size.name}] codecs compared", flush=True)
        thousand = suite.build_thousand(work / "store", work / "thousand")
        result["log_seconds"] = suite.time_cli(["log"], thousand, repeats)
        result["show_seconds"] = suite.time_cli(["show", f"step={steps[0]}"], thousand, repeats)
        result["log_json_seconds"] = suite.time_cli(["log", "--json"], thousand, repeats)
    return result


def with_kept_sections(text: str, previous: str) -> str:
    """Append the sections other benchmark scripts own (``<!-- NAME:begin -->`` to ``<!-- NAME:end -->``,
    written by benchmarks/startup.py and benchmarks/stall.py) from the previous document."""
    for match in re.finditer(r"<!-- (\w+):begin -->.*?<!-- \1:end -->", previous, flags=re.S):
        if match.group(0).split("\n", 1)[0] not in text:
            text = text.rstrip() + "\n\n" + match.group(0) + "\n"
    return text


def s3_file_name(latency_ms: float) -> str:
    """s3.json for the run without added latency (as before), s3-latency-20ms.json for one with."""
    return "s3.json" if latency_ms == 0 else f"s3-latency-{latency_ms:g}ms.json"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", default="small,medium,large")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--saves", type=int, default=5)
    parser.add_argument("--interval", type=int, default=20)
    parser.add_argument("--workdir", type=Path, default=Path(".bench"))
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks.md"))
    parser.add_argument("--report-only", action="store_true")
    parser.add_argument("--skip-quality", action="store_true", help="skip the parity-composite quality run")
    parser.add_argument("--s3", default="", help="also measure S3 against obstore copies for this size (e.g. medium)")
    parser.add_argument("--s3-saves", type=int, default=2, help="how many of that size's saves the S3 run commits")
    parser.add_argument(
        "--s3-latency", default="0", help="milliseconds each S3 request is held back, one S3 run per value (e.g. 0,20)"
    )
    args = parser.parse_args(argv)
    args.workdir.mkdir(parents=True, exist_ok=True)
    if not args.report_only:
        for name in [n for n in args.sizes.split(",") if n]:
            size = suite.SIZES[name]
            result = run_size(
                size, args.workdir / name, args.repeats, args.saves, args.interval, codecs=name == "medium"
            )
            result["command"] = "python -m benchmarks " + shlex.join(sys.argv[1:] if argv is None else argv)
            result["measured_at"] = dt.datetime.now().isoformat(timespec="seconds")
            result["machine"] = (
                f"{platform.machine()}, {__import__('os').cpu_count()} cores, Python {platform.python_version()}"
            )
            (args.workdir / f"result-{name}.json").write_text(json.dumps(result, indent=1))
    command = "python -m benchmarks " + shlex.join(sys.argv[1:] if argv is None else argv)
    if not args.report_only and args.s3:
        save, steps, _ = suite.train(suite.SIZES[args.s3], args.workdir / args.s3 / "train", args.saves, args.interval)
        for ms in (float(v) for v in args.s3_latency.split(",")):
            s3_run = suite.measure_s3(save, steps[: args.s3_saves], args.workdir / "s3", args.repeats, ms / 1000)
            s3_run |= {
                "size": args.s3, "command": command, "measured_at": dt.datetime.now().isoformat(timespec="seconds")
            }  # fmt: skip
            (args.workdir / s3_file_name(ms)).write_text(json.dumps(s3_run, indent=1))
    if not args.report_only and not (args.workdir / "merge-scaling.json").exists():
        scaling_run = suite.merge_scaling(args.workdir / "merge-scaling")
        (args.workdir / "merge-scaling.json").write_text(json.dumps(scaling_run, indent=1))
    if not args.report_only and not args.skip_quality and not (args.workdir / "quality.json").exists():
        quality_run = {**suite.quality(args.workdir / "quality"), "command": command}
        (args.workdir / "quality.json").write_text(json.dumps(quality_run, indent=1))
    results = {
        p.stem.removeprefix("result-"): json.loads(p.read_text()) for p in sorted(args.workdir.glob("result-*.json"))
    }
    quality_file = args.workdir / "quality.json"
    quality = json.loads(quality_file.read_text()) if quality_file.exists() else None
    scaling_file = args.workdir / "merge-scaling.json"
    scaling = json.loads(scaling_file.read_text()) if scaling_file.exists() else None
    s3 = [json.loads(f.read_text()) for f in sorted(args.workdir.glob("s3*.json"), key=lambda f: len(f.name))]
    previous = args.out.read_text() if args.out.exists() else ""
    args.out.write_text(with_kept_sections(render(results, quality, scaling, s3), previous))
    print(f"wrote {args.out}")

    return 0


if __name__ == "__main__":
    sys.exit(main())
