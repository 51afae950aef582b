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
import functools
import io
import re
import tokenize
from pathlib import Path

from tests.conftest import REPO_ROOT as ROOT


@functools.cache
def _parsed(path: str) -> ast.Module:
    return ast.parse(Path(path).read_text(encoding="utf-8"))


def _tree(path: Path) -> ast.Module:
    """A module's syntax tree, parsed once for the whole file's tests (no test changes a tree)."""
    return _parsed(str(path))


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
    for node in ast.walk(_tree(ROOT / path)):
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
        for node in ast.walk(_tree(ROOT / path))
        if isinstance(node, ast.ImportFrom) and node.level
    ]
    assert not relative, relative


def _outside_store() -> list[Path]:
    extra = [p.relative_to(ROOT) for p in (ROOT / "benchmarks").rglob("*.py")]
    return [p for p in sources() + extra if p.parts[:2] != ("tailorstore", "store")]


DCP_ITEMS = {"tailorstore/integrations/dcp/writer.py"}  # where ``item`` and ``result`` are DCP's own


def test_the_index_is_private_to_the_store() -> None:
    """Above store/, the index is reached only as ``catalogue`` (queries) and inside
    ``transaction()`` (changes); no module imports it, names ``.index`` or runs SQL."""
    wrong = []
    for path in _outside_store():
        text = (ROOT / path).read_text()
        for line, module in imports(path):
            sql = module == "sqlite3" and path.parts[0] != "benchmarks"  # build_thousand fabricates a fixture
            if module.startswith(("tailorstore.store.index._index", "tailorstore.store.index.catalogue")) or sql:
                wrong.append(f"{path}:{line}: imports {module}")
        tree = ast.parse(text)
        called = {id(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call)}  # list.index(x) is no index
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and node.attr in ("index", "_index", "conn", "catalogue")
                and id(node) not in called
            ):
                if str(path) in DCP_ITEMS and isinstance(node.value, ast.Name) and node.value.id in ("item", "result"):
                    continue  # DCP's WriteItem.index and WriteResult.index: its MetadataIndex, not ours
                wrong.append(f"{path}:{node.lineno}: .{node.attr}")
    assert not wrong, "\n".join(wrong)


def _module_name(path: Path) -> str:
    return ".".join(path.with_suffix("").parts)


def _role_named(module: object, node: ast.expr) -> type | None:
    """The class an expression in ``module`` names (``Contents``, ``structure.ModelShape``)."""
    if isinstance(node, ast.Name):
        found = getattr(module, node.id, None)
    elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
        found = getattr(getattr(module, node.value.id, None), node.attr, None)
    else:
        return None
    return found if isinstance(found, type) else None


class _RoleUse(ast.NodeVisitor):
    """Which names each function binds to a role view, and every attribute asked of one. A name is
    bound by ``x = <h>.view(Role)``, ``with <h>.transaction(Role) as x`` or a parameter annotated
    with a role; ``<h>.view(Role).method`` asks directly. Nested functions see their parents'."""

    def __init__(self, module: object, roles: set[type]) -> None:
        self.module, self.roles = module, roles
        self.scopes: list[dict[str, type]] = [{}]
        self.asked: list[tuple[int, type, str]] = []
        self.calls: list[tuple[int, str, list[ast.expr]]] = []

    def _role_of_call(self, node: ast.expr) -> type | None:
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if node.func.attr in ("view", "transaction") and len(node.args) == 1:
                role = _role_named(self.module, node.args[0])
                return role if role in self.roles else None
        return None

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        bound = dict(self.scopes[-1])
        for arg in [*node.args.args, *node.args.kwonlyargs]:
            role = _role_named(self.module, arg.annotation) if arg.annotation is not None else None
            if role in self.roles:
                bound[arg.arg] = role
            else:
                bound.pop(arg.arg, None)
        for inner in ast.walk(node):
            if isinstance(inner, ast.Assign) and len(inner.targets) == 1 and isinstance(inner.targets[0], ast.Name):
                if (role := self._role_of_call(inner.value)) is not None:
                    bound[inner.targets[0].id] = role
            elif isinstance(inner, ast.With):
                for item in inner.items:
                    if isinstance(item.optional_vars, ast.Name) and (role := self._role_of_call(item.context_expr)):
                        bound[item.optional_vars.id] = role
        self.scopes.append(bound)
        self.generic_visit(node)
        self.scopes.pop()

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Call(self, node: ast.Call) -> None:
        if isinstance(node.func, ast.Attribute) and node.func.attr in ("view", "transaction"):
            self.calls.append((node.lineno, node.func.attr, node.args))
        self.generic_visit(node)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        owner = node.value
        if isinstance(owner, ast.Name) and owner.id in self.scopes[-1]:
            self.asked.append((node.lineno, self.scopes[-1][owner.id], node.attr))
        elif (role := self._role_of_call(owner)) is not None:
            self.asked.append((node.lineno, role, node.attr))
        self.generic_visit(node)


