"""What a long operation tells its caller while it runs: how far it is, what it warns of, and what
it waits for. One object carries all three (the convention of every verb, docs/API.md
"Conventions"), so that a verb takes one ``progress=`` and never a callback per concern.

A rich bar on a terminal (:class:`Bar`), lines on stderr for the CLI elsewhere (:class:`Lines`),
and the ``tailorstore`` logger for a library caller that passes nothing (:class:`Silent`).
"""

from __future__ import annotations

import logging
import sys
from typing import Protocol

log = logging.getLogger("tailorstore")


class Progress(Protocol):
    def start(self, description: str, total: int) -> None: ...
    def advance(self, amount: int) -> None: ...
    def close(self) -> None: ...
    def warn(self, message: str) -> None:
        """Something the caller should know of, that did not stop the operation."""

    def note(self, message: str) -> None:
        """What the operation waits for (a lock another process holds), while it waits."""


class Silent:
    """No bar; warnings and waits go to the ``tailorstore`` logger (a library caller's default)."""

    def start(self, description: str, total: int) -> None:
        pass

    def advance(self, amount: int) -> None:
        pass

    def close(self) -> None:
        pass

    def warn(self, message: str) -> None:
        log.warning("%s", message)

    def note(self, message: str) -> None:
        log.info("%s", message)


class Lines(Silent):
    """No bar; warnings and waits as lines on stderr (the CLI off a terminal, or quiet)."""

    def warn(self, message: str) -> None:
        print(f"warning: {message}", file=sys.stderr, flush=True)

    def note(self, message: str) -> None:
        print(message, file=sys.stderr, flush=True)


class Bar:
    def __init__(self) -> None:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            TimeRemainingColumn,
            TransferSpeedColumn,
        )
        from rich.progress import Progress as RichProgress

        self._bar = RichProgress(
            "[progress.description]{task.description}",
            BarColumn(),
            DownloadColumn(),
            TransferSpeedColumn(),
            TimeRemainingColumn(),
            transient=True,
            console=Console(stderr=True),
        )
        self._task: int | None = None

    def start(self, description: str, total: int) -> None:
        self._bar.start()
        self._task = self._bar.add_task(description, total=total)

    def advance(self, amount: int) -> None:
        if self._task is not None:
            self._bar.advance(self._task, amount)

    def close(self) -> None:
        self._bar.stop()

    def warn(self, message: str) -> None:
        self._bar.console.print(f"warning: {message}", markup=False, highlight=False)

    def note(self, message: str) -> None:
        self._bar.console.print(message, markup=False, highlight=False)


def for_terminal(quiet: bool) -> Progress:
    """The CLI's progress: a bar on a terminal unless ``quiet``; warnings and waits are shown either way."""
    return Bar() if not quiet and sys.stderr.isatty() else Lines()
