"""Parts of one step prove they are of one try of the save (FORMAT.md 8.1, I4).

I4 (docs/FORMAT.md 8.1): when two tries' parts shared no file (one host held try 1's rank-0 files,
another try 2's rank-1 optimizer states), finalize recorded one mixed step, and verify said ok.
Each part now carries a try token (``$TAILOR_TRY``, or the save's label every part of the save
begins with), finalize refuses parts of different tokens, and parts with no token must be linked
by shared files, which are then compared tensor by tensor.

The save is the small 2-rank DeepSpeed checkpoint of tests/data, split as two hosts hold it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tailorstore import Store
from tailorstore.core.errors import BadCheckpointError
from tailorstore.core.records import FileRecord
from tailorstore.formats.layout import DCP_FOLDER, HF_TRAINER
from tailorstore.ingest.finalize import _one_try, missing_pieces
from tailorstore.store.parts import Part, try_token
from tests.conftest import CLI, TEST_DATA, one_line

pytestmark = pytest.mark.slow  # several real commits and finalizes per test

CHECKPOINT = TEST_DATA / "format1" / "checkpoint"
RANK1 = "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
MODEL = "mp_rank_00_model_states.pt"


def _hosts(tmp_path: Path) -> tuple[Path, Path]:
    """Host 0: everything but rank 1's optimizer states; host 1: those and the model states they
    are cut by (as node-local storage writes them). Both are of one save: the token alone says
    whether a finalize takes them as one try."""
    zero = shutil.copytree(CHECKPOINT, tmp_path / "host0")
    (zero / "global_step3" / RANK1).unlink()
    one = tmp_path / "host1" / "global_step3"
    one.mkdir(parents=True)
    for name in (RANK1, MODEL):
        shutil.copy2(CHECKPOINT / "global_step3" / name, one / name)
    return zero, one


def _tailor(store: Path, *args: str, attempt: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "TAILOR_STORE": str(store)}
    env.pop("TAILOR_TRY", None)
    if attempt is not None:
        env["TAILOR_TRY"] = attempt
    return subprocess.run([*CLI, *args], capture_output=True, text=True, env=env, timeout=300)


def _store(tmp_path: Path) -> Path:
    store = tmp_path / "store"
    assert _tailor(store, "init", str(store)).returncode == 0
    return store


def test_parts_of_two_tries_that_share_no_file_are_refused(tmp_path: Path) -> None:
    zero, one = _hosts(tmp_path)
    store = _store(tmp_path)
    assert _tailor(store, "commit", str(zero), "--part", attempt="try1").returncode == 0
    assert _tailor(store, "commit", str(one), "--part", attempt="try2").returncode == 0
    one_line(_tailor(store, "finalize", "step=3"), 2, "different tries", "'try1', 'try2'", "--drop-parts")
    assert _tailor(store, "log", "--json").stdout.strip() == "[]"


def _part(source: str, *paths: str, attempt: str = "") -> Part:
    files = [FileRecord(path, path, "raw", None, "0" * 64, 1, 0o644, False, None) for path in paths]
    return Part(3, "deepspeed", "global_step3", {}, source, 0.0, 1, 1, files=files, attempt=attempt)


def test_parts_without_a_token_that_share_no_file_are_refused() -> None:
    """Nothing shows two such parts are of one try (a ZeRO-3 or DCP save's ranks hold files of
    their own): before, two tries' parts of that kind were recorded as one step."""
    rank0 = _part("a:/save", "zero_pp_rank_0_mp_rank_00_model_states.pt", "latest")
    rank1 = _part("b:/save", "zero_pp_rank_1_mp_rank_00_model_states.pt")
    with pytest.raises(BadCheckpointError, match="share no file and carry no try token"):
        _one_try([rank0, rank1], 3, None)
    _one_try([rank0, rank1], 3, "ds.s000003.of2")  # a finalize that chose them by their save's label
    linked = _part("c:/save", "latest", "zero_pp_rank_1_mp_rank_00_model_states.pt")
    _one_try([rank0, rank1, linked], 3, None)  # linked through a third part's shared files
    _one_try([_part("a", "x", attempt="t"), _part("b", "y", attempt="t")], 3, None)  # one token


