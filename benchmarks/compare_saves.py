"""Two tag folders, byte for byte, and where they differ: ``python -m benchmarks.compare_saves A B``.

The device check saves the same training three ways (plain DeepSpeed, ``attach`` with the
snapshot, ``attach`` without it) and checks the stored steps out again; this says whether each
file equals the plain save's. Where a file differs it names the zip records that differ and,
for a pickle, the first lines of its disassembly that differ, so one run shows the cause.
Prints JSON; exits 1 when any file differs.
"""

from __future__ import annotations

import argparse
import difflib
import io
import json
import pickletools
import sys
import zipfile
from pathlib import Path


def records(path: Path) -> dict[str, bytes]:
    with zipfile.ZipFile(path) as zf:
        return {info.filename: zf.read(info) for info in zf.infolist()}


def disassembled(data: bytes) -> list[str]:
    out = io.StringIO()
    try:
        pickletools.dis(data, out=out, annotate=0)
    except Exception as exc:  # a pickle pickletools cannot follow: say so, compare the rest
        out.write(f"(pickletools stopped: {exc})\n")
    # drop the byte offsets, which move with any earlier difference
    return [line.split(":", 1)[-1].strip() for line in out.getvalue().splitlines()]


def explain(a: Path, b: Path, lines: int) -> dict:
    try:
        ra, rb = records(a), records(b)
    except zipfile.BadZipFile:
        return {"zip": False}
    found: dict = {
        "only_in_first": sorted(set(ra) - set(rb))[:20],
        "only_in_second": sorted(set(rb) - set(ra))[:20],
        "records_differ": [],
    }
    for name in sorted(set(ra) & set(rb)):
        if ra[name] == rb[name]:
            continue
        entry: dict = {"record": name, "sizes": [len(ra[name]), len(rb[name])]}
        if name.endswith(".pkl"):
            diff = difflib.unified_diff(disassembled(ra[name]), disassembled(rb[name]), lineterm="", n=1)
            entry["pickle_diff"] = list(diff)[:lines]
        found["records_differ"].append(entry)
    found["records_differ"] = found["records_differ"][:20]
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("first", type=Path)
    parser.add_argument("second", type=Path)
    parser.add_argument("--lines", type=int, default=60)
    args = parser.parse_args()
    names = sorted({p.relative_to(root).as_posix() for root in (args.first, args.second)
                    for p in root.rglob("*") if p.is_file()})  # fmt: skip
    report: dict = {"files": {}}
    same = True
    for name in names:
        a, b = args.first / name, args.second / name
        if not (a.is_file() and b.is_file()):
            report["files"][name] = {"missing_in": str(args.second if a.is_file() else args.first)}
            same = False
            continue
        da, db = a.read_bytes(), b.read_bytes()
        if da == db:
            report["files"][name] = {"identical": True, "bytes": len(da)}
            continue
        same = False
        report["files"][name] = {"identical": False, "bytes": [len(da), len(db)], **explain(a, b, args.lines)}
    report["identical"] = same
    print(json.dumps(report, indent=1))
    sys.exit(0 if same else 1)


if __name__ == "__main__":
    main()
