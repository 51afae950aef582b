"""The tree shows the architecture: each folder of tailorstore/ is a layer, and imports only
point down (DEVELOPERS.md; docs/ARCHITECTURE.md draws it).

    core  <-  formats, store  <-  access  <-  ingest, restore, curate, report  <-  api  <-  integrations  <-  cli

formats and store know nothing of each other (a store never reads an input format); the verb
packages never import each other (the pure rules they share are in core; the api composes them). The test
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
SIDEWAYS: set[tuple[str, str]] = set()  # none: the rules the verbs share live in core (core/step_rules.py)


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


def _outside_store() -> list[Path]:
    extra = [p.relative_to(ROOT) for p in (ROOT / "benchmarks").rglob("*.py")]
    return [p for p in sources() + extra if p.parts[:2] != ("tailorstore", "store")]


DCP_ITEMS = {"tailorstore/integrations/dcp_writer.py"}  # where ``item`` and ``result`` are DCP's own


def test_the_index_is_private_to_the_store() -> None:
    """Above store/, the index is reached only as ``catalogue`` (queries) and inside
    ``transaction()`` (changes); no module imports it, names ``.index`` or runs SQL."""
    wrong = []
    for path in _outside_store():
        text = (ROOT / path).read_text()
        for line, module in imports(path):
            sql = module == "sqlite3" and path.parts[0] != "benchmarks"  # build_thousand fabricates a fixture
            if module.startswith("tailorstore.store.index._index") or sql:
                wrong.append(f"{path}:{line}: imports {module}")
        tree = ast.parse(text)
        called = {id(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call)}  # list.index(x) is no index
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in ("index", "_index", "conn") and id(node) not in called:
                if str(path) in DCP_ITEMS and isinstance(node.value, ast.Name) and node.value.id in ("item", "result"):
                    continue  # DCP's WriteItem.index and WriteResult.index: its MetadataIndex, not ours
                wrong.append(f"{path}:{node.lineno}: .{node.attr}")
    assert not wrong, "\n".join(wrong)


def test_operations_ask_only_what_the_catalogue_declares() -> None:
    """Every method called on ``<x>.catalogue`` or on a transaction's handle is one the
    protocols declare, and the index implements every one of them."""
    from tailorstore.store.index._index import Index
    from tailorstore.store.index.catalogue import Catalogue, CatalogueEdit

    declared_reads = {n for n in dir(Catalogue) if not n.startswith("_")}
    declared = {n for n in dir(CatalogueEdit) if not n.startswith("_")}
    assert declared_reads < declared
    assert all(callable(getattr(Index, n, None)) or isinstance(getattr(Index, n, None), property) for n in declared)
    wrong = []
    for path in _outside_store():
        tree = ast.parse((ROOT / path).read_text())
        handles = {  # names bound by ``with <x>.transaction() as NAME`` and ``def rows(NAME: CatalogueEdit)``
            item.optional_vars.id
            for node in ast.walk(tree)
            if isinstance(node, ast.With)
            for item in node.items
            if isinstance(item.optional_vars, ast.Name)
            and isinstance(item.context_expr, ast.Call)
            and isinstance(item.context_expr.func, ast.Attribute)
            and item.context_expr.func.attr == "transaction"
        } | {
            a.arg
            for node in ast.walk(tree)
            if isinstance(node, ast.FunctionDef)
            for a in node.args.args
            if isinstance(a.annotation, ast.Name) and a.annotation.id in ("Catalogue", "CatalogueEdit")
        }
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute):
                continue
            owner = node.value
            on_catalogue = isinstance(owner, ast.Attribute) and owner.attr == "catalogue"
            on_handle = isinstance(owner, ast.Name) and owner.id in handles
            allowed = declared_reads if on_catalogue else declared
            if (on_catalogue or on_handle) and node.attr not in allowed:
                wrong.append(f"{path}:{node.lineno}: .{node.attr} is not declared")
    assert not wrong, "\n".join(wrong)


def test_every_lock_timeout_defaults_to_the_one_constant() -> None:
    """Issue 49: one convention per concern. Every function and method of the library and the CLI
    that takes ``lock_timeout`` waits ``LOCK_TIMEOUT`` unless told otherwise (merge and averaging
    once hard-coded 60 s, and the 600 s default was written out in nine places)."""
    import ast

    from tailorstore import LOCK_TIMEOUT

    found, wrong = 0, []
    for path in [*Path("tailorstore").rglob("*.py"), *Path("cli").rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            args = node.args
            named = [*args.posonlyargs, *args.args]
            pairs = list(zip(named[len(named) - len(args.defaults) :], args.defaults, strict=True))
            pairs += [(a, d) for a, d in zip(args.kwonlyargs, args.kw_defaults, strict=True) if d is not None]
            for arg, default in pairs:
                if arg.arg != "lock_timeout":
                    continue
                found += 1
                text = ast.unparse(default)
                if text not in ("LOCK_TIMEOUT", "LockOpt"):
                    wrong.append(f"{path}:{node.lineno} {node.name}(lock_timeout={text})")
    assert found > 20 and not wrong, wrong
    assert LOCK_TIMEOUT == 600.0


def test_the_integrations_share_one_set_of_rank_helpers() -> None:
    """Issue 49: the rank lookup, the broadcast and the reading of LOCAL_WORLD_SIZE were each defined
    two or three times, with different caps and failure semantics. integrations/ranks.py holds them;
    no other integration module defines its own or reads the environment for them."""
    found = []
    for path in sorted((ROOT / "tailorstore" / "integrations").rglob("*.py")):
        if path.name == "ranks.py":
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and node.name.lstrip("_") in (
                "rank", "distributed", "is_distributed", "from_rank0_value", "barrier", "gathered", "local_world_size",
                "local", "node_ranks", "is_leader", "broadcast", "tailor_group", "collective_timeout",
            ):  # fmt: skip
                found.append(f"{path.name}:{node.lineno}: defines {node.name}")
            if isinstance(node, ast.Constant) and node.value in ("LOCAL_RANK", "LOCAL_WORLD_SIZE"):
                found.append(f"{path.name}:{node.lineno}: reads {node.value}")
            if (
                isinstance(node, ast.Attribute)
                and node.attr in ("is_initialized", "is_available")
                and isinstance(node.value, ast.Name)
                and node.value.id == "dist"
            ):
                found.append(f"{path.name}:{node.lineno}: asks torch.distributed {node.attr}")
    assert not found, "\n".join(found)


def test_the_integrations_take_their_options_by_name() -> None:
    """Issue 49: TailorCallback took its policy by position, where attach and the DeepSpeed helpers
    take every option by name. Each entry point's options (after the engine or store, the folder and
    the ref) are keyword-only, so an option cannot be passed in the wrong place."""
    import inspect

    from tailorstore.integrations import deepspeed, distributed, hf

    positional = {"self", "engine", "store", "save_dir", "tag", "ref", "path"}
    entry_points = [
        hf.TailorCallback.__init__, deepspeed.attach, deepspeed.load_checkpoint, deepspeed.save_checkpoint,
        distributed.commit_rank_parallel,
    ]  # fmt: skip
    found = []
    for function in entry_points:
        for name, parameter in inspect.signature(function).parameters.items():
            if parameter.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD and name not in positional:
                found.append(f"{function.__qualname__}({name})")
    assert not found, found


def _alternatives(annotation: str) -> list[str]:
    """The types a return annotation joins with ``|`` at its top level, None left out."""
    depth, current, found = 0, "", []
    for char in annotation:
        depth += 1 if char in "[(" else -1 if char in "])" else 0
        if char == "|" and depth == 0:
            found.append(current.strip())
            current = ""
        else:
            current += char
    found.append(current.strip())
    return [kind for kind in found if kind != "None"]


def test_every_public_method_returns_one_type() -> None:
    """Issue 49: ``save_checkpoint`` returned a future, a result or None, and ``checkout`` one of three
    results, so each caller needed cases (the CLI a ``type: ignore``). A method of ``Store`` and an
    integration's entry point returns one type (or None where there may be nothing: a lookup)."""
    import inspect

    from tailorstore.api import Store
    from tailorstore.integrations import dcp_storage, dcp_writer, deepspeed, distributed, hf

    public = [function for name, function in inspect.getmembers(Store, inspect.isfunction) if not name.startswith("_")]
    entry_points = [
        deepspeed.attach, deepspeed.load_checkpoint, deepspeed.save_checkpoint, distributed.commit_rank_parallel,
        *(f for _, f in inspect.getmembers(hf.TailorCallback, inspect.isfunction)),
        *(f for _, f in inspect.getmembers(dcp_storage.TailorStorageReader, inspect.isfunction)),
        *(f for _, f in inspect.getmembers(dcp_writer.TailorStorageWriter, inspect.isfunction)),
    ]  # fmt: skip
    assert len(public) > 30
    found = []
    for function in [*public, *entry_points]:
        annotation = inspect.signature(function).return_annotation
        if isinstance(annotation, str) and len(_alternatives(annotation)) > 1:
            found.append(f"{function.__qualname__} -> {annotation}")
    assert not found, found


