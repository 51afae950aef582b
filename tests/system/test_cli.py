"""The `tailor` command: entry point, --store / TAILOR_STORE, log and show, --json, quiet output."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

import tailorstore
from tailorstore.store.index.schema import FORMAT_VERSION
from tests.conftest import Runs, as_of_step


def run(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    full_env = dict(os.environ)
    full_env.pop("TAILOR_STORE", None)
    full_env.update(env or {})
    return subprocess.run(["tailor", *args], capture_output=True, text=True, env=full_env, cwd=cwd, timeout=300)


def test_version_names_the_format() -> None:
    proc = run("--version")
    assert proc.returncode == 0
    assert proc.stdout.strip() == f"tailorstore {tailorstore.__version__} (store format {FORMAT_VERSION})"


def test_no_store_given_is_a_clear_error(tmp_path: Path) -> None:
    proc = run("log")
    assert proc.returncode == 2 and "--store PATH or set TAILOR_STORE" in proc.stderr
    proc = run("log", "--store", str(tmp_path / "nowhere"))
    assert proc.returncode == 2 and "tailor init" in proc.stderr


def test_cli_is_not_a_top_level_module(tmp_path: Path) -> None:
    probe = (
        "import importlib.util as u; print(u.find_spec('cli') is None, u.find_spec('tailorstore.cli.app') is not None)"
    )
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=tmp_path)
    assert proc.stdout.split() == ["True", "True"]


def test_commit_log_show_checkout(runs: Runs, tmp_path: Path) -> None:
    save = runs.get("zero3-bf16").save_dir
    store = tmp_path / "store"
    assert run("init", str(store)).returncode == 0
    env = {"TAILOR_STORE": str(store)}
    first = run("commit", str(as_of_step(save, 3, tmp_path / "at3")), "--tag", "warm", env=env)
    assert first.returncode == 0, first.stderr
    assert first.stdout.startswith("committed step 3:")
    assert "\x1b[" not in first.stdout + first.stderr, "no progress bar when not on a terminal"
    quiet = run("commit", str(as_of_step(save, 6, tmp_path / "at6")), "--quiet", "--store", str(store))
    assert quiet.returncode == 0 and quiet.stdout == "" and quiet.stderr == ""

    log = json.loads(run("log", "--json", env=env).stdout)
    assert [(s["step"], s["tag"], s["exact"]) for s in log] == [(3, "warm", True), (6, None, True)]
    assert all(s["raw_bytes"] > 0 for s in log)
    assert log[1]["new_bytes"] < log[1]["raw_bytes"]
    text = run("log", env=env).stdout.splitlines()
    assert text[0].split() == ["id", "digest", "step", "committed", "tag", "raw", "new", "kind"]
    row = text[1].split()
    assert (
        row[0] == f"id={log[0]['id']}"
        and len(log[0]["id"]) == 10
        and row[1] == log[0]["digest"][:12]
        and row[2] == "3"
        and row[5] == "warm"
        and text[1].endswith("exact")
    )

    show = json.loads(run("show", "tag=warm", "--json", env=env).stdout)
    layers = {layer["layer"]: layer for layer in show["layers"]}
    assert {"embedding", "block.0", "block.3", "final_norm", "lm_head"} <= set(layers)
    assert layers["block.0"]["source_step"] == 3
    assert {"master", "exp_avg", "exp_avg_sq"} <= set(layers["block.0"]["kinds"])
    assert 0 < layers["block.0"]["stored_bytes"] <= layers["block.0"]["raw_bytes"]
    shown = run("show", "step=3", env=env).stdout
    assert "block.0" in shown and "source" in shown

    out = tmp_path / "out"
    co = run("checkout", "latest", "--out", str(out), env=env)
    assert co.returncode == 0, co.stderr
    assert (out / "latest").read_text() == "global_step6"
    assert run("checkout", "step=99", "--out", str(tmp_path / "x"), env=env).returncode == 2
    bad = run("show", "bogus", env=env)
    assert bad.returncode == 2 and "tag=NAME, id=HEX, digest=HEX or latest" in bad.stderr


def test_progress_bar_on_a_terminal_only(runs: Runs, tmp_path: Path) -> None:
    """Under a pseudo-terminal the commit draws a rich bar on stderr; --quiet draws nothing."""
    import pty

    save = runs.get("zero2-bf16").save_dir
    store = tmp_path / "store"
    assert run("init", str(store)).returncode == 0

    def under_pty(*args: str) -> bytes:
        main, secondary = pty.openpty()
        env = dict(os.environ, TAILOR_STORE=str(store), COLUMNS="100")
        proc = subprocess.Popen(["tailor", *args], stdin=secondary, stdout=secondary, stderr=secondary, env=env)
        os.close(secondary)
        chunks = []
        while True:
            try:
                data = os.read(main, 4096)
            except OSError:
                break
            if not data:
                break
            chunks.append(data)
        proc.wait(timeout=300)
        os.close(main)
        assert proc.returncode == 0
        return b"".join(chunks)

    shown = under_pty("commit", str(as_of_step(save, 3, tmp_path / "at3")))
    assert b"commit" in shown and "━".encode() in shown, shown[-500:]
    quiet = under_pty("commit", str(as_of_step(save, 6, tmp_path / "at6")), "--quiet")
    assert "━".encode() not in quiet and b"committed step" not in quiet


_PROBE = """
import json, sys
from tailorstore.cli.app import main
also = json.loads(sys.argv[2])
sys.argv = ["tailor", *json.loads(sys.argv[1])]
try:
    main()
