"""The library's next steps (:class:`~tailorstore.core.errors.Call`) named as this command line's.

An error says what to do next as an operation of the public API and its options; here each
becomes the command a user types (``verify(deep=True)`` -> ``tailor verify --deep``,
``force=True`` -> ``--force``), and each error category an exit code. The library knows
nothing of either.
"""

from __future__ import annotations

from tailorstore.core.errors import Call, Category

EXIT_CODES = {Category.BAD_INPUT: 2, Category.DAMAGED_STORE: 3, Category.LOCK: 4, Category.BACKEND: 5}

# An operation of the API -> the command words that do it (the same word where it is the same).
COMMANDS = {
    "rebuild_index": "index rebuild",
    "runs": "run list",
}


def flag(name: str, value: object) -> str:
    option = "--" + name.replace("_", "-")
    return option if value is True else f"{option} {value}"


def as_command(call: Call) -> str:
    """``Call("verify", deep=True)`` -> `` `tailor verify --deep` ``; ``Call(force=True)`` -> ``--force``."""
    flags = [flag(k, v) for k, v in call.options.items()]
    if call.operation is None:
        return " and ".join(flags)  # options read as part of the sentence: "pass --force"
    words = ["tailor", COMMANDS.get(call.operation, call.operation), *call.args, *flags]
    return "`" + " ".join(words) + "`"