def test_parts_with_and_without_a_token_are_refused(tmp_path: Path) -> None:
    zero, one = _hosts(tmp_path)
    store = _store(tmp_path)
    assert _tailor(store, "commit", str(zero), "--part", attempt="try1").returncode == 0
    assert _tailor(store, "commit", str(one), "--part").returncode == 0
    one_line(_tailor(store, "finalize", "step=3"), 2, "different tries", "none")


def test_parts_of_one_try_finalize_and_check_out_as_the_save(tmp_path: Path) -> None:
    zero, one = _hosts(tmp_path)
    store = _store(tmp_path)
    assert _tailor(store, "commit", str(zero), "--part", attempt="job-7.try1").returncode == 0
    assert _tailor(store, "commit", str(one), "--part", attempt="job-7.try1").returncode == 0
    done = _tailor(store, "finalize", "step=3")
    assert done.returncode == 0, done.stderr
    out = tmp_path / "out"
    assert _tailor(store, "checkout", "step=3", "--out", str(out)).returncode == 0
    for path in (CHECKPOINT / "global_step3").iterdir():
        assert (out / "global_step3" / path.name).read_bytes() == path.read_bytes(), path.name
    assert _tailor(store, "verify", "--deep").returncode == 0


def test_a_bad_try_token_is_refused_in_one_line(tmp_path: Path) -> None:
    zero, _ = _hosts(tmp_path)
    store = _store(tmp_path)
    one_line(_tailor(store, "commit", str(zero), "--part", attempt="no/slashes"), 2, "TAILOR_TRY")


def test_labelled_parts_carry_their_saves_label_as_token(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The integrations label a member's part SAVE-nRANK: the token is SAVE, so two saves' parts
    are refused even by a finalize that names no label."""
    monkeypatch.delenv("TAILOR_TRY", raising=False)
    assert try_token("ds.s000003.of2-n1") == "ds.s000003.of2"
    assert try_token("dcp.0123abcd") == "dcp.0123abcd" and try_token("") == ""
    zero, one = _hosts(tmp_path)
    with Store.init(tmp_path / "store") as store:
        store.commit(zero, part=True, part_label="save1-n0")
        store.commit(one, part=True, part_label="save2-n1")
        with pytest.raises(BadCheckpointError, match="different tries"):
            store.finalize(3)
        store.commit(one, part=True, part_label="save1-n1")
        store.finalize(3, label="save1")
        assert [s.step for s in store.log()] == [3]


def test_a_dcp_step_left_with_its_metadata_alone_names_its_rank_files() -> None:
    """Low finding 2: a DCP save whose rank parts a concurrent ``gc --drop-parts`` took was refused
    naming DeepSpeed's mp_rank_00_model_states.pt."""
    meta = FileRecord("step-6/.metadata", "step-6/.metadata", "raw", None, "0" * 64, 1, 0o644, False, None)
    for layout in (DCP_FOLDER, HF_TRAINER):
        assert missing_pieces(layout, [meta], 2, None) == ["the .distcp files of rank(s) [0, 1] in step-6"]
        assert missing_pieces(layout, [meta], None, None) == ["every rank's .distcp file in step-6"]
    assert "mp_rank_00" not in " ".join(missing_pieces(DCP_FOLDER, [], None, None))


def test_drop_parts_keeps_a_save_in_flight(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Low finding 2: ``gc --drop-parts`` took the parts of a save still in flight, which then
    failed. A part younger than the safety window ($TAILOR_DROP_PARTS_AFTER, an hour) stays; one
    older goes, as does any part of a step already recorded."""
    zero, _ = _hosts(tmp_path)
    store = _store(tmp_path)
    assert _tailor(store, "commit", str(zero), "--part").returncode == 0
    kept = _tailor(store, "gc", "--drop-parts")
    assert kept.returncode == 0, kept.stderr
    assert len(list((store / "parts").rglob("*.json.zst"))) == 1
    monkeypatch.setenv("TAILOR_DROP_PARTS_AFTER", "0")
    assert _tailor(store, "gc", "--drop-parts").returncode == 0
    assert list((store / "parts").rglob("*.json.zst")) == []