def _roles_in(module: object) -> set[type]:
    from tailorstore.store.index.catalogue import CatalogueEdit
    from tailorstore.store.index.roles import members

    declared = {n for n in dir(CatalogueEdit) if not n.startswith("_")}
    found = set()
    for value in vars(module).values():
        if isinstance(value, type) and getattr(value, "_is_protocol", False) and members(value) <= declared:
            found.add(value)
        elif type(value).__name__ == "module" and value.__name__.startswith("tailorstore."):
            found |= {v for v in vars(value).values() if isinstance(v, type) and getattr(v, "_is_protocol", False)}
    return {r for r in found if members(r) and members(r) <= declared}


def test_each_operation_sees_the_index_only_through_its_small_role() -> None:
    """Each operation declares the protocol of index methods it uses (at most eight),
    asks the repository for that view, and calls nothing else on it. No role names what only
    the publisher does (insert a manifest's rows, set its tier or metrics)."""
    import importlib

    from tailorstore.store.index.roles import MOST_METHODS, PUBLISHING, members

    wrong, used = [], set()
    for path in _outside_store():
        module = importlib.import_module(_module_name(path))
        roles = _roles_in(module)
        visitor = _RoleUse(module, roles)
        visitor.visit(_tree(ROOT / path))
        for line, what, args in visitor.calls:  # a tensor's .view(dtype) names no class: not ours
            named = _role_named(module, args[0]) if len(args) == 1 else None
            protocol = getattr(named, "_is_protocol", False)  # numpy's .view(np.uint32) names a class too
            if (what == "transaction" and named not in roles) or (protocol and named not in roles):
                wrong.append(f"{path}:{line}: .{what}() names no role of the index")
        for line, role, name in visitor.asked:
            used.add(role)
            if name not in members(role):
                wrong.append(f"{path}:{line}: .{name} is not in {role.__name__}")
    for role in used:
        if len(members(role)) > MOST_METHODS:
            wrong.append(f"{role.__module__}.{role.__name__} names {len(members(role))} methods")
        if members(role) & PUBLISHING:
            wrong.append(f"{role.__module__}.{role.__name__} names {sorted(members(role) & PUBLISHING)}")
    assert not wrong, "\n".join(wrong)
    assert len(used) >= 15, sorted(r.__name__ for r in used)  # the roles are found, not skipped


def test_a_role_view_answers_only_its_own_methods(tmp_path: Path) -> None:
    """At run time, not just in this file: a role view is not the index, and refuses the rest."""
    import pytest

    from tailorstore.access.contents import Contents
    from tailorstore.curate.gc import GcDrop
    from tailorstore.store.repo import Repository

    Repository.init(str(tmp_path / "store")).close()
    repo = Repository.open(str(tmp_path / "store"))
    try:
        contents = repo.view(Contents)
        assert contents.files(1) == []
        for name in ("insert_manifest", "delete_blobs", "manifests", "conn", "transaction"):
            with pytest.raises(AttributeError, match="Contents offers no"):
                getattr(contents, name)
        with repo.transaction(GcDrop) as edit:
            edit.delete_blobs([])
            with pytest.raises(AttributeError, match="GcDrop offers no"):
                edit.insert_manifest  # noqa: B018
    finally:
        repo.close()


def _backend_roles() -> set[type]:
    from tailorstore.store.backends import roles

    return {v for v in vars(roles).values() if isinstance(v, type) and getattr(v, "_is_protocol", False)}


