"""The measurements: commit and checkout against cp -r + sync, store size against raw and
against plain zstd-1 and zipnn, peak RSS, log/show on 1,000 steps, merge cost.

Everything of one size is measured side by side in one run, alternating which side goes
first, and every time and RSS cell is the median of ``repeats`` runs.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tailorstore
from tailorstore.access.contents import Contents
from tailorstore.curate.merge import merge
from tailorstore.formats.layout import detect
from tailorstore.formats.reader import read_checkpoint
from tailorstore.store import codec
from tailorstore.store.repo import Repository
from testbed.folders import dir_bytes
from testbed.runs import train_tiny


@dataclass(frozen=True)
class Size:
    name: str
    dim: int
    layers: int
    hidden: int
    vocab: int
    heads: int


SIZES = {
    "small": Size("small", 256, 4, 688, 8000, 4),
    "mid": Size("mid", 384, 6, 1024, 16000, 6),  # 23M parameters: the "save of about 300 MB"
    "medium": Size("medium", 512, 8, 1376, 32000, 8),
    "large": Size("large", 640, 12, 1728, 32000, 10),
    "xl": Size("xl", 1024, 24, 2816, 32000, 16),  # 374M: the device check's model, 5.2 GB a save
}


def params_of(size: Size) -> int:
    block = 4 * size.dim * size.dim + 3 * size.dim * size.hidden + 2 * size.dim
    return 2 * size.vocab * size.dim + size.layers * block + size.dim


def measured(cmd: list[str]) -> tuple[float, int, dict]:
    """Run a process; (wall seconds, ru_maxrss of that process in bytes, its JSON output if any).

    Output goes to files, not pipes: wait4 reads nothing until the end, and a process that
    prints more than a pipe holds (gc's JSON plan) would block on its write forever."""
    with tempfile.TemporaryFile() as stdout, tempfile.TemporaryFile() as stderr:
        began = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=stdout, stderr=stderr)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - began
        proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait again
        stdout.seek(0)
        stderr.seek(0)
        out, err = stdout.read().decode(), stderr.read().decode()
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {err[-2000:]}")
    lines = [line for line in out.splitlines() if line.startswith("{")]
    return wall, usage.ru_maxrss * 1024, json.loads(lines[-1]) if lines else {}


def copy_and_sync(src: Path, dst: Path) -> float:
    began = time.perf_counter()
    subprocess.run(["cp", "-r", str(src), str(dst)], check=True)
    subprocess.run(["sync"], check=True)
    return time.perf_counter() - began


def warm(path: Path) -> None:
    """Read every file once, so that its pages are in the page cache, as right after a save.

    On a VM whose idle page cache the host reclaims, a save written minutes ago reads back from
    disk at 0.5 GB/s; whichever side went first would pay for both. Both sides start warm.
    """
    buf = bytearray(16 << 20)
    for p in sorted(path.rglob("*")):
        if p.is_file():
            with open(p, "rb", buffering=0) as f:
                while f.readinto(buf):
                    pass


DROP_CACHES = Path("/proc/sys/vm/drop_caches")


def drop_caches() -> bool:
    """Write dirty pages out and empty the page cache, so that the next reader starts from disk.

    Needs root; returns False where the kernel refuses (the cold rows are then left out)."""
    os.sync()
    try:
        DROP_CACHES.write_text("3\n")
    except OSError:
        return False
    return True


def largest_file(path: Path) -> int:
    return max(p.stat().st_size for p in path.rglob("*") if p.is_file())


def train(size: Size, work: Path, saves: int, interval: int) -> tuple[Path, list[int], float]:
    save = work / "save"
    if (work / "trained.json").exists():
        info = json.loads((work / "trained.json").read_text())
        return save, info["steps"], info["seconds"]
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    began = time.perf_counter()
    train_tiny(
        save,
        losses_out=work / "losses.json",
        steps=saves * interval,
        save_every=interval,
        stage=2,
        dtype="bf16",
        dim=size.dim,
        layers=size.layers,
        hidden=size.hidden,
        vocab=size.vocab,
        heads=size.heads,
        seq=64,
        micro_batch=2,
        lr=1e-3,
    )
    seconds = time.perf_counter() - began
    steps = [interval * (i + 1) for i in range(saves)]
    (work / "trained.json").write_text(json.dumps({"steps": steps, "seconds": seconds}))
    return save, steps, seconds


TAILOR = [sys.executable, "-m", "tailorstore.cli.app"]  # what the `tailor` script runs


