"""What the reporting commands print and accept: plot without its optional dependency, usage
errors, sizes and names in plans and logs, digests, listing a step's files."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from conftest import CLI, one_line


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