def test_above_the_store_the_backend_is_reached_only_through_a_role() -> None:
    """The backend can delete anything: no module above store/ names ``.backend``; each asks the
    repository for the roles it uses (``repo.objects(Role)``), a protocol made of
    store/backends/roles.py's roles, and its helpers say in their signatures which they take."""
    import importlib

    from tailorstore.core.roles import members
    from tailorstore.store.backends import roles as role_module
    from tailorstore.store.backends.base import Backend

    roles, whole = _backend_roles(), members(Backend)
    wrong, asked = [], 0
    for path in _outside_store():
        if path.parts[0] == "benchmarks":
            continue  # the harness's own argparse ``args.backend``, not a store's
        tree = _tree(ROOT / path)
        module = importlib.import_module(_module_name(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr == "backend":
                wrong.append(f"{path}:{node.lineno}: .backend")
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "objects"
                and len(node.args) == 1
                and isinstance(node.args[0], ast.Name)
            ):
                asked += 1
                name = node.args[0].id  # imported at the top, or inside the function from the roles module
                role = getattr(module, name, None) or getattr(role_module, name, None)
                if not (isinstance(role, type) and any(r in role.__mro__ for r in roles) and members(role) <= whole):
                    wrong.append(f"{path}:{node.lineno}: .objects({name}) names no role of the backend")
    assert not wrong, "\n".join(wrong)
    assert asked >= 10, asked  # the check looked at the calls it is about


def test_a_backend_role_view_answers_only_its_own_names(tmp_path: Path) -> None:
    """At run time: a reader cannot delete, a remover cannot read."""
    import pytest

    from tailorstore.store.backends.roles import Reader, Remover
    from tailorstore.store.repo import Repository

    Repository.init(str(tmp_path / "store")).close()
    repo = Repository.open(str(tmp_path / "store"))
    try:
        reader = repo.objects(Reader)
        assert reader.exists("tailorstore.json") and reader.location.endswith("store")
        for name in ("delete", "delete_many", "put", "batch", "list", "clear_leftovers"):
            with pytest.raises(AttributeError, match="Reader offers no"):
                getattr(reader, name)
        with pytest.raises(AttributeError, match="Remover offers no"):
            repo.objects(Remover).get  # noqa: B018
    finally:
        repo.close()


def test_every_lock_timeout_defaults_to_the_one_constant() -> None:
    """One convention per concern. Every function and method of the library and the CLI
    that takes ``lock_timeout`` waits ``LOCK_TIMEOUT`` unless told otherwise (merge and averaging
    once hard-coded 60 s, and the 600 s default was written out in nine places)."""
    import ast

    from tailorstore import LOCK_TIMEOUT

    found, wrong = 0, []
    for path in [*Path("tailorstore").rglob("*.py"), *Path("cli").rglob("*.py")]:
        for node in ast.walk(_tree(path)):
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


def test_the_failpoints_sleep_cap_is_named_once() -> None:
    """The house, third step: the 600 s cap on a failpoint's sleep was written out twice (the
    docstring and the check). It is ``failpoints.LONGEST_SLEEP``, and no module of the library or
    the CLI writes 600 as a number but the two constants that mean it (that and ``LOCK_TIMEOUT``)."""
    from tailorstore.core import failpoints

    found = {}
    for path in sources():
        text = (ROOT / path).read_text()
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Constant) and type(node.value) in (int, float) and node.value == 600:
                found[f"{path}:{node.lineno}"] = text.splitlines()[node.lineno - 1].split("=")[0].strip()
    assert sorted(found.values()) == ["LOCK_TIMEOUT", "LONGEST_SLEEP"], found
    assert failpoints.LONGEST_SLEEP == 600.0 and "600" not in (failpoints.__doc__ or "")


def test_the_integrations_share_one_set_of_rank_helpers() -> None:
    """The rank lookup, the broadcast and the reading of LOCAL_WORLD_SIZE were each defined
    two or three times, with different caps and failure semantics. integrations/common/ranks.py holds them;
    no other integration module defines its own or reads the environment for them."""
    found = []
    for path in sorted((ROOT / "tailorstore" / "integrations").rglob("*.py")):
        if path.name in ("ranks.py", "session.py"):  # the helpers, and the one session built over them
            continue
        tree = _tree(path)
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
    """TailorCallback took its policy by position, where attach and the DeepSpeed helpers
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
    """``save_checkpoint`` returned a future, a result or None, and ``checkout`` one of three
    results, so each caller needed cases (the CLI a ``type: ignore``). A method of ``Store`` and an
    integration's entry point returns one type (or None where there may be nothing: a lookup)."""
    import inspect

    from tailorstore.api import Store
    from tailorstore.integrations import dcp_storage, dcp_writer, deepspeed, distributed, hf
    from tailorstore.integrations.common import StoreSession

    public = [
        function
        for kind in (Store, StoreSession)  # the user's surface and the adapters' seam alike
        for name, function in inspect.getmembers(kind, inspect.isfunction)
        if not name.startswith("_")
    ]
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
    """``delete_after_commit`` defaulted to True in DeepSpeed's ``save_checkpoint`` alone.
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


SEAM = ROOT / "tailorstore" / "integrations" / "common" / "store_session.py"
STORE_INSIDES = {"repo", "_options", "_background", "_selector", "_queue"}  # what the seam alone reaches


def test_no_integration_reaches_through_the_store_handle() -> None:
    """The integrations used ``store.repo`` for locks, refresh, part keys and the
    rank-parallel plan. They call the ``Store``'s methods and the seam's (``StoreSession``:
    ``commit_together``, ``holds``, ``in_run``, ``parts``, ``delete_once_durable``...); the protocol
    of a rank-parallel commit lives in ``ingest/rank_parallel.py``, and
    ``integrations/common/distributed.py`` is its torch.distributed glue. Only the seam itself
    (``integrations/common/store_session.py``) reaches the handle's repository, its queue and how it
    builds a commit's options."""
    found = []
    for path in sorted((ROOT / "tailorstore" / "integrations").rglob("*.py")):
        if path == SEAM:
            continue
        for node in ast.walk(_tree(path)):
            if isinstance(node, ast.Attribute) and node.attr in STORE_INSIDES:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: .{node.attr}")
    assert not found, "\n".join(found)