def test_an_option_has_one_default_in_the_api_and_every_integration() -> None:
    """Issue 49: ``delete_after_commit`` defaulted to True in DeepSpeed's ``save_checkpoint`` alone.
    Each option the API and the integrations share has one default, the API's: here, to delete
    nothing unless asked."""
    import dataclasses
    import inspect

    from tailorstore.ingest.commit_options import CommitRequest
    from tailorstore.integrations import deepspeed, hf

    api = {f.name: f.default for f in dataclasses.fields(CommitRequest) if f.default is not dataclasses.MISSING}
    found = []
    for function in (deepspeed.save_checkpoint, deepspeed.attach, hf.TailorCallback.__init__):
        for name, parameter in inspect.signature(function).parameters.items():
            if name in api and parameter.default is not inspect.Parameter.empty and parameter.default != api[name]:
                found.append(f"{function.__qualname__}({name}={parameter.default!r}), the API's is {api[name]!r}")
    assert not found, found


def test_no_integration_reaches_through_the_store_handle() -> None:
    """Issue 49: the integrations used ``store.repo`` for locks, refresh, part keys and the
    rank-parallel plan. They now call ``Store`` methods only (``commit_together``, ``holds``,
    ``in_run``, ``parts``, ``delete_once_durable``); the protocol of a rank-parallel commit lives
    in ``ingest/rank_parallel.py``, and ``integrations/distributed.py`` is its torch.distributed glue."""
    found = []
    for path in sorted((ROOT / "tailorstore" / "integrations").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr == "repo":
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: .repo")
    assert not found, "\n".join(found)


def test_the_store_keeps_its_concerns_in_sub_packages() -> None:
    """Issue 49: store/ held 23 modules of four concerns side by side. The backends, the index and
    the packs are sub-packages; what stays on store/'s own level is the repository and publication
    (manifest objects, parts, publish, leases, locks, gc notices) and the codecs."""
    store = ROOT / "tailorstore" / "store"
    assert {p.name for p in store.iterdir() if p.is_dir() and p.name != "__pycache__"} == {"backends", "index", "packs"}
    assert (store / "backends" / "base.py").is_file() and (store / "index" / "_index.py").is_file()
    top = sorted(p.stem for p in store.glob("*.py") if p.stem != "__init__")
    assert len(top) <= 10, top
