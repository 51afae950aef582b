"""core/local_files: the one way a local file someone else may write to is opened.

Random trees of files, folders, FIFOs and links (relative, absolute, dangling, out of the folder,
to devices) are opened beneath a folder and compared with what the kernel's own look-up finds;
the modules that read inputs or write into save, staging and output folders are pinned, by
their syntax trees, to open no such file any other way.
"""

from __future__ import annotations

import ast
import errno
import os
import stat
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tailorstore.core.local_files import (
    Beneath,
    LeadsOutside,
    NotRegularFile,
    TooLarge,
    open_input,
    read_small,
    write_atomic,
    write_new,
)
from tests.conftest import REPO_ROOT, TEST_DATA

NAMES = ["a", "b", "c", "d"]
REFUSALS = (LeadsOutside, NotRegularFile, FileNotFoundError, NotADirectoryError)

# An entry of a random tree: where it goes (a path of NAMES below the folder) and what it is.
_where = st.lists(st.sampled_from(NAMES), min_size=1, max_size=3).map("/".join)
_link_target = st.one_of(
    st.tuples(  # some steps up, then names: of the tree, or of what lies beside and above it
        st.integers(0, 3), st.lists(st.sampled_from([*NAMES, "..", ".", "outside", "secret", "top"]), max_size=3)
    ).map(lambda t: "/".join([".."] * t[0] + t[1]) or "."),
    st.sampled_from(["/dev/zero", "/dev/null", "/etc/hostname", "OUTSIDE/secret", "OUTSIDE", "TOP/a", "TOP"]),
    st.sampled_from(["UP/outside/secret", "UP/outside", "UP/top/a", "UP/../top/a/b"]),  # UP: as many ".." as deep
)
_entry = st.tuples(
    _where,
    st.one_of(
        st.just(("file",)),
        st.just(("dir",)),
        st.just(("fifo",)),
        st.tuples(st.just("link"), _link_target),
    ),
)


def _build(top: Path, outside: Path, entries: list) -> None:
    for where, what in entries:
        path = top / where
        if os.path.lexists(path) or _has_link(top, str(Path(where).parent)):
            continue  # the name is taken (a FIFO written to would wait), or the way to it is a link
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            if what[0] == "file":
                path.write_bytes(where.encode())
            elif what[0] == "dir":
                path.mkdir()
            elif what[0] == "fifo":
                os.mkfifo(path)
            else:
                up = "/".join([".."] * (where.count("/") + 1))  # from the link's folder to above the top
                target = what[1].replace("OUTSIDE", str(outside)).replace("TOP", str(top)).replace("UP", up)
                path.symlink_to(target)
        except OSError:
            continue  # the name is taken, or a parent is no folder: the tree is what it is


def _has_link(top: Path, rel: str) -> bool:
    at = top
    for part in Path(rel).parts:
        at = at / part
        if at.is_symlink():
            return True
    return False