# The Store's public methods: the user's set, what the ``tailor`` command, the README and docs/API.md
# show users. Ten more (commit_memory, plan_parts, commit_together, parts, in_run, holds,
# delete_once_durable, background, open_dcp, step_objects) were called only by integrations/; they are
# the seam's, ``StoreSession``'s (integrations/common/store_session.py).
USER_METHODS = {
    "init", "open", "rebuild_index", "flush", "close",
    "commit", "commit_async", "finalize",
    "checkout", "checkout_universal", "export",  # checkout(world_size=N): the one way to another world size
    "log", "step", "show", "files", "diff", "plot", "report", "usage", "verify",
    "runs", "create_run", "set_retention", "retention",
    "gc", "merge", "tag", "untag", "pin", "unpin", "remove", "add_metrics",
}  # fmt: skip


def test_the_store_is_the_users_surface_and_the_adapters_have_one_seam() -> None:
    """The house, third step: ``Store`` had 42 public methods, ten of them called by integrations/
    alone, so nothing told a user's call from an adapter's. The Store keeps the user's set, each
    shown to users (docs/API.md or the README names it, or the ``tailor`` command calls it); what
    only adapters call is ``StoreSession``'s, which offers exactly its ``OPERATIONS``, none of them
    a Store method too. An adapter asks a ``StoreSession`` for nothing else."""
    from tailorstore.api import Store
    from tailorstore.integrations.common import StoreSession
    from tailorstore.integrations.common.store_session import OPERATIONS

    members = vars(Store).items()
    public = {name for name, value in members if not name.startswith("_") and not isinstance(value, property)}
    # ``report`` (the history page, one HTML file) joined the reading verbs; ``plot`` stays, its PNG
    # drawn from the same change matrix as the page's layers part; ``checkout_resharded`` went
    # (``checkout(world_size=N)`` is the one way)
    assert public == USER_METHODS and len(public) <= 32, sorted(public ^ USER_METHODS)
    shown = (ROOT / "docs" / "API.md").read_text() + (ROOT / "README.md").read_text()
    called = "".join(p.read_text() for p in (ROOT / "cli").rglob("*.py"))
    unshown = sorted(n for n in public if f"{n}(" not in shown and f".{n}(" not in called)
    assert not unshown, unshown
    offered = {name for name in vars(StoreSession) if not name.startswith("_")}
    assert offered == OPERATIONS and not OPERATIONS & set(dir(Store)), sorted(offered ^ OPERATIONS)
    asked = []
    for path in sorted((ROOT / "tailorstore" / "integrations").rglob("*.py")):
        for node in ast.walk(_tree(path)):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Call):
                func = node.value.func
                if isinstance(func, ast.Name) and func.id == "StoreSession" and node.attr not in OPERATIONS | {"store"}:
                    asked.append(f"{path.relative_to(ROOT)}:{node.lineno}: StoreSession(...).{node.attr}")
    assert not asked, "\n".join(asked)


def _allowed_from_the_api(module: str) -> bool:
    """``tailorstore`` and the names it exports, ``tailorstore.api``, the shared ground floor
    ``tailorstore.core`` (errors, policies, rules, local files), and the adapters' own modules."""
    import tailorstore

    parts = module.split(".")
    if parts[0] != "tailorstore" or len(parts) == 1:
        return True
    if len(parts) == 2 and parts[1] in tailorstore.__all__:
        return True
    return parts[1] in ("api", "core", "integrations")


def test_the_integrations_reach_the_library_only_through_the_api_and_the_seam() -> None:
    """The house, third step: the adapters imported the formats, ingest, restore and the store's index
    records wherever they needed one. Now an adapter module imports the public API (``tailorstore``,
    ``tailorstore.api``), ``tailorstore.core`` and other adapter modules; what it needs below the
    API comes through the one seam, ``integrations/common/store_session.py``, the only module of
    integrations/ that imports formats, ingest, restore or store."""
    wrong = []
    for path in sorted((ROOT / "tailorstore" / "integrations").rglob("*.py")):
        if path == SEAM:
            continue
        for line, module in imports(path.relative_to(ROOT)):
            if not _allowed_from_the_api(module):
                wrong.append(f"{path.relative_to(ROOT)}:{line}: imports {module}")
    assert not wrong, "\n".join(wrong)
    seam = {module.split(".")[1] for _, module in imports(SEAM.relative_to(ROOT)) if module.startswith("tailorstore.")}
    assert {"formats", "ingest", "restore", "store"} <= seam, seam  # the seam is where they are reached


def _is_error_made(node: ast.AST) -> bool:
    func = node.func if isinstance(node, ast.Call) else None
    name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
    return name.endswith(("Error", "Failed"))


