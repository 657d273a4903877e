"""Progress display: a rich bar on a terminal, plain log lines otherwise (job logs, CI).

Under `ray job submit`, a pipe or a file, stdout is not a TTY: no bar and no terminal control
codes, even when FORCE_COLOR or TTY_COMPATIBLE in the environment would make rich draw one."""
from __future__ import annotations

import sys
from typing import Optional

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn


class ProgressDisplay:
    def __init__(self, total_epochs: int, enabled: bool = True) -> None:
        self.console = Console(stderr=False)
        self.enabled = enabled
        self.live = enabled and _stdout_is_tty() and self.console.is_terminal
        self.total_epochs = total_epochs
        self._bar: Optional[Progress] = None
        if self.live:
            self._bar = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("{task.fields[info]}"), TimeElapsedColumn(), console=self.console)
            self._task = self._bar.add_task("starting", total=None, info="")
            self._bar.start()

    def steps(self, epoch: int, step_in_epoch: int, loss: float, total: int) -> None:
        if self._bar is not None:
            self._bar.update(self._task, description=f"epoch {epoch}/{self.total_epochs}", completed=step_in_epoch,
                             total=total, info=f"loss {loss:.4f}")

    def line(self, text: str) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.console.print(text)
        else:
            print(text, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None


def _stdout_is_tty() -> bool:
    try:
        return sys.stdout.isatty()
    except (AttributeError, ValueError):  # replaced by an object without isatty, or closed
        return False