def measure_io(save: Path, steps: list[int], work: Path, repeats: int) -> dict:
    """Commit the series into a fresh store per repeat; checkout each step; cp -r + sync each.

    The warm pair starts with the save in the page cache, as right after it was written; the
    store's blobs are read around the page cache, so checkout reads them from disk either way.
    The cold pair (where the kernel lets us drop the page cache) is the restore a user does
    later: both `cp -r` + `sync` of the save and `tailor checkout` start with nothing cached."""
    rows: dict[str, list[list[float]]] = defaultdict(lambda: [[] for _ in steps])
    store = work / "store"
    for rep in range(repeats):
        for path in (store, work / "copies", work / "checkouts"):
            shutil.rmtree(path, ignore_errors=True)
        (work / "copies").mkdir()
        (work / "checkouts").mkdir()
        Repository.init(store).close()
        for i, step in enumerate(steps):
            tag_dir = save / f"global_step{step}"
            copy_first = (rep + i) % 2 == 0
            if copy_first:
                warm(tag_dir)
                rows["copy"][i].append(copy_and_sync(tag_dir, work / "copies" / f"c{step}"))
            warm(tag_dir)
            wall, rss, out = measured([*TAILOR, "commit", str(tag_dir), "--store", str(store), "--json"])
            rows["commit"][i].append(wall)  # the whole `tailor commit` process, start-up included
            rows["commit_library"][i].append(out["seconds"])
            rows["commit_rss"][i].append(rss)
            if not copy_first:
                warm(tag_dir)
                rows["copy"][i].append(copy_and_sync(tag_dir, work / "copies" / f"c{step}"))
            checkout = [*TAILOR, "checkout", f"step={step}", "--out", str(work / "checkouts" / f"o{step}"), "--store",
                        str(store), "--json"]  # fmt: skip
            wall, rss, out2 = measured(checkout)
            rows["checkout"][i].append(wall)
            rows["checkout_library"][i].append(out2["seconds"])
            rows["checkout_rss"][i].append(rss)
            shutil.rmtree(work / "copies" / f"c{step}")
            shutil.rmtree(work / "checkouts" / f"o{step}")
            for way in ("copy", "checkout") if copy_first else ("checkout", "copy"):
                # Restoring from disk: nothing cached on either side (the save, the store, Python's own files).
                if not drop_caches():
                    break
                if way == "copy":
                    rows["copy_cold"][i].append(copy_and_sync(tag_dir, work / "copies" / f"c{step}"))
                else:
                    wall, _, out3 = measured(checkout)
                    rows["checkout_cold"][i].append(wall)
                    rows["checkout_cold_library"][i].append(out3["seconds"])
            shutil.rmtree(work / "copies" / f"c{step}", ignore_errors=True)
            shutil.rmtree(work / "checkouts" / f"o{step}", ignore_errors=True)
    med = {k: [statistics.median(v) for v in per_step] for k, per_step in rows.items() if all(per_step)}
    return {
        "per_step": med,
        "raw_step_bytes": [dir_bytes(save / f"global_step{s}") for s in steps],
        "largest_file": max(largest_file(save / f"global_step{s}") for s in steps),
        "store_bytes": sum(dir_bytes(store / sub) for sub in ("blobs", "packs", "manifests"))
        + sum(p.stat().st_size for p in store.glob("index.sqlite*")),
    }


def store_by_kind(store_root: Path) -> dict:
    """Raw, derived and stored bytes by atom kind, as ``Store.usage()`` reports them: each blob
    counted once, under the first kind that uses it; skeletons and whole files apart."""
    from tailorstore import Store

    with Store.open(store_root) as store:
        found = store.usage()
    out = {
        k: {"raw": u.raw_bytes, "derived": u.derived_bytes, "stored": u.stored_bytes}
        for k, u in found.atom_kinds.items()
    }
    out["skeletons and whole files"] = {"raw": 0, "derived": 0, "stored": found.kinds["files"].stored_bytes}
    return out