def test_no_integration_flattens_an_error_into_a_string() -> None:
    """The house, third step, item 3: errors cross ranks whole, through the rank session
    (``RanksFailedError``; any other exception as a ``RankError`` holding it), never as text. In
    integrations/, an error built inside an ``except ... as exc`` that names ``exc`` is raised
    ``from exc``, so the exception itself stays with it; no error is made of its words alone."""
    found = []
    for path in sorted((ROOT / "tailorstore" / "integrations").rglob("*.py")):
        for handler in ast.walk(_tree(path)):
            if not isinstance(handler, ast.ExceptHandler) or handler.name is None:
                continue
            chained = set()
            for node in ast.walk(ast.Module(body=handler.body, type_ignores=[])):
                cause = getattr(node, "cause", None)
                if isinstance(node, ast.Raise) and isinstance(cause, ast.Name) and cause.id == handler.name:
                    chained.add(id(node.exc))
            for node in ast.walk(ast.Module(body=handler.body, type_ignores=[])):
                if not isinstance(node, ast.Call) or not _is_error_made(node) or id(node) in chained:
                    continue
                given = [*node.args, *(k.value for k in node.keywords)]
                names = {n.id for arg in given for n in ast.walk(arg) if isinstance(n, ast.Name)}
                if handler.name in names:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)[:100]}")
    assert not found, "errors made of another error's text:\n" + "\n".join(found)


def test_the_store_keeps_its_concerns_in_sub_packages() -> None:
    """``store/`` held 23 modules of four concerns side by side. The backends, the index, the
    packs and the manifest objects (one module a job: keys, document, objects, refs, drop marks, runs,
    sync) are sub-packages; what stays on store/'s own level is the repository and publication
    (parts, publish, leases, locks, gc notices) and the codecs."""
    store = ROOT / "tailorstore" / "store"
    found = {p.name for p in store.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert found == {"backends", "index", "manifests", "packs"}, found
    assert (store / "backends" / "base.py").is_file() and (store / "index" / "_index.py").is_file()
    top = sorted(p.stem for p in store.glob("*.py") if p.stem != "__init__")
    assert len(top) <= 10, top


STORE_BELOW = {  # store/'s own lower layers: each imports core and these of store/, nothing above them
    "backends": set(),
    "index": set(),
    "packs": {"backends", "index", "codec"},  # codec: store/codec.py, the compression of a blob
}


def _store_imports(path: Path) -> list[tuple[int, str]]:
    """Every tailorstore module ``path`` imports, ``from tailorstore.store import parts`` as
    ``tailorstore.store.parts``."""
    found = []
    for node in ast.walk(_tree(ROOT / path)):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "tailorstore":
            if node.module in ("tailorstore", "tailorstore.store"):
                found += [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
            else:
                found.append((node.lineno, node.module))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "tailorstore"]
    return found


def test_inside_the_store_arrows_point_down_too() -> None:
    """The house, third step: packs/writer.py and packs/failed_writes.py imported ``Repository``,
    backends/listing.py the index's records, publish.py and the writer a rule of backends/posix.py.
    Now the backends import only core; the index only core; packs/ only core, the backends, the
    index and store/codec.py. The writer asks for what it needs of a store (``BlobStore``), the
    records and the names of blobs and packs are core's (core/records.py, core/object_keys.py),
    ``is_out_of_space`` is core/errors.py's, and taking back a failed write is store/failed_writes.py."""
    wrong = []
    for package, below in STORE_BELOW.items():
        for path in sorted((ROOT / "tailorstore" / "store" / package).rglob("*.py")):
            for line, module in _store_imports(path.relative_to(ROOT)):
                parts = module.split(".")
                if parts[1] == "core" or (parts[1] == "store" and len(parts) > 2 and parts[2] in {package, *below}):
                    continue
                wrong.append(f"{path.relative_to(ROOT)}:{line}: {package}/ imports {module}")
    assert not wrong, "\n".join(wrong)


STORE_INTERNALS = {
    "tailorstore.store.manifests.sync": "the index is synced by the repository (Repository.refresh)",
    "tailorstore.store.manifests.document": "manifest objects are encoded and read inside the store",
    "tailorstore.store.backends.s3": "a backend is chosen by its location (store/backends/location.py)",
    "tailorstore.store.packs.writer.BlobStore": "the writer's view of a repository: pass the Repository",
}


def test_above_the_store_no_module_imports_its_internals() -> None:
    """Above store/, the library and the CLI use the store's operations, not its machinery: not the
    sync of the index or the codec of manifest objects, not a backend by its class; the index
    package only for its schema's ``FORMAT_VERSION`` (its queries and changes: the test above).
    What every layer speaks (the records, the names of blobs and packs, run names) is core's, so
    no module outside store/ reaches into the index for it."""
    wrong = []
    for path in _outside_store():
        for line, module in _store_imports(path):
            if module in STORE_INTERNALS or any(f"{module}.{n}" in STORE_INTERNALS for n in _names(path, line)):
                wrong.append(f"{path}:{line}: imports {module} ({STORE_INTERNALS.get(module, 'an internal')})")
            elif module.startswith("tailorstore.store.index") and module != "tailorstore.store.index.schema":
                wrong.append(f"{path}:{line}: imports {module}")
    assert not wrong, "\n".join(wrong)


def _names(path: Path, line: int) -> list[str]:
    """The names a ``from ... import`` statement at ``line`` of ``path`` takes."""
    for node in ast.walk(_tree(ROOT / path)):
        if isinstance(node, ast.ImportFrom) and node.lineno == line:
            return [a.name for a in node.names]
    return []


def test_a_full_disk_is_told_by_one_rule() -> None:
    """Which errnos mean a full disk was written out in backends/posix.py and again in
    access/output_dir.py; publish.py and the blob writer imported it from a backend. One rule,
    ``core.errors.is_out_of_space``: no other module compares an errno with ENOSPC or EDQUOT."""
    wrong = []
    for path in sources():
        if path == Path("tailorstore/core/errors.py"):
            continue
        for node in ast.walk(_tree(ROOT / path)):
            if isinstance(node, ast.Compare):
                named = {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)}
                if named & {"ENOSPC", "EDQUOT"}:
                    wrong.append(f"{path}:{node.lineno}")
    assert not wrong, wrong