@pytest.mark.slow  # seconds: the fast tier keeps its minute
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(entries=st.lists(_entry, max_size=14), probes=st.lists(_where, min_size=1, max_size=6), links=st.booleans())
def test_opening_beneath_a_folder_never_leaves_it_nor_blocks(entries: list, probes: list, links: bool) -> None:
    """Whatever the tree: an open beneath the folder returns a regular file that the kernel's own
    look-up also reaches and that lies inside the folder, or refuses with an OSError; it never
    waits (FIFOs are everywhere) and never reads outside. A plain file reached without links opens."""
    with tempfile.TemporaryDirectory() as base:
        top, outside = Path(base) / "top", Path(base) / "outside"
        top.mkdir()
        outside.mkdir()
        (outside / "secret").write_text("outside")
        _build(top, outside, entries)
        inside = os.path.realpath(top)
        for rel in probes + [where for where, _ in entries]:
            try:
                fd = open_input(Beneath(top, rel, links=links))
            except REFUSALS:
                continue
            except OSError as exc:
                assert exc.errno == errno.ELOOP, exc
                continue
            try:
                got = os.fstat(fd)
                assert stat.S_ISREG(got.st_mode)
                real = os.path.realpath(top / rel)
                assert real.startswith(inside + os.sep), (rel, real)
                kernel = os.stat(real)
                assert (got.st_dev, got.st_ino) == (kernel.st_dev, kernel.st_ino), rel
                assert links or not _has_link(top, rel), rel
            finally:
                os.close(fd)
        for where, what in entries:  # a regular file reached through folders only always opens
            path = top / where
            if what == ("file",) and not _has_link(top, where) and path.is_file() and not path.is_symlink():
                os.close(open_input(Beneath(top, where, links=False)))


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(entries=st.lists(_entry, max_size=10), name=st.sampled_from(NAMES), data=st.binary(max_size=64))
def test_an_atomic_write_lands_in_the_folder_and_nowhere_else(entries: list, name: str, data: bytes) -> None:
    """Links, FIFOs and folders planted anywhere in the folder, its target's name included: the write
    puts a regular file with the data under the name (or fails, where the name is a folder), writes
    through no link, blocks on no FIFO, and leaves no temp file."""
    with tempfile.TemporaryDirectory() as base:
        top, outside = Path(base) / "top", Path(base) / "outside"
        top.mkdir()
        outside.mkdir()
        (outside / "secret").write_text("outside")
        _build(top, outside, [(e[0].split("/")[0], e[1]) for e in entries])
        before = sorted(p.name for p in top.iterdir())
        is_folder = (top / name).is_dir() and not (top / name).is_symlink()
        try:
            write_atomic(top, name, data)
        except OSError:
            assert is_folder
        else:
            assert not is_folder
            assert not (top / name).is_symlink() and (top / name).read_bytes() == data
        assert (outside / "secret").read_text() == "outside"
        assert sorted(p.name for p in top.iterdir()) == sorted(
            set(before) | ({name} - {""} if not is_folder else set())
        )


def test_fifos_devices_and_links_are_refused_at_once(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "zero").symlink_to("/dev/zero")
    (tmp_path / "ok").write_text("x" * 10)
    (tmp_path / "link").symlink_to("ok")
    with pytest.raises(NotRegularFile, match="a named pipe"):
        read_small(Beneath(tmp_path, "fifo"), 100)
    with pytest.raises(NotRegularFile, match="a named pipe"):
        read_small(tmp_path / "fifo", 100)  # a path the user named: links followed, a FIFO still refused
    with pytest.raises(LeadsOutside):
        read_small(Beneath(tmp_path, "zero"), 100)
    with pytest.raises(NotRegularFile, match="a device"):
        read_small(tmp_path / "zero", 100)
    with pytest.raises(NotRegularFile, match="a symbolic link"):
        read_small(Beneath(tmp_path, "link", links=False), 100)
    assert read_small(Beneath(tmp_path, "link"), 100) == b"x" * 10
    assert read_small(Beneath(tmp_path, "ok"), 10) == b"x" * 10
    with pytest.raises(TooLarge):
        read_small(Beneath(tmp_path, "ok"), 9)


def test_a_new_file_is_never_an_existing_entry(tmp_path: Path) -> None:
    (tmp_path / "victim").write_text("must stay")
    (tmp_path / "out").symlink_to(tmp_path / "victim")
    with pytest.raises(FileExistsError):
        write_new(tmp_path / "out", b"x")
    assert (tmp_path / "victim").read_text() == "must stay"
    write_new(tmp_path / "new", b"x")
    assert (tmp_path / "new").read_bytes() == b"x"


# -- the modules that open such files go through core/local_files ---------------------------------

ROOT = REPO_ROOT / "tailorstore"
MIGRATED = [
    "integrations/deepspeed/head.py",
    "formats/source.py",
    "formats/layout.py",
    "formats/small_text.py",
    "formats/reader.py",
    "formats/deepspeed.py",
    "restore/checkout.py",
    "restore/export.py",
    "restore/reshard.py",
    "restore/universal.py",
    "restore/repickle.py",
    "access/output_dir.py",
    "integrations/deepspeed/staging.py",
    "integrations/deepspeed/snapshot.py",
]
PATH_CALLS = {"open", "read_bytes", "read_text", "write_bytes", "write_text"}
# (module, function, call): the opens left outside core/local_files, each for a reason.
EXCEPTIONS: set[tuple[str, str, str]] = set()