def codec_comparison(save: Path, steps: list[int]) -> dict:
    """Per tensor kind: raw bytes, and the bytes of ours, plain zstd-1 and zipnn, tensor by tensor."""
    import zipnn
    import zstandard

    zstd1 = zstandard.ZstdCompressor(level=1)
    zipnns: dict[str, object] = {}
    totals: dict[str, dict[str, int]] = defaultdict(lambda: {"raw": 0, "ours": 0, "zstd1": 0, "zipnn": 0})
    for step in steps:
        for f in read_checkpoint(detect(save / f"global_step{step}")):
            src = f.open()
            for entry in f.entries:
                size = entry.tensor.element_size()
                for seg in entry.segments:
                    if seg.numel * size < 4096 or ".padding" in seg.kind or seg.kind == "step":
                        continue
                    piece = f.piece(src, entry, seg)
                    kind = seg.kind
                    t = totals[kind]
                    t["raw"] += len(piece)
                    t["ours"] += encoded_size(piece, size, entry.tensor.is_floating_point())
                    t["zstd1"] += len(zstd1.compress(piece))
                    name = entry.dtype_name
                    if name not in zipnns:
                        zipnns[name] = zipnn.ZipNN(input_format="byte", bytearray_dtype=name)
                    t["zipnn"] += len(zipnns[name].compress(bytes(piece)))  # type: ignore[attr-defined]
            src.close()
    return dict(totals)


def encoded_size(piece: memoryview, itemsize: int, is_float: bool) -> int:
    return sum(len(chunk) for chunk in codec.encode(piece, itemsize=itemsize, is_float=is_float))


def codec_speeds(save: Path, step: int, repeats: int = 3) -> dict:
    """The codec choice: ratio and speed of the candidates on one save's FP32 optimizer state.

    Each candidate compresses the same flat tensors in 8 MiB pieces, one thread and then a pool
    of two (as the commit pipeline runs), and decompresses them into a reused buffer.
    """
    from concurrent.futures import ThreadPoolExecutor

    import blosc2
    import numpy as np

    from tailorstore.core.host_memory import reuse_freed_memory

    reuse_freed_memory()
    blosc2.set_releasegil(True)
    pieces: list[memoryview] = []
    for f in read_checkpoint(detect(save / f"global_step{step}")):
        with f.open() as src:
            for entry in f.entries:
                if entry.dtype_name == "float32" and entry.tensor.numel() > (1 << 20):
                    nbytes = entry.tensor.numel() * 4
                    flat = src.read(entry.file_offset or 0, nbytes)
                    pieces += [flat[i : i + (8 << 20)] for i in range(0, len(flat), 8 << 20)]
    raw = sum(len(p) for p in pieces)

    def ours(piece: memoryview) -> list:
        return list(codec.encode(piece, itemsize=4, is_float=True))  # the chunks, as the writer gets them

    def blosc(piece: memoryview) -> list:
        return [
            blosc2.compress2(
                piece[i : i + codec.GROUP_CHUNK],
                typesize=4,
                clevel=1,
                codec=blosc2.Codec.ZSTD,
                filters=[blosc2.Filter.SHUFFLE],
                splitmode=blosc2.SplitMode.ALWAYS_SPLIT,
                nthreads=1,
            )
            for i in range(0, len(piece), codec.GROUP_CHUNK)
        ]

    zstd1 = threading_local_zstd()

    def plain(piece: memoryview) -> list:
        return [zstd1().compress(piece)]

    out: dict[str, dict[str, float]] = {}
    buf = np.empty(8 << 20, dtype=np.uint8)
    for name, encode, descriptor in (
        ("bytegroup-zstd (ours)", ours, '{"id": "bytegroup-zstd", "v": 1, "typesize": 4, "level": 1}'),
        ("blosc2 SHUFFLE + ZSTD level 1, GIL released", blosc, '{"id": "blosc2-shuffle-zstd", "v": 1}'),
        ("zstd-1, no grouping", plain, '{"id": "zstd", "v": 1}'),
    ):
        one, two, dec = [], [], []
        for _ in range(repeats):
            began = time.perf_counter()
            stored = sum(len(c) for p in pieces for c in encode(p))
            one.append(time.perf_counter() - began)
            with ThreadPoolExecutor(2) as pool:
                began = time.perf_counter()
                list(pool.map(lambda p, encode=encode: sum(len(c) for c in encode(p)), pieces))
                two.append(time.perf_counter() - began)
            payloads = [b"".join(bytes(c) for c in encode(p)) for p in pieces]  # untimed
            began = time.perf_counter()
            for p, payload in zip(pieces, payloads, strict=True):
                codec.decode_into(descriptor, io.BytesIO(payload), memoryview(buf)[: len(p)], "bench")
            dec.append(time.perf_counter() - began)
        out[name] = {
            "ratio": raw / stored,
            "encode_1": raw / statistics.median(one) / 1e9,
            "encode_2": raw / statistics.median(two) / 1e9,
            "decode_1": raw / statistics.median(dec) / 1e9,
            "raw_bytes": raw,
        }
    return out


