"""The tree shows the architecture: each folder of tailorstore/ is a layer, and imports only
point down (DEVELOPERS.md; docs/ARCHITECTURE.md draws it).

    core  <-  formats, store  <-  access  <-  ingest, restore, curate, report  <-  api  <-  integrations  <-  cli

formats and store know nothing of each other (a store never reads an input format); the verb
packages may use curate's names (refs, thinning, gc), and nothing else sideways. The test
reads every import statement, at module level and inside functions, so a lazy import that
points up is caught as well.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RANK = {
    "core": 0,
    "formats": 1,
    "store": 1,
    "access": 2,
    "ingest": 3,
    "restore": 3,
    "curate": 3,
    "report": 3,
    "api": 4,  # tailorstore/api.py, background.py and __init__.py: the public face
    "integrations": 5,
    "cli": 6,
}
SIDEWAYS = {("ingest", "curate"), ("restore", "curate"), ("report", "curate")}


def layer_of_module(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "tailorstore":
        return None
    if len(parts) == 1 or parts[1] in ("api", "background", "atoms"):
        return "api" if len(parts) == 1 or parts[1] != "atoms" else "core"
    return parts[1] if parts[1] in RANK else None


def layer_of_file(path: Path) -> str:
    if path.parts[0] == "cli":
        return "cli"
    rel = path.relative_to("tailorstore")
    if len(rel.parts) == 1:
        return "core" if rel.stem == "atoms" else "api"
    return rel.parts[0]


def imports(path: Path) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse((ROOT / path).read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.append((node.lineno, node.module))
            found += [(node.lineno, f"{node.module}.{a.name}") for a in node.names if node.module == "tailorstore"]
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
    return found


def sources() -> list[Path]:
    return sorted(p.relative_to(ROOT) for folder in ("tailorstore", "cli") for p in (ROOT / folder).rglob("*.py"))


def test_every_import_points_down_or_to_an_allowed_neighbour() -> None:
    wrong = []
    for path in sources():
        mine = layer_of_file(path)
        for line, module in imports(path):
            theirs = layer_of_module(module)
            if theirs is None or theirs == mine:
                continue
            if RANK[theirs] < RANK[mine] or (mine, theirs) in SIDEWAYS:
                continue
            wrong.append(f"{path}:{line}: {mine} imports {module} ({theirs})")
    assert not wrong, "\n".join(wrong)


def test_no_relative_imports_and_no_module_left_on_the_top_level() -> None:
    """Absolute imports say which layer a name comes from; the top level holds only the public face."""
    top = sorted(p.name for p in (ROOT / "tailorstore").glob("*.py"))
    assert top == ["__init__.py", "api.py", "atoms.py", "background.py"], top
    relative = [
        f"{path}:{node.lineno}"
        for path in sources()
        for node in ast.walk(ast.parse((ROOT / path).read_text()))
        if isinstance(node, ast.ImportFrom) and node.level
    ]
    assert not relative, relative
