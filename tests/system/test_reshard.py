"""`tailor checkout --world-size M [--zero-stage S]`: the native ZeRO layout for another world size,
checked against DeepSpeed's own path on real runs. After `engine.load_checkpoint` of ours at M ranks,
what DeepSpeed holds (saved right after the load, as DeepSpeed saves it) equals, tensor for tensor,
what it holds after `ds_to_universal` then `load_universal` at M, and the next losses are equal.
Covered: 2->1, 1->2 and 2->3 ranks, ZeRO 1 (to 2), 2 and 3, bf16 and fp32, odd sizes, two and
per-layer param groups, a composite step; and the universal layout written by tailorstore loaded
the same way."""

from __future__ import annotations

import json
import shutil
import struct
import threading
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

import tailorstore
from tailorstore.access import atom_reader
from tailorstore.access.model_tensors import model_view, read_float32, read_raw
from tailorstore.restore import reshard
from tailorstore.store.index.catalogue import Catalogue
from testbed.runs import train_hf, train_tiny
from tests.conftest import HFRun, Run, Runs, as_of_step, blob_object, commit_and_reset_reads, tailor
from tests.system.test_universal import assert_same_universal, ds_to_universal

STEP = 3


def tensors(tree: Any, path: str = "") -> dict[str, torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return {path: tree}
    out: dict[str, torch.Tensor] = {}
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, list | tuple) else []
    for key, value in items:
        out.update(tensors(value, f"{path}/{key}"))
    return out


def assert_same_zero_files(ours: Path, theirs: Path) -> None:
    """The same files, each with the same tensors (bit for bit) and the same partition bookkeeping."""
    names = sorted(p.name for p in theirs.glob("*.pt"))
    assert sorted(p.name for p in ours.glob("*.pt")) == names
    for name in names:
        a, b = torch.load(ours / name, weights_only=False), torch.load(theirs / name, weights_only=False)
        ta, tb = tensors(a), tensors(b)
        assert set(ta) == set(tb), (name, set(ta) ^ set(tb))
        for key, tensor in tb.items():
            assert ta[key].dtype == tensor.dtype and ta[key].shape == tensor.shape, (name, key)
            assert torch.equal(ta[key], tensor), (name, key)
        if "optim" in name:
            oa, ob = a["optimizer_state_dict"], b["optimizer_state_dict"]
            for key in ("param_slice_mappings", "group_paddings", "partition_count", "zero_stage"):
                assert repr(oa.get(key)) == repr(ob.get(key)), (name, key)
        else:
            assert a["dp_world_size"] == b["dp_world_size"]


