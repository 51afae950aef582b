"""Every third-party package the tests, the test bed and the library import is declared and pinned:
a fresh machine's virtualenv resolves what CI resolved, or a missing pin fails here, not on a
user's machine (an unpinned ``pytest`` became 9 there; ``hypothesis`` was declared nowhere)."""

from __future__ import annotations

import ast
import re
import sys
from importlib import metadata
from pathlib import Path

from tests.conftest import REPO_ROOT as ROOT

# imported only where they exist (a GPU, an optional benchmark); each test that needs one skips without it
OPTIONAL = {"zipnn", "playwright", "selenium", "atheris", "memray", "cupy", "apex", "triton"}


def _imported_top_levels(folders: list[Path]) -> set[str]:
    names: set[str] = set()
    for folder in folders:
        for path in folder.rglob("*.py"):
            if "data" in path.relative_to(ROOT).parts:
                continue  # test data: scripts DeepSpeed copies into a save
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    names.update(alias.name.split(".")[0] for alias in node.names)
                elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    names.add(node.module.split(".")[0])
    return names


def _pins() -> set[str]:
    lines = (ROOT / "constraints.txt").read_text().splitlines()
    found = (re.match(r"^([A-Za-z0-9_.-]+)==", line.strip()) for line in lines)
    return {_normal(m.group(1)) for m in found if m}


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_every_imported_package_is_pinned_in_constraints() -> None:
    local = {"tailorstore", "testbed", "examples", "benchmarks", "tests", "cli"}  # tests.conftest, tests.system...
    modules = _imported_top_levels([ROOT / "tests", ROOT / "testbed", ROOT / "tailorstore", ROOT / "cli"])
    third_party = {m for m in modules if m not in sys.stdlib_module_names and m not in local and m not in OPTIONAL}
    distributions = metadata.packages_distributions()
    pins = _pins()
    unpinned = {}
    for module in sorted(third_party):
        owners = distributions.get(module)
        if not owners:
            unpinned[module] = "installed by no distribution here"
            continue
        if not any(_normal(d) in pins for d in owners):
            unpinned[module] = f"from {owners}, not in constraints.txt"
    # what a test imports only through another package (tests and the test bed) is pinned by that package
    transitive = {"pytest", "_pytest"}
    unpinned = {m: why for m, why in unpinned.items() if m not in transitive}
    assert not unpinned, f"imported but not pinned: {unpinned}"


def test_the_test_runner_and_its_plugins_are_pinned_and_declared() -> None:
    pins = _pins()
    pyproject = (ROOT / "pyproject.toml").read_text()
    for name in ("pytest", "pytest-timeout", "hypothesis", "ruff"):
        assert name in pins, f"{name} is not pinned in constraints.txt"
        assert f'"{name}>=' in pyproject, f"{name} is not declared in pyproject.toml's dev extra"