def _direct_opens(module: str) -> set[tuple[str, str, str]]:
    """Every call of ``open``/``os.open``/``Path.open``/``read_bytes``/``read_text``/``write_bytes``/
    ``write_text`` in ``module``, as (module, enclosing function, call)."""
    tree = ast.parse((ROOT / module).read_text(encoding="utf-8"))
    found: set[tuple[str, str, str]] = set()

    def visit(node: ast.AST, function: str) -> None:
        for child in ast.iter_child_nodes(node):
            name = function
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                name = child.name
            if isinstance(child, ast.Call):
                func = child.func
                if isinstance(func, ast.Name) and func.id == "open":
                    found.add((module, name, "open"))
                elif isinstance(func, ast.Attribute) and func.attr in PATH_CALLS:
                    receiver = ast.unparse(func.value)
                    if func.attr != "open" or receiver == "os" or not receiver.endswith(("store", "Store")):
                        found.add((module, name, f"{receiver}.{func.attr}"))
            visit(child, name)

    visit(tree, "<module>")
    return found


def test_migrated_modules_open_local_files_only_through_local_files() -> None:
    """A direct open in these modules would follow a link or wait on a FIFO again: each goes through
    core/local_files, and the few that do not are listed, with why, in EXCEPTIONS."""
    found = set().union(*(_direct_opens(m) for m in MIGRATED))
    assert found - EXCEPTIONS == set(), sorted(found - EXCEPTIONS)
    assert EXCEPTIONS - found == set(), f"exceptions that no longer exist: {sorted(EXCEPTIONS - found)}"


def test_the_pin_sees_a_direct_open() -> None:
    """The AST walk itself: it finds each form of direct open, so the pin above can fail."""
    calls = {c for _, _, c in _direct_opens("formats/torch_save_writer.py")}
    assert "open" in calls


# -- the findings: links out of a checkpoint, and entries that are no files -------------------------

DATA = TEST_DATA / "format1" / "checkpoint"


def _checkpoint(kind: str, base: Path) -> tuple[Path, Path]:
    """A small checkpoint of each layout under ``base`` (no training), and the folder inside it
    where an entry can be planted."""
    import shutil

    import torch

    if kind == "plain":
        folder = base / "weights"
        folder.mkdir()
        torch.save({"w": torch.ones(8)}, folder / "model.pt")
        return folder, folder
    if kind == "dcp":
        import torch.distributed.checkpoint as dcp

        dcp.save({"w": torch.ones(8)}, checkpoint_id=str(base / "step-1"))
        return base / "step-1", base / "step-1"
    if kind == "deepspeed-tag":
        shutil.copytree(DATA / "global_step3", base / "global_step3")
        return base / "global_step3", base / "global_step3"
    if kind == "deepspeed":
        shutil.copytree(DATA, base / "ckpt")
        return base / "ckpt", base / "ckpt" / "global_step3"
    folder = base / "checkpoint-1"  # an HF Trainer's folder
    folder.mkdir()
    (folder / "trainer_state.json").write_text('{"global_step": 1}')
    torch.save({"w": torch.ones(8)}, folder / "model.pt")
    return folder, folder


LAYOUTS = ["plain", "dcp", "deepspeed-tag", "deepspeed", "hf"]


@pytest.fixture
def empty_store(tmp_path: Path) -> Path:
    from tests.conftest import tailor_here

    assert tailor_here("init", str(tmp_path / "store")).returncode == 0
    return tmp_path / "store"


@pytest.mark.parametrize("kind", LAYOUTS)
def test_a_link_out_of_the_folder_given_is_refused_for_every_layout(kind: str, tmp_path: Path, empty_store) -> None:
    """Medium 2: the check resolved links against the layout's root, which for a plain torch folder,
    a DCP folder or a DeepSpeed tag folder is the folder's parent: a link to ../secret (an SSH key
    beside the checkpoint) was committed and checked out, exit 0. Now it is refused in one line,
    exit 2, for every layout, and the store is as it was."""
    from tests.conftest import one_line, store_state, tailor_here

    (tmp_path / "ckpts").mkdir()
    given, inner = _checkpoint(kind, tmp_path / "ckpts")
    (tmp_path / "ckpts" / "id_rsa").write_text("PRIVATE KEY")  # beside the checkpoint, in its parent
    up = os.path.relpath(tmp_path / "ckpts" / "id_rsa", inner)
    (inner / "id_rsa.pt").symlink_to(up)
    before = store_state(empty_store)
    one_line(tailor_here("commit", str(given), "--step", "1", store=empty_store), 2, "id_rsa.pt", "leads outside")
    assert store_state(empty_store) == before


