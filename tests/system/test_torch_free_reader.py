"""The torch-free reader (a restricted unpickler over torch.save's zip) describes every file of
real DeepSpeed and HF Trainer saves exactly as the torch loader does: the same tensors, dtypes,
shapes, file offsets, segments and run facts; and a commit made without torch checks out the
same bytes."""

from __future__ import annotations

import pickle
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import tailorstore.formats.reader as reader
from tailorstore import BadCheckpointError, CorruptStoreError, Store, UnsafePickleError
from tailorstore.formats.layout import detect
from tailorstore.formats.source import InputFile
from tailorstore.formats.torch_pickle import read_torch_zip
from tailorstore.store.index.catalogue import Catalogue
from testbed.compare import same_tree
from tests.conftest import HFRun, Runs


def described(path: Path) -> list[tuple]:
    layout = detect(path)
    return [
        (
            f.path,
            f.kind,
            f.located,
            f.meta,
            [(e.path, e.dtype_name, tuple(e.tensor.shape), e.file_offset, e.segments) for e in f.entries],
        )
        for f in reader.read_checkpoint(layout)
    ]


@pytest.mark.parametrize("name", ["zero2-bf16", "zero3-bf16", "zero0-fp32", "zero2-bf16-odd-two-groups"])
def test_torch_free_reader_describes_deepspeed_files_as_torch_does(
    runs: Runs, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    save = runs.get(name).save_dir
    free = described(save)
    monkeypatch.setattr(reader, "read_torch_zip", lambda src, where: None)  # every file through torch
    through_torch = described(save)
    assert [f[0] for f in free] == [f[0] for f in through_torch] and any(f[1] == "torch" for f in free)
    assert free == through_torch


def test_torch_free_reader_describes_an_hf_checkpoint_as_torch_does(
    hf_run: HFRun, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = hf_run.output_dir / "checkpoint-6"
    free = described(folder)
    monkeypatch.setattr(reader, "read_torch_zip", lambda src, where: None)
    assert free == described(folder)


def test_commit_without_torch_checks_out_the_same_bytes(runs: Runs, tmp_path: Path) -> None:
    save = runs.get("zero3-bf16").save_dir
    with Store.init(tmp_path / "store") as store:
        store.commit(save)
        store.checkout("latest", tmp_path / "out")
        assert store.verify(deep=True).ok
    assert same_tree(tmp_path / "out" / "global_step6", save / "global_step6")


class _Boom:
    def __reduce__(self) -> tuple:
        return (print, ("ran",))


def test_a_global_outside_the_allowlist_is_refused_before_it_runs(tmp_path: Path) -> None:
    """A torch.save-shaped zip whose pickle calls builtins.print: refused, naming the global."""
    victim = tmp_path / "evil.pt"
    with zipfile.ZipFile(victim, "w", compression=zipfile.ZIP_STORED) as z:
        z.writestr("archive/data.pkl", pickle.dumps({"x": _Boom()}, protocol=2))
        z.writestr("archive/byteorder", "little")
    with InputFile(victim) as src, pytest.raises(UnsafePickleError, match=r"builtins\.print"):
        read_torch_zip(src, str(victim))


def test_a_pickle_that_asks_for_a_huge_bytearray_is_refused_without_allocating(tmp_path: Path) -> None:
    """bytearray(10**12) in nine bytes of pickle: refused before anything is allocated."""
    victim = tmp_path / "huge.pt"
    data = b"\x80\x02c__builtin__\nbytearray\nq\x00\x8a\x06\x00\x10\xa5\xd4\xe8\x00\x85q\x01Rq\x02."
    with zipfile.ZipFile(victim, "w", compression=zipfile.ZIP_STORED) as z:
        z.writestr("archive/data.pkl", data)
    with InputFile(victim) as src, pytest.raises(BadCheckpointError, match=r"huge\.pt: .*bytearray from a size"):
        read_torch_zip(src, str(victim))


def test_reading_a_save_does_not_import_torch(runs: Runs, tmp_path: Path) -> None:
    probe = (
        "import sys; from pathlib import Path; from tailorstore.formats.layout import detect; "
        "from tailorstore.formats.reader import read_checkpoint; "
        f"files = list(read_checkpoint(detect(Path({str(runs.get('zero2-bf16').save_dir)!r})))); "
        "print(len(files), 'torch' in sys.modules, 'deepspeed' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout.split()
    assert out[1:] == ["False", "False"] and int(out[0]) >= 3


def test_tree_objects_views_and_what_falls_back_to_torch(tmp_path: Path) -> None:
    """Protocol-2 names (sets, bytes), torch.Size and a view into a shared storage read without torch;
    a non-contiguous tensor or a dtype it does not cut sends the file to torch (None)."""
    import torch

    base = torch.arange(12, dtype=torch.bfloat16)
    plain = tmp_path / "plain.pt"
    torch.save({"s": {1, 2}, "b": b"\x00\x01", "size": torch.Size([3, 4]), "view": base[4:10], "all": base}, plain)
    with InputFile(plain) as src:
        parsed = read_torch_zip(src, str(plain))
        assert parsed is not None
        tree, _record = parsed
        assert tree["s"] == {1, 2} and tree["b"] == b"\x00\x01" and tree["size"] == (3, 4)
        view, whole = tree["view"], tree["all"]
        assert (view.dtype, view.shape, whole.shape) == ("bfloat16", (6,), (12,))
        assert view.file_offset == whole.file_offset + 4 * 2
        assert bytes(src.read(view.file_offset, 12)) == base[4:10].view(torch.int16).numpy().tobytes()
    for name, obj in (("strided", base[::2]), ("complex", torch.zeros(2, dtype=torch.complex64))):
        path = tmp_path / f"{name}.pt"
        torch.save({"t": obj}, path)
        with InputFile(path) as src:
            assert read_torch_zip(src, str(path)) is None, name


MEMO_BOMB = b"\x80\x02K\x01r\x00\x00\x00\x10."  # LONG_BINPUT into memo slot 2**28: ten bytes


def test_a_pickle_naming_a_far_memo_slot_is_refused_without_allocating(tmp_path: Path) -> None:
    """Regression: the C unpickler grows its memo to the slot a pickle names, so ten
    bytes made it zero-fill 4.2 GB, as a ``.pt``'s data.pkl or as DCP ``.metadata``. Refused first,
    in a process whose peak memory stays small."""
    victim = tmp_path / "bomb.pt"
    with zipfile.ZipFile(victim, "w", compression=zipfile.ZIP_STORED) as z:
        z.writestr("archive/data.pkl", MEMO_BOMB)
    probe = (
        "import resource, sys\n"
        "from pathlib import Path\n"
        "from tailorstore import BadCheckpointError\n"
        "from tailorstore.formats.source import InputFile\n"
        "from tailorstore.formats.torch_pickle import read_torch_zip\n"
        "from tailorstore.formats.dcp import read_metadata\n"
        "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "said = []\n"
        "try:\n"
        f"    with InputFile(Path({str(victim)!r})) as src: read_torch_zip(src, 'bomb.pt')\n"
        "except BadCheckpointError as exc: said.append(str(exc))\n"
        "try:\n"
        f"    read_metadata({MEMO_BOMB!r}, '.metadata', {{}})\n"
        "except BadCheckpointError as exc: said.append(str(exc))\n"
        "grew = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before\n"
        "print(grew); print(len(said)); print(*said, sep='\\n')\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    grew_kib, refused, *said = out.stdout.splitlines()
    assert int(grew_kib) < 200_000, f"the reader grew by {int(grew_kib) // 1024} MiB"
    assert refused == "2" and all("memo slot 268435456" in line for line in said), said


@pytest.mark.parametrize("dims", [(-2, -2), (-1, 4)])
def test_a_tensor_of_negative_size_is_refused(dims: tuple[int, int], tmp_path: Path) -> None:
    """Regression: the torch-free reader took (-2, -2) as four elements (committed with
    exit 0) and gave a numpy traceback for (-1, 4). A torch.save file patched to say so is refused."""
    import torch

    good = tmp_path / "good.pt"
    torch.save({"w": torch.ones(2, 4)}, good)
    with zipfile.ZipFile(good) as z:
        records = {n: z.read(n) for n in z.namelist()}
    pkl = next(n for n in records if n.endswith("/data.pkl"))
    negative = b"".join(b"J" + d.to_bytes(4, "little", signed=True) for d in dims) + b"\x86"
    assert records[pkl].count(b"K\x02K\x04\x86") == 1
    records[pkl] = records[pkl].replace(b"K\x02K\x04\x86", negative)
    victim = tmp_path / "negative.pt"
    with zipfile.ZipFile(victim, "w", compression=zipfile.ZIP_STORED) as z:
        for name, data in records.items():
            z.writestr(name, data)
    with InputFile(victim) as src, pytest.raises(BadCheckpointError, match="negative size"):
        read_torch_zip(src, str(victim))
    save = tmp_path / "save"
    save.mkdir()
    victim.rename(save / "ckpt.pt")
    with Store.init(tmp_path / "store") as store:  # a plain file it refuses is kept whole, never cut
        store.commit(save, step=1)
        assert store.repo.view(Catalogue).atoms(store.repo.resolve("latest")) == []
        store.checkout("latest", tmp_path / "out")
    assert (tmp_path / "out" / "save" / "ckpt.pt").read_bytes() == (save / "ckpt.pt").read_bytes()


def test_a_pickle_with_out_of_band_buffers_is_refused_before_it_loads() -> None:
    """Protocol 5's READONLY_BUFFER over a bytearray, which torch.save never writes: the C
    unpickler left "deallocated bytearray object has exported buffers" behind a failed load (found
    by benchmarks.fuzz). Refused before it loads."""
    from tailorstore.formats.torch_pickle import load_pickle_tree

    with pytest.raises(CorruptStoreError, match="out-of-band buffers"):
        load_pickle_tree(b"\x80\x05\x96\x03\x00\x00\x00\x00\x00\x00\x00abc\x98.", "data.pkl")