class DeepSpeedPath:
    """What DeepSpeed itself holds after ds_to_universal + load_universal at M ranks (cached per case)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.done: dict[tuple[str, int, int], tuple[dict[int, str], Path]] = {}

    def universal(self, run: Run) -> Path:
        out = self.root / f"universal-{run.name}"
        if not out.exists():
            ds_to_universal(as_of_step(run.save_dir, STEP, self.root / f"at-{run.name}") / f"global_step{STEP}", out)
        return out

    def loaded(self, run: Run, nproc: int, stage: int) -> tuple[dict[int, str], Path]:
        key = (run.name, nproc, stage)
        if key not in self.done:
            self.done[key] = resume(
                run, self.universal(run), nproc, stage, self.root / f"ds-{run.name}-{nproc}-{stage}", universal=True
            )
        return self.done[key]


def resume(
    run: Run, source: Path, nproc: int, stage: int, work: Path, universal: bool = False
) -> tuple[dict[int, str], Path]:
    """Resume ``source`` at ``nproc`` ranks; (the next two losses, the state DeepSpeed saved right after loading)."""
    options = {**run.options, "stage": stage}
    losses = train_tiny(
        work / "save", losses_out=work / "losses.json", nproc=nproc, steps=STEP + 2, save_every=0,
        resume_from=source, load_universal=universal, save_on_load=str(work / "loaded"), **options,
    )  # fmt: skip
    assert sorted(losses) == [STEP + 1, STEP + 2]
    return losses, work / "loaded" / "loaded"


@pytest.fixture(scope="module")
def deepspeed_path(tmp_path_factory: pytest.TempPathFactory) -> DeepSpeedPath:
    return DeepSpeedPath(tmp_path_factory.mktemp("deepspeed-path"))


@pytest.mark.parametrize(
    ("run_name", "world", "stage", "resume_ours"),
    [
        ("zero2-bf16-odd-two-groups", 1, None, False),  # 2 -> 1
        ("zero2-bf16-1rank", 2, None, False),  # 1 -> 2
        ("zero2-bf16-odd-two-groups", 3, None, False),  # 2 -> 3: the group padding moves to the third rank
        ("zero3-bf16", 3, None, True),  # ZeRO 3, every parameter cut three ways (and DeepSpeed loads ours)
        ("zero1-fp32", 3, 2, False),  # ZeRO 1 to ZeRO 2, fp32
    ],
)
def test_reshard_equals_deepspeeds_universal_path(
    runs: Runs,
    deepspeed_path: DeepSpeedPath,
    tmp_path: Path,
    run_name: str,
    world: int,
    stage: int | None,
    resume_ours: bool,
) -> None:
    """Where ``resume_ours`` is False, the files equal DeepSpeed's own save at M ranks, which DeepSpeed
    resumes exactly (its same-world-size path); the other cases load ours too, to show it."""
    run = runs.get(run_name)
    target_stage = stage or int(run.options["stage"])  # type: ignore[call-overload]
    with tailorstore.Store.init(tmp_path / "store") as store:
        store.commit(as_of_step(run.save_dir, STEP, tmp_path / "at"))
        result = store.checkout(STEP, tmp_path / "ours", world_size=world, zero_stage=stage)
    assert (result.world_size, result.zero_stage, result.tag) == (world, target_stage, f"global_step{STEP}")
    expected_losses, expected_state = deepspeed_path.loaded(run, world, target_stage)
    # what we wrote is what DeepSpeed saves at M ranks after its own universal load ...
    assert_same_zero_files(tmp_path / "ours" / f"global_step{STEP}", expected_state)
    # ... and what DeepSpeed holds after loading ours is the same, and trains on the same
    if resume_ours:
        losses, state = resume(run, tmp_path / "ours", world, target_stage, tmp_path / "resumed")
        assert_same_zero_files(state, expected_state)
        assert losses == expected_losses


def test_resharding_to_the_saved_world_size_resumes_exactly(runs: Runs, tmp_path: Path) -> None:
    """Written for the world size it was saved at, the step resumes exactly as the uninterrupted run
    went on (ZeRO 3, odd sizes, seven param groups). DeepSpeed's own universal path is no reference
    here: with several ZeRO-3 param groups, after load_universal its second loss differs from the
    uninterrupted run's even at the saved world size (seen with DeepSpeed 0.19.8), though the state
    it saves right after loading equals ours."""
    run = runs.get("zero3-bf16-odd-per-layer")
    with tailorstore.Store.init(tmp_path / "store") as store:
        store.commit(as_of_step(run.save_dir, STEP, tmp_path / "at"))
        store.checkout(STEP, tmp_path / "ours", world_size=2)
    losses, _ = resume(run, tmp_path / "ours", 2, 3, tmp_path / "resumed")
    assert losses == {s: run.losses[s] for s in (STEP + 1, STEP + 2)}


def test_tailorstores_universal_layout_loads_at_another_world_size(
    runs: Runs, deepspeed_path: DeepSpeedPath, tmp_path: Path
) -> None:
    run = runs.get("zero2-bf16-odd-two-groups")
    with tailorstore.Store.init(tmp_path / "store") as store:
        store.commit(as_of_step(run.save_dir, STEP, tmp_path / "at"))
        store.checkout_universal(STEP, tmp_path / "ours")
    losses, state = resume(run, tmp_path / "ours", 3, 2, tmp_path / "resumed", universal=True)
    expected_losses, expected_state = deepspeed_path.loaded(run, 3, 2)
    assert losses == expected_losses
    assert_same_zero_files(state, expected_state)


def test_a_composite_reshards_like_an_exact_step(runs: Runs, tmp_path: Path) -> None:
    """A parity commit inherits layers from an earlier step; resharded, every parameter's master and
    moments are those the composite names, and DeepSpeed resumes from it at the new world size."""
    run = runs.get("tailor-zero2")
    with tailorstore.Store.init(tmp_path / "store") as store:
        store.commit(as_of_step(run.save_dir, 15, tmp_path / "at15"))
        committed = store.commit(as_of_step(run.save_dir, 18, tmp_path / "at18"), policy="parity")
        assert committed.inherited_layers
        store.checkout(18, tmp_path / "ours", world_size=1)
        composite = model_view(store.repo, store.repo.resolve("step=18"))
        expected = {(t.name, "master"): read_float32(store.repo, composite, t).tobytes() for t in composite.tensors}
        for t in composite.tensors:
            for kind in ("exp_avg", "exp_avg_sq"):
                expected[(t.name, kind)] = bytes(
                    read_raw(store.repo, composite, composite.state(t.name, kind, t.shape))
                )
    with tailorstore.Store.init(tmp_path / "again") as again:
        again.commit(tmp_path / "ours", step=18)
        resharded = model_view(again.repo, again.repo.resolve("step=18"))
        assert resharded.world_size == 1
        for t in resharded.tensors:
            assert read_float32(again.repo, resharded, t).tobytes() == expected[(t.name, "master")], t.name
            for kind in ("exp_avg", "exp_avg_sq"):
                got = bytes(read_raw(again.repo, resharded, resharded.state(t.name, kind, t.shape)))
                assert got == expected[(t.name, kind)], (t.name, kind)
    losses = train_tiny(
        tmp_path / "resumed", losses_out=tmp_path / "losses.json", nproc=1, steps=19, save_every=0,
        resume_from=tmp_path / "ours", **run.options,
    )  # fmt: skip
    assert sorted(losses) == [19]


def test_what_cannot_be_produced_is_refused_before_writing(runs: Runs, tmp_path: Path) -> None:
    stores = {}
    for name in ("zero2-bf16", "zero0-bf16", "zero1-bf16-acc32"):
        stores[name] = tmp_path / f"store-{name}"
        with tailorstore.Store.init(stores[name]) as st:
            st.commit(as_of_step(runs.get(name).save_dir, STEP, tmp_path / f"at-{name}"))
    cases = [
        ("zero2-bf16", ["--world-size", "0"], "world size 0"),
        ("zero2-bf16", ["--world-size", "2", "--zero-stage", "3"], "ZeRO-2 to ZeRO-3"),
        ("zero2-bf16", ["--zero-stage", "7"], "ZeRO stage 7"),
        ("zero2-bf16", ["--world-size", "2", "--format", "universal"], "drop --world-size"),
        ("zero0-bf16", ["--world-size", "1"], "ZeRO-0"),
        ("zero1-bf16-acc32", ["--world-size", "1"], "BF16_Optimizer"),
    ]
    for name, extra, says in cases:
        out = tmp_path / "out"
        proc = tailor("checkout", f"step={STEP}", "--out", str(out), *extra, store=stores[name])
        assert proc.returncode == 2 and says in proc.stderr and "Traceback" not in proc.stderr, (extra, proc.stderr)
        assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
        assert not out.exists() and not list(tmp_path.glob(".out.tailor-partial-*"))


def _last_raw_plane_byte(stored: bytes) -> int:
    """The offset of a byte inside the last raw-stored plane of a bytegroup-zstd blob (a flip there
    decodes cleanly, so only the hash check, after the whole atom has streamed out, can catch it)."""
    found, at = -1, 0
    while at < len(stored):
        _raw, planes = struct.unpack_from("<IB", stored, at)
        at += 5
        specs = [struct.unpack_from("<BI", stored, at + 5 * i) for i in range(planes)]
        at += 5 * planes
        for mode, length in specs:
            if mode == 0 and length:
                found = at + length // 2
            at += length
    assert found >= 0, "no raw plane in this blob"
    return found


@pytest.mark.parametrize("kind", ["master", "exp_avg"])
def test_a_damaged_blob_stops_a_streamed_checkout_with_nothing_published(runs: Runs, tmp_path: Path, kind: str) -> None:
    """Universal and resharded checkouts and export stream each tensor from its atoms and check an
    atom's hash only after its last chunk is written (export on a read-ahead thread): a flipped
    byte must still end in exit 3 and no output."""
    store = tmp_path / "store"
    with tailorstore.Store.init(store) as st:
        st.commit(as_of_step(runs.get("zero2-bf16").save_dir, STEP, tmp_path / "at"))
        atom = max(st.repo.view(Catalogue).atoms(1, kind=kind), key=lambda a: a.nbytes)
        assert json.loads(st.repo.blob(atom.blob).codec)["id"] == "bytegroup-zstd"
        file, start, size = blob_object(st.repo, atom.blob)
    file.chmod(0o644)
    data = bytearray(file.read_bytes())
    data[start + _last_raw_plane_byte(bytes(data[start : start + size]))] ^= 0x01
    file.write_bytes(bytes(data))
    commands = [["checkout", f"step={STEP}", *extra] for extra in (["--format", "universal"], ["--world-size", "1"])]
    commands += [["checkout", f"step={STEP}", "--world-size", "3"]]
    commands += [["export", f"step={STEP}", "--dtype", "fp32"]] if kind == "master" else []  # export reads masters
    for extra in commands:
        out = tmp_path / "out"
        proc = tailor(*extra, "--out", str(out), store=store)
        assert proc.returncode == 3 and "does not match its hash" in proc.stderr, (extra, proc.stderr)
        errors = [line for line in proc.stderr.strip().splitlines() if not line.startswith("warning: ")]
        assert "Traceback" not in proc.stderr and len(errors) == 1, proc.stderr  # export warns of no config.json
        assert not out.exists() and not list(tmp_path.glob(".out.tailor-partial-*")), extra


def test_a_resharded_optimizer_file_is_decoded_on_read_ahead_helpers(
    runs: Runs, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The masters and moments of the optimizer files stream on read-ahead helper threads, ahead of
    the writer (the model-states file, whose derived weights are rebuilt through the index, stays on
    the caller's thread); at the saved world size its tensors still equal the saved ones."""
    threads: dict[str, set[str]] = {}
    real = atom_reader.stream_blob

    def watched(store, row, lo, hi, where):  # type: ignore[no-untyped-def]
        threads.setdefault(threading.current_thread().name.split("_")[0], set()).add(where)
        return real(store, row, lo, hi, where)

    monkeypatch.setattr(atom_reader, "stream_blob", watched)
    with tailorstore.Store.init(tmp_path / "store") as store:
        store.commit(as_of_step(runs.get("zero2-bf16").save_dir, STEP, tmp_path / "at"))
        store.checkout(STEP, tmp_path / "ours", world_size=2)
        store.checkout(STEP, tmp_path / "plain")
    assert any(name.startswith("tailor-read-ahead") for name in threads), threads
    tag = f"global_step{STEP}"
    for path in (tmp_path / "plain" / tag).glob("*optim_states.pt"):
        ours = tensors(torch.load(tmp_path / "ours" / tag / path.name, weights_only=False))
        saved = tensors(torch.load(path, weights_only=False))
        assert set(ours) == set(saved) and all(torch.equal(ours[k], t) for k, t in saved.items()), path.name


