"""Start-up imports only what a command uses: ``--help`` and ``--version`` print without numpy
or torch, and ``log``, ``show`` and ``tag`` list and change refs without numpy (the codec loads
it on the first plane it splits or joins); ``log``, ``show``, ``tag`` and ``gc`` import neither
torch nor DeepSpeed. The times are a benchmark (docs/benchmarks.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tailorstore.store.repo import Repository
from tests.conftest import copy_tree

PROBE = """
import json, sys
from tailorstore.cli.app import main
sys.argv = ["tailor", *json.loads(sys.argv[1])]
try:
    main()
except SystemExit as exc:
    code = exc.code
else:
    code = 0
print(json.dumps([code, sorted(m for m in ("numpy", "torch", "obstore") if m in sys.modules)]), file=sys.stderr)
"""


def loaded(args: list[str], store: Path | None = None) -> tuple[int, list[str]]:
    env = dict(os.environ, **({"TAILOR_STORE": str(store)} if store else {}))
    done = subprocess.run([sys.executable, "-c", PROBE, json.dumps(args)], capture_output=True, text=True, env=env)
    code, modules = json.loads(done.stderr.strip().splitlines()[-1])
    return code or 0, modules


@pytest.mark.parametrize("args", [["--help"], ["--version"], ["log", "--help"]])
def test_help_and_version_load_no_numpy_or_torch(args: list[str]) -> None:
    assert loaded(args) == (0, [])


def test_listing_showing_and_tagging_load_no_numpy(small_store: Path, tmp_path: Path) -> None:
    store = copy_tree(small_store, tmp_path / "store")
    for args in (["log"], ["show", "latest"], ["tag", "latest", "warm"], ["log", "--json"], ["untag", "warm"]):
        assert loaded(args, store) == (0, []), args


def test_the_api_default_shard_size_is_the_writers() -> None:
    """api.py spells the default out so that opening a store loads no safetensors writer."""
    import inspect

    from tailorstore import Store
    from tailorstore.formats.safetensors_writer import DEFAULT_SHARD_SIZE

    assert inspect.signature(Store.export).parameters["max_shard_size"].default == DEFAULT_SHARD_SIZE


@pytest.mark.parametrize("command", [["log"], ["log", "--json"], ["show", "latest"], ["tag", "latest", "x"], ["gc"]])
def test_light_commands_import_neither_torch_nor_deepspeed(tmp_path: Path, command: list[str]) -> None:
    """What `tailor log` costs is what users feel: it must not pay for importing torch (2 s)."""
    Repository.init(tmp_path / "store").close()
    probe = (
        "import sys\n"
        "from tailorstore.cli.app import app\n"
        "try:\n"
        f"    app({[*command, '--store', str(tmp_path / 'store')]!r})\n"
        "except BaseException:  # an empty store: show and tag refuse, which is fine here\n"
        "    pass\n"
        "print(sorted(m for m in ('torch', 'deepspeed', 'transformers') if m in sys.modules))\n"
    )
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert proc.stdout.strip().splitlines()[-1] == "[]", proc.stdout + proc.stderr