except SystemExit as exc:
    code = exc.code
else:
    code = 0
watched = ("torch", "deepspeed", "pydantic", *also)
print(json.dumps({"code": code, "loaded": sorted(m for m in watched if m in sys.modules)}))
"""


def _loaded_by(*args: str, store: Path, also: tuple[str, ...] = ()) -> list[str]:
    """What `tailor ARGS` imported of torch, DeepSpeed and pydantic (which typer 0.29 and later load
    to parse every option, about 0.08 s of each command), and of the modules ``also`` names, read
    off its own sys.modules."""
    env = {**os.environ, "TAILOR_STORE": str(store)}
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE, json.dumps(list(args)), json.dumps(list(also))],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["code"] == 0, proc.stderr
    return result["loaded"]


def test_reading_commands_and_checkout_do_not_import_torch(runs: Runs, tmp_path: Path) -> None:
    """`tailor --help`, log, show, tag, gc and verify (deep too) never need torch or DeepSpeed; checkout of
    files committed with their containers rounds derived weights with numpy and needs neither either."""
    store = tmp_path / "store"
    with tailorstore.Store.init(store) as st:
        st.commit(as_of_step(runs.get("zero2-bf16").save_dir, 3, tmp_path / "at3"))
    for args in (["--help"], ["log"], ["show", "step=3"], ["tag", "step=3", "warm"], ["gc", "--dry-run"], ["verify"],
                 ["verify", "--deep"], ["checkout", "latest", "--out", str(tmp_path / "out"), "-q"],
                 ["export", "latest", "--out", str(tmp_path / "model"), "-q"],
                 ["checkout", "latest", "--out", str(tmp_path / "u"), "--format", "universal", "-q"]):  # fmt: skip
        assert _loaded_by(*args, store=store) == [], f"tailor {' '.join(args)} imported torch, DeepSpeed or pydantic"
    assert (tmp_path / "out" / "global_step3").is_dir() and (tmp_path / "model" / "model.safetensors").is_file()
    at6 = as_of_step(runs.get("zero2-bf16").save_dir, 6, tmp_path / "at6")
    assert _loaded_by("commit", str(at6), "-q", store=store) == [], "plain torch.save files are read without torch"

    # A non-contiguous tensor needs torch's own loader: the fallback imports it.
    strided = as_of_step(runs.get("zero2-bf16").save_dir, 6, tmp_path / "strided")
    model_states = strided / "global_step6" / "mp_rank_00_model_states.pt"
    obj = torch.load(model_states, weights_only=False)
    obj["client_extra"] = torch.arange(10.0)[::2]
    torch.save(obj, model_states)
    loaded = _loaded_by("commit", str(strided), "--step", "7", "-q", store=store)
    assert loaded == ["deepspeed", "pydantic", "torch"], "the probe must see a command that does import them"


def test_a_command_loads_the_machinery_of_its_own_verb_only(runs: Runs, tmp_path: Path) -> None:
    """The API imports each verb's modules when the verb is called: `tailor log` paid 60 ms for
    every other verb's when they came with `tailorstore.Store`."""
    store = tmp_path / "store"
    with tailorstore.Store.init(store) as st:
        st.commit(as_of_step(runs.get("zero2-bf16").save_dir, 3, tmp_path / "at3"))
    verbs = tuple(
        f"tailorstore.{name}"
        for name in (
            "curate.averaging",
            "ingest.commit",
            "restore.export",
            "curate.gc",
            "curate.merge_spec",
            "restore.reshard",
            "restore.universal",
            "report.verify",
        )
    )
    assert _loaded_by("log", store=store, also=verbs) == []
    assert _loaded_by("show", "step=3", store=store, also=verbs) == []
    exported = _loaded_by("export", "step=3", "--out", str(tmp_path / "model"), "-q", store=store, also=verbs)
    assert exported == ["tailorstore.restore.export"], "the probe must see the verb's own module"