def test_one_partition_is_decoded_by_both_read_ahead_helpers(
    runs: Runs, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At one rank a group's FP32 partition is one tensor of every parameter's piece; each piece is
    a read-ahead source of its own, so both helpers decode it (as one source, one helper did while
    the writer waited)."""
    decoders: dict[str, set[int]] = {}
    real = atom_reader.stream_blob

    def watched(store, row, lo, hi, where):  # type: ignore[no-untyped-def]
        if threading.current_thread().name.startswith("tailor-read-ahead"):
            decoders.setdefault(row.hash, set()).add(threading.get_ident())
        return real(store, row, lo, hi, where)

    monkeypatch.setattr(atom_reader, "stream_blob", watched)
    with tailorstore.Store.init(tmp_path / "store") as store:
        store.commit(as_of_step(runs.get("zero2-bf16").save_dir, STEP, tmp_path / "at"))
        masters = {a.blob for a in store.repo.view(Catalogue).atoms(1, kind="master")}
        store.checkout(STEP, tmp_path / "ours", world_size=1)
    helpers = set().union(*(decoders[h] for h in masters if h in decoders))
    assert masters <= set(decoders) and len(helpers) == 2, decoders


@pytest.mark.parametrize("in_place", [True, False])
def test_the_model_states_weights_come_from_the_masters_the_optimizer_files_stream(
    runs: Runs, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, blob_reads: dict[str, int], in_place: bool
) -> None:
    """Under ZeRO 1/2 the model-states file is the saved one with dp_world_size patched, written in
    place, its weights rounded from the master chunks the optimizer files stream: every master blob
    is read once. Where the field cannot be patched (``in_place=False``) the file is re-pickled from
    its tree and the masters are read again for its weights. Either way it loads as the saved one."""
    reads = blob_reads  # conftest: each blob's stream count
    if not in_place:
        monkeypatch.setattr(reshard, "with_int_field", lambda pickled, key, value: None)
    save = runs.get("zero2-bf16").save_dir
    with tailorstore.Store.init(tmp_path / "store") as store:
        masters, _ = commit_and_reset_reads(store, as_of_step(save, STEP, tmp_path / "at"), reads)
        store.checkout(STEP, tmp_path / "one", world_size=1)  # one partition: no master straddles two
        assert masters and masters <= set(reads)
        twice = {h for h in masters if reads[h] > 1}
        assert (twice == set()) if in_place else (twice == masters), reads
        store.checkout(STEP, tmp_path / "ours", world_size=3)
    name = f"global_step{STEP}/mp_rank_00_model_states.pt"
    with zipfile.ZipFile(tmp_path / "ours" / name) as zf:
        assert zf.testzip() is None  # the patched pickle's CRC was mended
    ours, saved = torch.load(tmp_path / "ours" / name, weights_only=False), torch.load(save / name, weights_only=False)
    assert ours["dp_world_size"] == 3 and saved["dp_world_size"] == 2
    assert set(ours) == set(saved) and all(torch.equal(ours["module"][k], t) for k, t in saved["module"].items())
    if in_place:  # the saved file's bytes but the field and the two copies of its record's CRC
        mine, theirs = (tmp_path / "ours" / name).read_bytes(), (save / name).read_bytes()
        assert len(mine) == len(theirs) and sum(a != b for a, b in zip(mine, theirs, strict=True)) <= 9


def test_an_hf_trainer_checkpoint_reshards_reading_each_master_once(
    hf_run: HFRun, tmp_path: Path, blob_reads: dict[str, int]
) -> None:
    """An HF Trainer checkpoint-N (ZeRO 2, bf16, 2 ranks) at one rank: its model.safetensors beside
    the tag folder holds weights derived from the masters, rounded like the model states' from the
    masters the optimizer file streams; the Trainer's files come out as they were."""
    reads = blob_reads  # conftest: each blob's stream count
    checkpoint = hf_run.output_dir / "checkpoint-6"
    with tailorstore.Store.init(tmp_path / "store") as store:
        masters, derived = commit_and_reset_reads(store, checkpoint, reads)
        result = store.checkout("latest", tmp_path / "ours", world_size=1)
    assert result.world_size == 1 and "model.safetensors" in derived and masters <= set(reads)
    assert {h: n for h, n in reads.items() if h in masters and n != 1} == {}
    ours = tmp_path / "ours"
    for name in ("config.json", "trainer_state.json", "model.safetensors"):
        assert (ours / name).read_bytes() == (checkpoint / name).read_bytes(), name
    states = torch.load(ours / "global_step6" / "mp_rank_00_model_states.pt", weights_only=False)
    assert states["dp_world_size"] == 1


def test_an_int_field_of_a_pickle_is_patched_only_where_it_fits() -> None:
    """with_int_field keeps the pickle's length: the new value in the old one's opcode, else None."""
    import pickle

    from tailorstore.formats.torch_pickle import with_int_field

    tree = {"module": {"w": [1.5]}, "dp_world_size": 2, "mp_world_size": 1}
    pickled = pickle.dumps(tree, protocol=2)
    assert pickle.loads(with_int_field(pickled, "dp_world_size", 3) or b"") == {**tree, "dp_world_size": 3}
    assert with_int_field(pickled, "dp_world_size", 300) is None  # BININT1 holds 0-255
    assert with_int_field(pickled, "no_such_key", 3) is None
    wide = pickle.dumps({**tree, "dp_world_size": 1000}, protocol=2)
    assert pickle.loads(with_int_field(wide, "dp_world_size", 7) or b"")["dp_world_size"] == 7  # BININT2 holds it
    for protocol in (2, 4):  # the key again through the memo (2), or memoized implicitly (4): refuse
        twice = pickle.dumps([{"dp_world_size": 2}, {"dp_world_size": 2}], protocol=protocol)
        assert with_int_field(twice, "dp_world_size", 3) is None


@pytest.mark.slow  # trains (2 ranks), then resumes (1 rank)
def test_a_save_before_the_first_step_reshards_and_resumes(tmp_path: Path) -> None:
    """Before its first step AdamW holds no moments, so the step has no exp_avg atoms: resharding
    it must not ask for them (looking up every moment's blob row for the read-ahead once did,
    and failed with exit 3), and DeepSpeed resumes the result at the new world size; its universal
    layout equals ds_to_universal's (fp32 only; this exited 3 before)."""
    save = tmp_path / "save"
    train_tiny(save, losses_out=tmp_path / "losses.json", steps=2, save_every=2, save_at_start=True)
    store = tmp_path / "store"
    with tailorstore.Store.init(store) as st:
        st.commit(as_of_step(save, 0, tmp_path / "at0"))
        assert not st.repo.view(Catalogue).atoms(1, kind="exp_avg"), "a save before the first step holds no moments"
    proc = tailor("checkout", "step=0", "--world-size", "1", "--out", str(tmp_path / "ours"), store=store)
    assert proc.returncode == 0, proc.stderr
    # the universal layout of it: fp32.pt per parameter and no moments, as DeepSpeed's converter writes it
    proc = tailor("checkout", "step=0", "--format", "universal", "--out", str(tmp_path / "universal"), store=store)
    assert proc.returncode == 0, proc.stderr
    theirs = ds_to_universal(save / "global_step0", tmp_path / "theirs")
    assert_same_universal(tmp_path / "universal", theirs, "global_step0")
    assert not list((tmp_path / "universal").rglob("exp_avg*.pt"))
    work = tmp_path / "resumed"
    losses = train_tiny(
        work / "save", losses_out=work / "losses.json", nproc=1, steps=2, save_every=0, resume_from=tmp_path / "ours"
    )
    assert sorted(losses) == [1, 2]


@pytest.mark.parametrize(
    ("run_name", "world", "stage", "attached"),
    [
        ("zero2-bf16-odd-two-groups", 2, 2, True),  # the save's own world size, inside engine.load_checkpoint
        ("zero2-bf16-odd-two-groups", 1, 2, True),  # 2 -> 1 inside engine.load_checkpoint (attach)
        ("zero2-bf16-odd-two-groups", 3, 2, False),  # 2 -> 3 through load_checkpoint(engine, store): no attach
        ("zero1-fp32", 3, 2, True),  # ZeRO 1 at 2 ranks -> ZeRO 2 at 3
    ],
)
def test_training_resumes_at_another_world_size_straight_from_the_store(
    runs: Runs,
    deepspeed_path: DeepSpeedPath,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    run_name: str,
    world: int,
    stage: int,
    attached: bool,
) -> None:
    """No command, no universal folder and no staged file: each rank builds the files it loads for
    the new world size and stage from the store, in memory, DeepSpeed loads them, and
    the next losses equal DeepSpeed's own ds_to_universal + load_universal path at that size, bit for
    bit. The staging folder holds no byte at any time (sampled every 5 ms, as test_nodes samples the
    staged path's share)."""
    from tests.system.test_nodes import StagingPeaks

    run = runs.get(run_name)
    with tailorstore.Store.init(tmp_path / "store") as store:
        store.commit(as_of_step(run.save_dir, STEP, tmp_path / "at"))
    staging = tmp_path / "staging"
    staging.mkdir()
    monkeypatch.setenv("TAILOR_STAGING", str(staging))
    how: dict[str, object] = (
        {"tailor_engine": True, "resume_from": tmp_path / "no-save-on-disk"}
        if attached
        else {"load_from_store": "latest"}
    )
    with StagingPeaks([staging]) as peaks:
        losses = train_tiny(
            tmp_path / "save", losses_out=tmp_path / "losses.json", nproc=world, steps=STEP + 2, save_every=0,
            commit_to=tmp_path / "store", **how, **{**run.options, "stage": stage},
        )  # fmt: skip
    expected, _ = deepspeed_path.loaded(run, world, stage)
    assert losses == expected
    assert peaks.peaks == [0], f"{peaks.peaks[0]} bytes were staged"
    assert not [p for p in staging.rglob("*") if p.is_file()]


def test_a_node_writes_only_its_own_ranks_share(runs: Runs, tmp_path: Path) -> None:
    """``ranks=`` (what one node's leader asks for on resume): only those ranks' optimizer files,
    each byte-identical to the same rank's file of the whole reshard, beside the model states;
    ranks outside the world are refused before anything is written."""
    run = runs.get("zero2-bf16-odd-two-groups")
    with tailorstore.Store.init(tmp_path / "store") as store:
        store.commit(as_of_step(run.save_dir, STEP, tmp_path / "at"))
        store.checkout(STEP, tmp_path / "whole", world_size=3)
        store.checkout(STEP, tmp_path / "node", world_size=3, ranks=[2])
        with pytest.raises(tailorstore.StoreError, match="not ranks of a world of 3"):
            store.checkout(STEP, tmp_path / "wrong", world_size=3, ranks=[3])
    assert not (tmp_path / "wrong").exists()
    tag = f"global_step{STEP}"
    mine = sorted(p.name for p in (tmp_path / "node" / tag).iterdir())
    assert mine == ["bf16_zero_pp_rank_2_mp_rank_00_optim_states.pt", "mp_rank_00_model_states.pt"]
    for name in mine:
        assert (tmp_path / "node" / tag / name).read_bytes() == (tmp_path / "whole" / tag / name).read_bytes()


def test_the_hf_trainer_resumes_at_another_world_size_from_a_resharded_checkout(hf_run: HFRun, tmp_path: Path) -> None:
    """The documented path for the HF Trainer with DeepSpeed: ``checkout --world-size M`` of a
    ``checkpoint-N``, then ``resume_from_checkpoint`` at M ranks, as it is. The final weights
    equal those of DeepSpeed's own path at M (ds_to_universal, then load_universal), bit for bit."""
    checkpoint = hf_run.output_dir / "checkpoint-3"
    with tailorstore.Store.init(tmp_path / "store") as store:
        store.commit(checkpoint)
        store.checkout(3, tmp_path / "ours", world_size=1)
    theirs = tmp_path / "theirs"
    shutil.copytree(checkpoint, theirs, ignore=shutil.ignore_patterns("global_step*", "latest"))
    ds_to_universal(checkpoint / "global_step3", theirs)
    train_hf(tmp_path / "a", final_weights=tmp_path / "ours.safetensors", resume_from=tmp_path / "ours", nproc=1)
    train_hf(
        tmp_path / "b", final_weights=tmp_path / "theirs.safetensors", resume_from=theirs, nproc=1, load_universal=True
    )
    ours, reference = load_file(tmp_path / "ours.safetensors"), load_file(tmp_path / "theirs.safetensors")
    assert ours.keys() == reference.keys()
    assert all(torch.equal(ours[k], reference[k]) for k in ours)
    assert not all(torch.equal(ours[k], load_file(hf_run.final_weights)[k]) for k in ours), "training went on"


def test_a_zero3_node_writes_only_its_own_ranks_share(runs: Runs, tmp_path: Path) -> None:
    """ZeRO-3 keeps a model-states file per rank too: a node's share (``ranks=``) is its ranks'
    optimizer and model-states files, at the saved world size and resharded, each byte-identical
    to the same file of the whole checkout, and nothing of another rank's."""
    run = runs.get("zero3-bf16")
    tag = f"global_step{STEP}"
    with tailorstore.Store.init(tmp_path / "store") as store:
        store.commit(as_of_step(run.save_dir, STEP, tmp_path / "at"))
        store.checkout(STEP, tmp_path / "whole2")
        store.checkout(STEP, tmp_path / "node2", ranks=[1])
        store.checkout(STEP, tmp_path / "whole3", world_size=3)
        store.checkout(STEP, tmp_path / "node3", world_size=3, ranks=[2])
    for whole, node, rank in (("whole2", "node2", 1), ("whole3", "node3", 2)):
        mine = sorted(p.name for p in (tmp_path / node / tag).iterdir())
        assert mine == [
            f"bf16_zero_pp_rank_{rank}_mp_rank_00_optim_states.pt",
            f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt",
        ], mine
        for name in mine:
            assert (tmp_path / node / tag / name).read_bytes() == (tmp_path / whole / tag / name).read_bytes()
