"""What the reporting commands print and accept: plot without its optional dependency, usage
errors, sizes and names in plans and logs, digests, listing a step's files."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from conftest import CLI, one_line, tailor_here


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
    from test_digest import save

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
