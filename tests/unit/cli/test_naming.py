"""The command line's names (cli/naming.py): a next step the library names as a call of its API is
named as a command on the command line; no message below the command line names a command."""

from __future__ import annotations

import pickle
import re
from pathlib import Path

from tests.conftest import REPO_ROOT


def test_a_next_step_is_named_by_each_front_end_its_own_way() -> None:
    """The library says what to do next as calls of its API; the command line names them as its
    commands and flags, from the structure (no rewriting of message text), and maps categories
    to exit codes."""
    from tailorstore.cli.naming import EXIT_CODES, as_command

    from tailorstore.core.errors import Call, Category, CorruptStoreError, LeaseLostError, StepExistsError

    refused = StepExistsError("step 3 is in the store; commit under another ", Call(step="N"), ", or pass ",
                              Call(force=True), " to replace it.")  # fmt: skip
    assert str(refused) == "step 3 is in the store; commit under another `step=N`, or pass `force=True` to replace it."
    assert refused.render(as_command) == "step 3 is in the store; commit under another --step N, or pass --force " \
        "to replace it."  # fmt: skip
    damaged = CorruptStoreError("blob x is damaged. ", Call("verify", deep=True), "; ", Call("rebuild_index"), ".")
    assert str(damaged) == "blob x is damaged. `verify(deep=True)`; `rebuild_index()`."
    assert damaged.render(as_command) == "blob x is damaged. `tailor verify --deep`; `tailor index rebuild`."
    assert as_command(Call("commit", "DIR", part=True, force=True)) == "`tailor commit DIR --part --force`"
    assert as_command(Call("finalize", "step=N")) == "`tailor finalize step=N`"
    assert [EXIT_CODES[e.category] for e in (refused, damaged, LeaseLostError("x"))] == [2, 3, 4]
    assert set(EXIT_CODES) == set(Category)
    again = pickle.loads(pickle.dumps(refused))  # a rank hands its error to the others whole
    assert type(again) is StepExistsError and again.render(as_command) == refused.render(as_command)


def test_no_message_below_the_command_line_names_a_command() -> None:
    """The library never names a CLI command or flag: every string it holds (docstrings aside,
    which may say which command uses a module) is free of `tailor ...` and `--flag` advice."""
    import ast

    root = REPO_ROOT / "tailorstore"
    found = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text())
        docstrings = {
            id(node.body[0].value)
            for node in ast.walk(tree)
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
            and node.body
            and isinstance(node.body[0], ast.Expr)
            and isinstance(node.body[0].value, ast.Constant)
        }
        for node in ast.walk(tree):
            if isinstance(node, ast.JoinedStr):  # an f-string, its values as {}: "`{name}={value}`" names an option
                text = "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
                text = node.value
            else:
                continue
            # a flag anywhere ("(--format universal)", "without --world-size"), not only in backticks
            if "`tailor " in text or re.search(r"(^|[\s(`'\"])--[a-z]|`(\{\}|[a-z_]+)=", text):
                found.append(f"{path.relative_to(root.parent)}:{node.lineno}: {text[:80]!r}")
    assert not found, "\n".join(found)


def test_every_call_an_error_names_is_a_method_of_store_and_a_command() -> None:
    """Errors name operations as ``Call("unpin", ...)``, which the API shows as a method
    of ``Store`` and the command line as a command; ``unpin`` was no method of ``Store``."""
    import ast

    from tailorstore.cli.app import app
    from tailorstore.cli.naming import COMMANDS

    from tailorstore import Store

    commands = {c.name or (c.callback.__name__ if c.callback else "") for c in app.registered_commands}
    commands |= {f"{g.name} {c.name}" for g in app.registered_groups for c in g.typer_instance.registered_commands}
    named = set()
    for path in Path("tailorstore").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Call" and node.args:
                first = node.args[0]
                if isinstance(first, ast.Constant) and isinstance(first.value, str):
                    named.add(first.value)
    assert named, "no Call found: the scan is broken"
    assert {n for n in named if not callable(getattr(Store, n, None))} == set()
    assert {n for n in named if COMMANDS.get(n, n) not in commands} == set()