def test_a_store_is_a_store_and_a_repository_a_repo() -> None:
    """The public class is ``Store``; the internal ``Repository`` a parameter names ``repo``
    (131 parameters were ``store: Repository``, so a reader could not tell which one a function took)."""
    wrong = []
    for path in sources():
        for node in ast.walk(_tree(ROOT / path)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                for arg in [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]:
                    annotation = ast.unparse(arg.annotation) if arg.annotation is not None else ""
                    if arg.arg == "store" and "Repository" in annotation:
                        wrong.append(f"{path}:{node.lineno}: {node.name}({arg.arg}: {annotation})")
    assert not wrong, "\n".join(wrong)


def test_every_package_of_the_tree_is_installed() -> None:
    """pyproject.toml lists the packages a wheel holds (the CLI's folder is mapped in, so they
    cannot be found automatically). When store/ and the DeepSpeed integration became sub-packages,
    four were missing: an editable install (the tests') found them anyway, and a wheel did not
    (``import tailorstore`` failed on a non-editable install)."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "tailorstore").rglob("__init__.py")}
    assert found | {"tailorstore.cli"} == listed, sorted(found ^ listed)


COLLECTIVES = {
    "all_gather", "all_gather_object", "broadcast", "broadcast_object_list", "barrier", "all_reduce", "reduce",
    "gather", "gather_object", "scatter", "scatter_object_list", "all_to_all", "reduce_scatter", "monitored_barrier",
}  # fmt: skip


def test_every_collective_of_the_integrations_goes_through_the_rank_session() -> None:
    """A choice several ranks act on is made once and shipped (integrations/common/session.py); a rank that
    looked for itself took another load path and deadlocked a restart. So no integration module
    calls a torch.distributed collective, or ranks.py's, except session.py (over ranks.py's)."""
    found = []
    for path in sorted((ROOT / "tailorstore" / "integrations").rglob("*.py")):
        if path.name in ("session.py", "ranks.py"):
            continue
        tree = _tree(path)
        from_ranks = {
            alias.asname or alias.name
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and (node.module or "").endswith("integrations.ranks")
            for alias in node.names
        }
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
                if func.value.id == "dist" and func.attr in COLLECTIVES:
                    found.append(f"{path.name}:{node.lineno}: dist.{func.attr}")
                if func.value.id == "ranks" and func.attr in ("gathered", "broadcast", "barrier"):
                    found.append(f"{path.name}:{node.lineno}: ranks.{func.attr}")
            if isinstance(func, ast.Name) and func.id in from_ranks & {"gathered", "broadcast", "barrier"}:
                found.append(f"{path.name}:{node.lineno}: {func.id} from ranks.py")
    assert not found, "collectives outside the rank session:\n" + "\n".join(found)


# What a comment or docstring of the library may not carry: comments say why, and the figures
# that showed it live in docs/PERFORMANCE.md, beside the benchmark that measured them.
NOT_IN_COMMENTS = {
    "a throughput": re.compile(r"\d\s*[kKMGT]i?B/s\b"),
    "a figure of 'this machine'": re.compile(r"\bon this machine\b|\bthis machine kind\b", re.IGNORECASE),
    "a date": re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b"),
    "a report's finding": re.compile(r"\battack findings?\b", re.IGNORECASE),
    "an issue's number": re.compile(r"\bissues?\s+#?\d+|\(issue\b|#\d{2,}\b", re.IGNORECASE),
}
ISSUE_NUMBER = re.compile(r"\bissues?\s+#?\d+", re.IGNORECASE)


def _comments_and_docstrings(path: Path) -> list[tuple[int, str]]:
    """Every comment (its line) and every module, class and function docstring (its first line)."""
    text = (ROOT / path).read_text()
    found = [
        (token.start[0], token.string)
        for token in tokenize.generate_tokens(io.StringIO(text).readline)
        if token.type == tokenize.COMMENT
    ]
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                if isinstance(body[0].value.value, str):
                    found.append((body[0].lineno, body[0].value.value))
    return found


def test_comments_say_why_not_how_fast_or_when() -> None:
    """A comment or docstring of the library (tailorstore/, cli/) states the reason, never the
    figure that showed it: no throughput, no timing of "this machine", no date, no reference to a
    report's findings or to an issue by number. Figures go to docs/PERFORMANCE.md (which links the
    benchmark in docs/benchmarks.md); a finding becomes the invariant it broke (docs/FORMAT.md 8.1)
    or the test that keeps it out."""
    wrong = []
    for path in sources():
        for line, text in _comments_and_docstrings(path):
            for what, pattern in NOT_IN_COMMENTS.items():
                if match := pattern.search(text):
                    wrong.append(f"{path}:{line}: {what}: {match.group(0)!r}")
    assert not wrong, "\n".join(wrong)


def test_no_test_names_an_issue_by_number() -> None:
    """A test says what it keeps (the invariant, the failure it keeps out), not which issue asked
    for it: an issue's number means nothing to a reader of the repository."""
    wrong = []
    for folder in ("tests", "testbed"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if match := ISSUE_NUMBER.search(line):
                    wrong.append(f"{path.relative_to(ROOT)}:{number}: {match.group(0)!r}")
    assert not wrong, "\n".join(wrong)


def test_no_function_takes_a_callback_per_concern() -> None:
    """The house, third step, item 5: one ``Progress`` all the way down. What a verb waits for and
    warns of reaches its caller through the ``progress`` it was given (``note``, ``warn``), so no
    function of the library, at any layer, takes an ``on_wait``, ``on_stale`` or ``warn``."""
    found = []
    for path in sources():
        for node in ast.walk(_tree(ROOT / path)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                every = [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]
                named = [a.arg for a in every if a.arg in ("on_wait", "on_stale", "warn", "on_progress")]
                found += [f"{path}:{node.lineno}: {node.name}({n})" for n in named]
    assert not found, "\n".join(found)


def test_gc_takes_its_rules_as_one_object() -> None:
    """The house, third step, item 11: ``Store.gc`` took fourteen keywords, six of them repeated
    in ``set_retention``. The rules are one public value, :class:`tailorstore.Retention`, taken by
    both; ``gc``'s other parameters say how it runs, not what it keeps."""
    import inspect

    import tailorstore
    from tailorstore.api import Store

    assert list(inspect.signature(Store.gc).parameters) == [
        "self", "rules", "dry_run", "drop_parts", "lock_timeout", "progress", "show_plan", "clear_notices"
    ]  # fmt: skip
    assert list(inspect.signature(Store.set_retention).parameters) == ["self", "rules"]
    rules = tailorstore.Retention(keep_last=3, thin="archive", archive_levels=15)
    assert rules.grid is not None and (rules.grid.levels, rules.grid.keyframe_every) == (15, 16)
    assert tailorstore.Retention.from_doc("main", rules.as_doc()) == tailorstore.Retention(
        keep_last=3, thin="archive", archive_levels=15, keyframe_every=16, run="main"
    )


_REPO_ROLES = ("BlobReader", "StepReader", "StoreWriter")


@functools.cache
def _repository_parameters() -> dict[tuple[str, str], dict]:
    """Every function of the library with a parameter annotated ``Repository`` or one of its roles:
    (file, qualified name) -> the parameter's annotation, the names used on it (through ``self.X``
    when ``__init__`` keeps it) and the functions it is handed to (by name; ``partial``'s and a
    pool's ``submit``'s first argument too)."""
    found: dict[tuple[str, str], dict] = {}
    for path in sorted((ROOT / "tailorstore").rglob("*.py")):
        tree = _tree(path)
        classes = {f: c for c in ast.walk(tree) if isinstance(c, ast.ClassDef) for f in c.body}
        for fn in ast.walk(tree):
            if not isinstance(fn, ast.FunctionDef):
                continue
            typed = [
                a for a in fn.args.args + fn.args.kwonlyargs
                if a.annotation is not None and ast.unparse(a.annotation) in ("Repository", *_REPO_ROLES)
            ]  # fmt: skip
            if not typed:
                continue
            arg, klass = typed[0], classes.get(fn)
            holders: list[ast.AST] = [fn]
            held = {arg.arg}
            if fn.name == "__init__" and klass is not None:  # what the instance keeps: self.X = repo
                kept = {
                    t.attr for a in ast.walk(fn) if isinstance(a, ast.Assign) and _is_name(a.value, arg.arg)
                    for t in a.targets if isinstance(t, ast.Attribute) and _is_name(t.value, "self")
                }  # fmt: skip
                holders, held = [klass], held | {f"self.{k}" for k in kept}
            used, handed = set(), set()
            for holder in holders:
                for node in ast.walk(holder):
                    if isinstance(node, ast.Attribute) and ast.unparse(node.value) in held:
                        used.add(node.attr)
                    if isinstance(node, ast.Call) and any(
                        ast.unparse(x) in held for x in [*node.args, *(k.value for k in node.keywords)]
                    ):
                        handed.add(_called_name(node.func))
                        if _called_name(node.func) in ("partial", "submit") and node.args:
                            handed.add(_called_name(node.args[0]))
            name = f"{klass.name}.__init__" if fn.name == "__init__" and klass else fn.name
            found[(path.relative_to(ROOT).as_posix(), name)] = {
                "role": ast.unparse(arg.annotation), "used": used - {"__class__"}, "handed": handed - {None},
            }  # fmt: skip
    return found


def _is_name(node: ast.AST, name: str) -> bool:
    return isinstance(node, ast.Name) and node.id == name


def _called_name(func: ast.AST) -> str | None:
    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None


def test_below_a_verb_each_function_names_the_repository_role_it_uses() -> None:
    """restic hands a command its repository and each helper the narrow interface it uses
    (``restic.ListBlobser``). A verb here (``tag``, ``checkout_step``, ``gc``: what the API, the
    integrations or the CLI call) gets the ``Repository``; every function below it takes a role of
    store/repo.py (``BlobReader`` < ``StepReader`` < ``StoreWriter``), uses on it only that role's
    names, and hands it on only to functions whose role is no wider. What still takes the whole
    repository below a verb hands it to store/'s own writers (``record_manifest``,
    ``cleaned_up_on_failure``), which need the index itself."""
    from tailorstore.core.roles import members
    from tailorstore.store import repo as repo_module

    roles = {name: members(getattr(repo_module, name)) for name in _REPO_ROLES}
    found = _repository_parameters()
    by_name: dict[str, list[tuple[str, str]]] = {}
    for key in found:
        by_name.setdefault(key[1].removesuffix(".__init__"), []).append(key)
    outside = "\n".join(
        (ROOT / p).read_text()
        for p in [Path("tailorstore/api.py"), *_py_files("tailorstore/integrations"), *_py_files("cli")]
    )
    store_writers = {k[1] for k in found if k[0].startswith("tailorstore/store/") and found[k]["role"] == "Repository"}
    wrong = []
    for (path, name), info in sorted(found.items()):
        if path.startswith(("tailorstore/store/", "tailorstore/integrations/")) or path == "tailorstore/api.py":
            continue  # the store itself, and what sits above the verbs
        role = info["role"]
        callees = [k for n in info["handed"] for k in by_name.get(n, [])]
        if role == "Repository":
            entry = not name.startswith("_") and re.search(rf"\b{name.removesuffix('.__init__')}\b", outside)
            hands_to_store = any(n in store_writers for n in info["handed"]) or any(
                found[k]["role"] == "Repository" for k in callees
            )
            if not entry and not hands_to_store:
                wrong.append(f"{path}: {name} takes the whole Repository below a verb; name its role")
            continue
        if extra := sorted(info["used"] - roles[role]):
            wrong.append(f"{path}: {name} uses {extra} of its {role}, which the role does not name")
        for callee in callees:
            theirs = found[callee]["role"]
            if theirs == "Repository" or not roles[theirs] <= roles[role]:
                wrong.append(f"{path}: {name} hands its {role} to {callee[1]}, which takes {theirs}")
    assert not wrong, "\n".join(wrong)
    narrowed = [k for k, v in found.items() if v["role"] in _REPO_ROLES]
    assert len(narrowed) >= 80, len(narrowed)  # the helpers of every verb package


def test_the_repository_has_every_name_of_its_roles(repo: object) -> None:
    from tailorstore.core.roles import members
    from tailorstore.store import repo as repo_module

    for name in _REPO_ROLES:
        missing = sorted(n for n in members(getattr(repo_module, name)) if not hasattr(repo, n))
        assert not missing, (name, missing)
    assert members(repo_module.BlobReader) < members(repo_module.StepReader) < members(repo_module.StoreWriter)


def _py_files(folder: str) -> list[Path]:
    return sorted(p.relative_to(ROOT) for p in (ROOT / folder).rglob("*.py"))
