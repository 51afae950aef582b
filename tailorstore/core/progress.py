"""Progress for long commands: a rich bar on a terminal, silence elsewhere."""

from __future__ import annotations

import sys
from typing import Protocol


class Progress(Protocol):
    def start(self, description: str, total: int) -> None: ...
    def advance(self, amount: int) -> None: ...
    def close(self) -> None: ...


class Silent:
    def start(self, description: str, total: int) -> None:
        pass

    def advance(self, amount: int) -> None:
        pass

    def close(self) -> None:
        pass


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


def for_terminal(quiet: bool) -> Progress:
    return Bar() if not quiet and sys.stderr.isatty() else Silent()
