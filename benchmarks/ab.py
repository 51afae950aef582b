"""Two versions of tailorstore, alternating whole ``tailor`` processes: before and after a change.

``python -m benchmarks.ab TAG_DIR --before TREE [--op commit|checkout] [--repeats 9]`` runs the
same command alternately with the tailorstore of TREE (another checkout of this repository:
``git worktree add /tmp/before COMMIT``) and with this one, each a whole process under
``/usr/bin/time`` (wall, user and system seconds, minor faults, peak RSS). Medians of ``--repeats``.

* ``commit``: the DeepSpeed tag folder TAG_DIR into a fresh store; the input is read once before
  the runs, so both start with it in the page cache.
* ``checkout``: TAG_DIR is committed once (by this version), then checked out into a fresh folder
  of ``--out-dir`` (default ``/dev/shm``, where a resume stages) by each; the store's blobs are read
  once first. The two versions must read the same store format.

On this VM one batch of runs can differ from the next by 20%, so a change is judged only by two
sides that ran in the same batch, alternating.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

# The tree's own command line: an editable install maps ``tailorstore.cli`` to the installed tree's
# ``cli/`` folder whatever the working directory, so the tree's ``cli`` package is put in its place.
RUN = (
    "import sys, tailorstore, cli; sys.modules['tailorstore.cli'] = tailorstore.cli = cli; "
    "from cli.app import run; sys.argv = ['tailor', *sys.argv[1:]]; run()"
)
FIELDS = ("wall", "user", "system", "faults", "rss")


def timed(tree: Path, args: list[str]) -> dict[str, float]:
    """One whole ``tailor`` process with the tailorstore of ``tree`` (its folder first on the path)."""
    with tempfile.NamedTemporaryFile("r", suffix=".time") as out:
        timing = ["/usr/bin/time", "-f", "%e %U %S %R %M", "-o", out.name]
        subprocess.run([*timing, sys.executable, "-c", RUN, *args], cwd=tree, check=True, stdout=subprocess.DEVNULL)
        values = [float(v) for v in out.read().split()[-5:]]
    return dict(zip(FIELDS, values, strict=True)) | {"rss": values[4] * 1024}


def tailor(tree: Path, *args: str) -> None:
    subprocess.run([sys.executable, "-c", RUN, *args], cwd=tree, check=True, stdout=subprocess.DEVNULL)


def timed_commit(tree: Path, tag_dir: Path, store: Path) -> dict[str, float]:
    shutil.rmtree(store, ignore_errors=True)
    tailor(tree, "init", str(store))
    return timed(tree, ["commit", str(tag_dir), "--store", str(store), "--quiet"])


def timed_checkout(tree: Path, store: Path, out: Path) -> dict[str, float]:
    shutil.rmtree(out, ignore_errors=True)
    try:
        return timed(tree, ["checkout", "latest", "--out", str(out), "--store", str(store), "--quiet"])
    finally:
        shutil.rmtree(out, ignore_errors=True)


def read_all(folder: Path) -> None:
    for path in folder.rglob("*"):
        if path.is_file():
            path.read_bytes()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("tag_dir", type=Path)
    parser.add_argument("--before", type=Path, required=True, help="a checkout of the version to compare with")
    parser.add_argument("--op", choices=("commit", "checkout"), default="commit")
    parser.add_argument("--out-dir", type=Path, default=Path("/dev/shm"), help="where checkouts are written")
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    trees = {"before": args.before.resolve(), "after": Path(__file__).resolve().parents[1]}
    for tree in trees.values():
        if not (tree / "tailorstore" / "__init__.py").is_file():
            raise SystemExit(f"{tree}: not a checkout of tailorstore")
    tag_dir = args.tag_dir.resolve()
    read_all(tag_dir)  # the page cache warm for both sides
    work = Path(tempfile.mkdtemp(prefix="tailor-ab-"))
    out = Path(tempfile.mkdtemp(prefix="tailor-ab-", dir=args.out_dir))
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
    try:
        if args.op == "checkout":
            tailor(trees["after"], "init", str(work / "store"))
            tailor(trees["after"], "commit", str(tag_dir), "--store", str(work / "store"), "--quiet")
            read_all(work / "store")
        for _ in range(args.repeats):
            for name, tree in trees.items():
                if args.op == "commit":
                    runs[name].append(timed_commit(tree, tag_dir, work / "store"))
                else:
                    runs[name].append(timed_checkout(tree, work / "store", out / "step"))
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(out, ignore_errors=True)
    report = {
        name: {f: statistics.median(r[f] for r in rows) for f in FIELDS}
        | {"cpu": statistics.median(r["user"] + r["system"] for r in rows)}
        for name, rows in runs.items()
    }
    print(json.dumps({"tag_dir": str(tag_dir), "op": args.op, "repeats": args.repeats, "medians": report}, indent=1))


if __name__ == "__main__":
    main()