@pytest.mark.parametrize("kind", LAYOUTS)
def test_a_link_inside_the_folder_given_is_committed_as_its_file(kind: str, tmp_path: Path, empty_store) -> None:
    """What stays allowed: a link to a file of the checkpoint itself is committed as that file."""
    from tests.conftest import tailor_here

    given, inner = _checkpoint(kind, tmp_path)
    (inner / "notes.txt").write_text("kept")
    (inner / "alias.txt").symlink_to("notes.txt")
    done = tailor_here("commit", str(given), "--step", "1", store=empty_store)
    assert done.returncode == 0, done.stderr
    assert tailor_here("checkout", "step=1", "--out", str(tmp_path / "out"), store=empty_store).returncode == 0
    assert [p.read_text() for p in (tmp_path / "out").rglob("alias.txt")] == ["kept"]


@pytest.mark.parametrize(
    ("kind", "name", "make"),
    [
        ("plain", "pipe", "fifo"),
        ("plain", "zeros.bin", "/dev/zero"),
        ("dcp", "__1_0.distcp", "fifo"),
        ("deepspeed-tag", "zero_pp_rank_1_mp_rank_00_model_states.pt", "fifo"),
        ("deepspeed", "extra.bin", "/dev/zero"),
        ("hf", "rng_state.pth", "fifo"),
    ],
)
def test_an_entry_that_is_no_regular_file_is_refused_naming_it(
    kind: str, name: str, make: str, tmp_path: Path, empty_store
) -> None:
    """Low 3: FIFOs, a link to /dev/zero and a FIFO __1_0.distcp in a checkpoint were skipped
    without a word (a DCP step then lacked a rank's file). Each is refused in one line naming it,
    exit 2, without waiting on the FIFO, and nothing is written."""
    from tests.conftest import one_line, store_state, tailor_here

    given, inner = _checkpoint(kind, tmp_path)
    if make == "fifo":
        os.mkfifo(inner / name)
    else:
        (inner / name).symlink_to(make)
    words = [name, "named pipe" if make == "fifo" else "leads outside"]
    before = store_state(empty_store)
    one_line(tailor_here("commit", str(given), "--step", "1", store=empty_store), 2, *words)
    assert store_state(empty_store) == before


def test_a_link_swapped_in_after_the_check_is_refused_by_the_open(tmp_path: Path) -> None:
    """Medium 2, the race: the check and the open were two look-ups, so a file replaced by a link
    to a secret after the layout was checked was read through it (stored once in 40 tries). Here
    the swap falls exactly between the two: the commit's own open refuses the link."""
    import torch

    from tailorstore import Store
    from tailorstore.core.errors import BadCheckpointError
    from tailorstore.formats.layout import detect
    from tailorstore.ingest.commit import commit_layout
    from tailorstore.ingest.commit_options import CommitOptions
    from tailorstore.store.repo import Repository

    folder = tmp_path / "weights"
    folder.mkdir()
    torch.save({"w": torch.ones(8)}, folder / "model.pt")
    (folder / "notes.txt").write_text("a file of the checkpoint")
    (tmp_path / "id_rsa").write_text("PRIVATE KEY")
    layout = detect(folder)
    (folder / "notes.txt").unlink()
    (folder / "notes.txt").symlink_to("../id_rsa")  # after the check, before the read
    repo = Repository.init(tmp_path / "store")
    try:
        with pytest.raises(BadCheckpointError, match=r"notes\.txt: a symbolic link that leads outside"):
            commit_layout(repo, layout, str(folder), CommitOptions(step=1))
    finally:
        repo.close()
    with Store.open(tmp_path / "store") as store:
        assert store.log() == []