def threading_local_zstd() -> Callable[[], Any]:
    """A zstd-1 compressor per thread (zstandard's objects are not safe to share)."""
    import threading

    import zstandard

    local = threading.local()

    def get() -> zstandard.ZstdCompressor:
        if not hasattr(local, "c"):
            local.c = zstandard.ZstdCompressor(level=1, write_content_size=True)
        return local.c

    return get


def io_paths(work: Path, size: int = 512 << 20, repeats: int = 3) -> dict:
    """Moving new bytes to and from the disk: writing durably through the page cache (write + fsync)
    against O_DIRECT, reading with O_DIRECT (as checkout reads blobs, which are never in the page
    cache), and reading one file while writing another (as checkout does): what any checkout of
    bytes not cached must spend, whatever its code."""
    import mmap as mmap_module
    import threading

    from tailorstore.store.backends.direct_io import BLOCK, DirectReader, SequentialWriter

    work.mkdir(parents=True, exist_ok=True)
    block = mmap_module.mmap(-1, BLOCK)
    block.write(os.urandom(BLOCK))
    view = memoryview(block)

    def write_direct(path: Path) -> None:
        out = SequentialWriter(path)
        for _ in range(size // BLOCK):
            out.write(view)
        out.close()
        fd = os.open(path, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)

    def read_direct(path: Path) -> None:
        sink = bytearray(BLOCK)
        reader = DirectReader(path)
        try:
            while reader.readinto(sink):
                pass
        finally:
            reader.close()

    times: dict[str, list[float]] = {"buffered": [], "direct": [], "direct_read": [], "read_and_write": []}
    for rep in range(repeats):
        for mode in ("buffered", "direct") if rep % 2 == 0 else ("direct", "buffered"):
            path = work / f"io-{mode}-{rep}"
            began = time.perf_counter()
            if mode == "buffered":
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                for _ in range(size // BLOCK):
                    os.write(fd, view)
                os.fsync(fd)
                os.close(fd)
            else:
                write_direct(path)
            times[mode].append(time.perf_counter() - began)
        drop_caches()  # the buffered file's pages too: both reads below come from the disk
        began = time.perf_counter()
        read_direct(work / f"io-direct-{rep}")
        times["direct_read"].append(time.perf_counter() - began)
        began = time.perf_counter()
        reading = threading.Thread(target=read_direct, args=(work / f"io-buffered-{rep}",))
        reading.start()
        write_direct(work / f"io-both-{rep}")
        reading.join()
        times["read_and_write"].append(time.perf_counter() - began)
        for p in work.glob("io-*"):
            p.unlink()
    # read_and_write moves twice the bytes (one file read, one written) in the time it reports
    rates = {mode: size / statistics.median(t) / 1e9 for mode, t in times.items()}
    return rates | {"read_and_write": 2 * rates["read_and_write"], "bytes": size}


def build_thousand(store_root: Path, target: Path, count: int = 1000) -> Path:
    """A store whose index holds ``count`` manifests, made by copying real manifest rows.

    This fabricates a fixture by writing SQLite directly: no operation of the library makes a
    thousand manifests without a thousand saves to commit. It is the benchmarks' only use of
    the index's tables; everything they measure goes through the API and the CLI."""
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir(parents=True)
    shutil.copy(store_root / "index.sqlite", target / "index.sqlite")
    (target / "blobs").mkdir()
    (target / "tmp").mkdir()
    conn = sqlite3.connect(target / "index.sqlite")
    conn.execute("PRAGMA journal_mode=WAL")
    first = conn.execute("SELECT id, step FROM manifests ORDER BY step LIMIT 1").fetchone()
    have = conn.execute("SELECT count(*) FROM manifests").fetchone()[0]
    top = conn.execute("SELECT max(step) FROM manifests").fetchone()[0]
    conn.execute("BEGIN")
    for i in range(count - have):
        step = top + 1 + i
        new = conn.execute(
            "INSERT INTO manifests(step, origin, created_at, layout, ds_tag, zero_stage, world_size, policy,"
            " exact, raw_bytes, new_bytes, source) SELECT ?, origin, created_at, layout, ds_tag, zero_stage,"
            " world_size, policy, exact, raw_bytes, new_bytes, source FROM manifests WHERE id=?",
            (step, first[0]),
        ).lastrowid
        conn.execute(
            "INSERT INTO files SELECT ?, path, file_key, kind, rank, blob, raw_size, mode, trusted, container"
            " FROM files WHERE manifest=?",
            (new, first[0]),
        )
        conn.execute(
            "INSERT INTO atoms SELECT ?, path, slot, offset, numel, dtype, shape, param, kind, rank, start,"
            " nbytes, layer, blob, derived, file_offset FROM atoms WHERE manifest=?",
            (new, first[0]),
        )
        conn.execute(
            "INSERT INTO layers SELECT ?, layer, ?, ?, raw_bytes, stored, change FROM layers WHERE manifest=?",
            (new, new, step, first[0]),
        )
    conn.execute("COMMIT")
    conn.close()
    for sub in ("manifests", "refs"):  # the objects of the real manifests; the copies get theirs below
        if (store_root / sub).is_dir():
            shutil.copytree(store_root / sub, target / sub)
    (target / "tailorstore.json").write_bytes((store_root / "tailorstore.json").read_bytes())
    Repository.open(target).close()  # writes the copies' manifest objects, as a store of 1,000 commits has them
    return target


def time_cli(args: list[str], store: Path, repeats: int) -> float:
    env = dict(os.environ, TAILOR_STORE=str(store))
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        subprocess.run(["tailor", *args], env=env, check=True, capture_output=True)
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def time_merge(store_root: Path, steps: list[int], layers: int, repeats: int) -> float:
    spec = store_root.parent / "merge.yaml"
    third = max(1, layers // 3)
    spec.write_text(
        f"base: {{step: {steps[-1]}}}\nslices:\n"
        f"  - sources: [{{step: {steps[0]}, layer_range: [0, {third}]}}]\n"
        f"  - sources: [{{step: {steps[1]}, layer_range: [{third}, {2 * third}]}}]\n"
        f"  - sources: [{{step: {steps[-1]}, layer_range: [{2 * third}, {layers}]}}]\n"
        f"norm: {{step: {steps[1]}}}\n"
    )
    times = []
    with Repository.open(store_root) as store:
        for i in range(repeats):
            times.append(merge(store, spec, f"bench-merge-{time.time_ns()}-{i}").seconds)
    return statistics.median(times)


def quality(work: Path) -> dict:
    """The parity composite's quality check: 20 more steps from a parity composite and from the exact checkpoint."""
    from tailorstore.core.policies import PolicySpec
    from tailorstore.ingest.commit import CommitOptions, commit_checkpoint
    from tailorstore.restore.checkout import checkout_step

    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    model = {"stage": 2, "dtype": "bf16", "layers": 6}
    train_tiny(work / "save", losses_out=work / "losses.json", steps=18, save_every=3, **model)
    store = Repository.init(work / "store")
    for step in range(3, 19, 3):
        view = work / f"at{step}"
        shutil.copytree(
            work / "save",
            view,
            ignore=shutil.ignore_patterns(*[f"global_step{s}" for s in range(3, 19, 3) if s != step]),
        )
        (view / "latest").write_text(f"global_step{step}")
        commit_checkpoint(store, view, CommitOptions(policy=PolicySpec("parity")))
    checkout_step(store, "step=18", work / "composite")
    composite = train_tiny(
        work / "r1", losses_out=work / "r1.json", resume_from=work / "composite", steps=38, save_every=0, **model
    )
    exact = train_tiny(
        work / "r2", losses_out=work / "r2.json", resume_from=work / "at18", steps=38, save_every=0, **model
    )
    with tailorstore.Store.open(store.root) as api:
        inherited = sum(layer.source_step != 18 for layer in api.show(18).layers)
    return {
        "composite_final_loss": float.fromhex(composite[38]),
        "exact_final_loss": float.fromhex(exact[38]),
        "inherited_layers": inherited,
    }


def merge_scaling(work: Path, repeats: int = 5) -> list[dict]:
    """Merge time on two models of the same structure (4 blocks) and 16x different bytes."""
    out = []
    for name, dim, vocab, hidden in (("narrow", 64, 512, 172), ("wide", 512, 32000, 1376)):
        base = work / name
        shutil.rmtree(base, ignore_errors=True)
        base.mkdir(parents=True)
        train_tiny(
            base / "save",
            losses_out=base / "losses.json",
            steps=3,
            save_every=1,
            stage=2,
            dtype="bf16",
            dim=dim,
            vocab=vocab,
            hidden=hidden,
            layers=4,
            heads=4,
        )
        store = Repository.init(base / "store")
        from tailorstore.ingest.commit import commit_checkpoint

        for step in (1, 2, 3):
            view = base / f"at{step}"
            shutil.copytree(
                base / "save", view, ignore=shutil.ignore_patterns(*[f"global_step{s}" for s in (1, 2, 3) if s != step])
            )
            (view / "latest").write_text(f"global_step{step}")
            commit_checkpoint(store, view)
        store.close()
        with tailorstore.Store.open(base / "store") as api:
            steps = api.log()
            raw = sum(s.raw_bytes for s in steps) // len(steps)
            rows = len(
                api.repo.view(Contents).atoms(api.repo.resolve(f"step={steps[0].step}"))
            )  # the rows a merge copies
        out.append(
            {
                "model": name,
                "raw_bytes_per_step": raw,
                "atom_rows_per_step": rows,
                "merge_seconds": time_merge(base / "store", [1, 2, 3], 4, repeats),
            }
        )
    return out


def measure_s3(save: Path, steps: list[int], work: Path, repeats: int, latency: float = 0.0) -> dict:
    """Against a local S3 server (moto, 127.0.0.1), through a relay that counts bytes each way
    and the requests, and holds each request back by ``latency`` seconds (a real endpoint's
    first-byte latency): `tailor commit` against uploading the same files with obstore,
    `tailor checkout` against downloading them. Every figure is a whole process; the server is
    the same for both."""
    from testbed.local_s3 import CuttableLink, local_s3  # boto3 and moto: here only (a GPU node has neither)

    rows: dict[str, list[list[float]]] = defaultdict(lambda: [[] for _ in steps])
    whole: dict[str, list[float]] = defaultdict(list)  # operations on the whole store, once per repeat
    with local_s3() as server:
        link = CuttableLink(server.port, delay=latency)
        for rep in range(repeats):
            env = {**os.environ, "AWS_ENDPOINT_URL": link.endpoint, "TAILOR_CACHE": str(work / f"s3-cache-{rep}")}
            location = server.new_location()
            subprocess.run([*TAILOR, "init", location], env=env, check=True, capture_output=True)
            for i, step in enumerate(steps):
                tag_dir = save / f"global_step{step}"
                for name, cmd in (
                    (
                        "upload",
                        [sys.executable, "-m", "benchmarks.s3_copy", "up", str(tag_dir), f"{location}-raw/{step}"],
                    ),
                    ("commit", [*TAILOR, "commit", str(tag_dir), "--store", location, "--quiet"]),
                ):
                    warm(tag_dir)
                    link.reset_counts()
                    rows[name][i].append(timed(cmd, env))
                    rows[f"{name}_sent"][i].append(link.sent)
                    rows[f"{name}_received"][i].append(link.received)
                    rows[f"{name}_requests"][i].append(sum(link.requests.values()))
                for name, cmd in (
                    ("download", [sys.executable, "-m", "benchmarks.s3_copy", "down", f"{location}-raw/{step}",
                                  str(work / "s3-down" / f"d{step}")]),
                    ("checkout", [*TAILOR, "checkout", f"step={step}", "--out", str(work / "s3-out" / f"o{step}"),
                                  "--store", location, "--quiet"]),
                ):  # fmt: skip
                    link.reset_counts()
                    rows[name][i].append(timed(cmd, env))
                    rows[f"{name}_sent"][i].append(link.sent)
                    rows[f"{name}_received"][i].append(link.received)
                    rows[f"{name}_requests"][i].append(sum(link.requests.values()))
                shutil.rmtree(work / "s3-down", ignore_errors=True)
                shutil.rmtree(work / "s3-out", ignore_errors=True)
            # what runs over the whole store: the checks, then a gc that drops all but the last step
            for name, args in (
                ("verify", ["verify"]),
                ("verify_deep", ["verify", "--deep"]),
                ("gc", ["gc", "--keep-last", "1"]),
            ):
                link.reset_counts()
                whole[name].append(timed([*TAILOR, *args, "--store", location], env))
                whole[f"{name}_requests"].append(sum(link.requests.values()))
    med = {k: [statistics.median(v) for v in per_step] for k, per_step in rows.items()}
    raw = [dir_bytes(save / f"global_step{s}") for s in steps]
    return {
        "steps": steps,
        "per_step": med,
        "store_ops": {k: statistics.median(v) for k, v in whole.items()},
        "raw_step_bytes": raw,
        "latency_ms": latency * 1000,
    }


def timed(cmd: list[str], env: dict[str, str]) -> float:
    began = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {proc.stderr[-2000:]}")
    return time.perf_counter() - began
