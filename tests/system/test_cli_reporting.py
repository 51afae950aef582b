"""What the reporting commands print and accept: plot without its optional dependency, usage
errors, sizes and names in plans and logs, digests, listing a step's files."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
from itertools import pairwise
from pathlib import Path

import pytest
import torch

from tests.conftest import CLI, Runs, as_of_step, one_line, tailor_here


def test_plot_without_matplotlib_says_what_to_install(tmp_path: Path) -> None:
    """matplotlib is an optional dependency: without it, `tailor plot` is one line naming the
    extra to install and the bad-input exit, not an ImportError's traceback."""
    stub = tmp_path / "no_matplotlib" / "matplotlib"
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text("raise ImportError('No module named matplotlib')\n")
    store = tmp_path / "store"
    env = {**os.environ, "TAILOR_STORE": str(store)}
    env["PYTHONPATH"] = os.pathsep.join([str(stub.parent), env.get("PYTHONPATH", "")])
    assert subprocess.run([*CLI, "init", str(store)], env=env, capture_output=True).returncode == 0
    done = subprocess.run(
        [*CLI, "plot", "--out", str(tmp_path / "p.png")], env=env, capture_output=True, text=True, timeout=300
    )
    one_line(done, 2, "matplotlib", "pip install 'tailorstore[plot]'")
    assert not (tmp_path / "p.png").exists()


def test_ls_lists_a_steps_files_and_sizes_without_a_checkout(tmp_path: Path) -> None:
    """`tailor ls REF`: each file a checkout would write, with its size, kind and mode, read from the
    index alone (the store's objects are not opened: nothing is written anywhere)."""
    from tests.unit.store.test_digest import save

    folder = save(tmp_path / "s", 1)
    store = tmp_path / "store"
    assert tailor_here("init", str(store)).returncode == 0
    assert tailor_here("commit", str(folder), "--step", "7", "--tag", "t", store=store).returncode == 0
    out = tmp_path / "out"
    assert tailor_here("checkout", "step=7", "--out", str(out), store=store).returncode == 0
    written = {str(p.relative_to(out)): p.stat().st_size for p in out.rglob("*") if p.is_file()}
    listed = json.loads(tailor_here("ls", "tag=t", "--json", store=store).stdout)
    assert {f["path"]: f["size"] for f in listed["files"]} == written
    assert {f["kind"] for f in listed["files"]} == {"raw", "safetensors"}
    assert listed["summary"]["step"] == 7 and "manifest" not in listed["summary"]
    text = tailor_here("ls", "step=7", store=store).stdout.splitlines()
    assert text[0].startswith(f"step 7 (id={listed['summary']['id']}): 3 file(s)")
    assert sorted(line.split()[-1] for line in text[1:]) == sorted(written)
    one_line(tailor_here("ls", "step=8", store=store), 2, "step 8")


@pytest.mark.slow
def test_diff_across_world_sizes_compares_by_parameter_and_names_runs(runs: Runs, tmp_path: Path) -> None:
    """Two saves of one model at 2 ranks and at 1: diff compares each layer parameter by parameter
    (the pieces lie on other ranks), equal to the change between zero_to_fp32's masters; a refusal
    between runs names the runs, not "step 6 with step 6"."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    from tailorstore.core.layers import layer_of

    two, one = runs.get("zero2-bf16").save_dir, runs.get("zero2-bf16-1rank").save_dir
    odd = runs.get("zero2-bf16-odd-two-groups").save_dir
    store = tmp_path / "store"
    assert tailor_here("init", str(store)).returncode == 0
    assert tailor_here("commit", str(as_of_step(two, 6, tmp_path / "two")), "-q", store=store).returncode == 0
    for name, save in (("one", one), ("odd", odd)):
        done = tailor_here("commit", str(as_of_step(save, 6, tmp_path / name)), "--run", name, "-q", store=store)
        assert done.returncode == 0, done.stderr
    done = tailor_here("diff", "step=6", "one:step=6", "--json", store=store)
    assert done.returncode == 0, done.stderr
    got = {r["layer"]: r["master"] for r in json.loads(done.stdout)["layers"]}
    a = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path / "two"), tag="global_step6")
    b = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path / "one"), tag="global_step6")
    sums: dict[str, list[float]] = {}
    for name, ref in a.items():
        terms = sums.setdefault(layer_of(name), [0.0, 0.0])
        terms[0] += float(torch.sum((b[name].detach().double() - ref.detach().double()) ** 2))
        terms[1] += float(torch.sum(ref.detach().double() ** 2))
    expected = {layer: math.sqrt(d / r) for layer, (d, r) in sums.items()}
    assert set(got) == set(expected)
    for layer, value in expected.items():
        assert value > 0 and got[layer] == pytest.approx(value, rel=1e-6), layer
    text = tailor_here("diff", "step=6", "one:step=6", store=store).stdout
    assert text.startswith("relative change from step 6 to run one step 6"), text
    one_line(tailor_here("diff", "step=6", "odd:step=6", store=store), 2, "run main step 6", "run odd step 6")


def test_plot_measures_weights_where_a_step_holds_no_masters(tmp_path: Path) -> None:
    """An HF Trainer or plain safetensors save holds only the model's weights: each layer's change
    is measured on them (it was None everywhere, a grey picture, reading masters only), equal to
    the change computed from the saved tensors themselves."""
    from safetensors.torch import load_file

    from tailorstore.core.layers import layer_of
    from tailorstore.report.diff import change_matrix
    from tailorstore.store.repo import Repository
    from tests.unit.store.test_digest import save

    store = tmp_path / "store"
    assert tailor_here("init", str(store)).returncode == 0
    saves = [save(tmp_path / "s" / str(seed), seed) for seed in (1, 2, 3)]
    for step, folder in enumerate(saves, start=1):
        assert tailor_here("commit", str(folder), "--step", str(step), store=store).returncode == 0
    with Repository.open(store) as repo:
        m = change_matrix(repo)
    assert m.columns == ["step 2", "step 3"] and not any(any(flags) for flags in m.inherited)

    def tensors(folder: Path) -> dict[str, torch.Tensor]:
        return {k: v.double() for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}

    for column, (old, new) in enumerate(pairwise(saves)):
        a, b = tensors(old), tensors(new)
        for row, layer in enumerate(m.layers):
            names = [n for n in a if layer_of(n) == layer]
            expected = math.sqrt(sum(float(((b[n] - a[n]) ** 2).sum()) for n in names) / sum(
                float((a[n] ** 2).sum()) for n in names))  # fmt: skip
            assert m.values[row][column] == pytest.approx(expected, rel=1e-6), (layer, column)


def test_the_gc_plan_names_runs_and_reads_in_units(tmp_path: Path) -> None:
    """The plan line: sizes as people read them (not raw byte counts), and the steps of each run
    named with their run (step 1 of two runs is two different steps)."""
    from tests.unit.store.test_digest import save

    store = tmp_path / "store"
    assert tailor_here("init", str(store)).returncode == 0
    for run, seed in (("main", 1), ("main", 2), ("ft", 3), ("ft", 4)):
        step = str(seed if run == "main" else seed - 2)
        done = tailor_here("commit", str(save(tmp_path / f"s{seed}", seed)), "--step", step, "--run", run, store=store)
        assert done.returncode == 0, done.stderr
    plan = tailor_here("gc", "--keep-last", "1", "--dry-run", store=store)
    assert plan.returncode == 0, plan.stderr
    assert "drop 2 manifest(s) (ft: steps 1; main: steps 1)" in plan.stdout, plan.stdout
    assert re.search(r"freeing \d+(\.\d)? (B|KB|MB)\b", plan.stdout) and " bytes" not in plan.stdout, plan.stdout


def test_a_command_line_click_cannot_parse_is_one_line_and_exit_2(tmp_path: Path) -> None:
    """A missing option, an unknown one, a bad value, an unknown command: one line naming the
    command's help (click printed the usage, a hint, a blank line and the error), exit 2; the help
    asked for (`tailor` alone) still prints."""
    store = tmp_path / "store"
    assert tailor_here("init", str(store)).returncode == 0
    one_line(tailor_here("checkout", "step=1", store=store), 2, "Missing option '--out'", "tailor checkout --help")
    one_line(tailor_here("log", "--bogus", store=store), 2, "No such option: --bogus", "tailor log --help")
    one_line(tailor_here("gc", "--keep-last", "x", store=store), 2, "'x' is not a valid int", "tailor gc --help")
    one_line(tailor_here("nosuch", store=store), 2, "No such command 'nosuch'")
    one_line(tailor_here("run", "create", store=store), 2, "Missing argument", "tailor run create --help")
    assert "Commands:" in tailor_here().stdout + tailor_here().stderr
    assert tailor_here("--help").returncode == 0 and tailor_here("log", "--help").returncode == 0
    assert tailor_here("verify", store=store).returncode == 0


def test_waiting_for_a_commit_in_flight_is_no_warning(tmp_path: Path) -> None:
    """A save that finds the previous commit still running waits for it: the queue's ordinary
    back-pressure, said at level INFO, not as a warning on every such save of a run."""
    import logging
    import threading

    import tailorstore

    seen: list[logging.LogRecord] = []
    first_may_end = threading.Event()

    class Seen(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record)
            first_may_end.set()  # the second save is waiting now: let the first commit end

    ours = logging.getLogger("tailorstore")
    handler, level = Seen(logging.DEBUG), ours.level
    ours.addHandler(handler)
    ours.setLevel(logging.DEBUG)
    try:
        with tailorstore.Store.init(tmp_path / "store") as store:
            store._background("first", lambda _handle: first_may_end.wait(60))
            store._background("second", lambda _handle: None)
    finally:
        ours.removeHandler(handler)
        ours.setLevel(level)
    waits = [r for r in seen if "already in flight" in r.getMessage()]
    assert len(waits) == 1 and waits[0].levelno == logging.INFO


def test_the_commit_progress_moves_within_a_file(tmp_path: Path) -> None:
    """A save is often one large file (model.safetensors, a rank's optimizer states): the bar moved
    only when a file ended, so it sat at 0 until the end. It now moves piece by piece, and still
    adds up to the save's size."""
    from safetensors.torch import save_file

    import tailorstore

    class Told:
        """A Progress that keeps what it was told (the protocol the CLI's bar implements)."""

        def __init__(self) -> None:
            self.total, self.steps = 0, []

        def start(self, description: str, total: int) -> None:
            self.total = total

        def advance(self, amount: int) -> None:
            self.steps.append(amount)

        def close(self) -> None:
            pass

        def warn(self, message: str) -> None:
            pass

        def note(self, message: str) -> None:
            pass

    gen = torch.Generator().manual_seed(0)
    save_file({f"model.layers.{i}.w": torch.randn(64, 64, generator=gen) for i in range(8)}, tmp_path / "m.safetensors")
    told = Told()
    with tailorstore.Store.init(tmp_path / "store") as store:
        store.commit(tmp_path / "m.safetensors", step=1, progress=told)
    size = (tmp_path / "m.safetensors").stat().st_size
    assert told.total == size and sum(told.steps) == size
    assert len(told.steps) >= 8 and all(s > 0 for s in told.steps)
