"""Progress bars on a terminal: the command line's renderer for core.progress (rich lives at the edge).

`install(console)` switches core.progress from plain log lines to rich bars when, and only when,
`console` is a terminal; in a Slurm log or a pipe the plain lines stay (docs/observability.md).
"""
from __future__ import annotations

from rich.console import Console
from rich.progress import BarColumn, Progress, ProgressColumn, TaskID, TaskProgressColumn, TextColumn
from rich.progress import Task as RichTask
from rich.progress import TimeRemainingColumn
from rich.text import Text

from core import progress


class _Amount(ProgressColumn):
    def render(self, task: RichTask) -> Text:
        done = progress.human(task.completed)
        total = f"/{progress.human(task.total)}" if task.total else ""
        unit = task.fields.get("unit", "")
        rate = f" {task.speed:.1f} {unit}/s" if task.speed and unit == "MB" else ""
        return Text(f"{done}{total} {unit}{rate}")


class RichBars:
    """One rich Progress for the process: each operation is one of its tasks, and the live display
    runs while any is open (rich allows one live display at a time, and operations may nest)."""

    def __init__(self, console: Console) -> None:
        # 80 columns: a short bar, and what an operation notes (docs, tokens) after its description
        self.bars = Progress(TextColumn("{task.description}{task.fields[note]}"), BarColumn(bar_width=10),
                             TaskProgressColumn(), _Amount(),
                             TimeRemainingColumn(), console=console, transient=True)
        self.open = 0

    def __call__(self, total: float | None, desc: str, unit: str) -> "_Bar":
        if self.open == 0:
            self.bars.start()
        self.open += 1
        return _Bar(self, self.bars.add_task(desc, total=total, unit=unit, note=""))

    def _close(self, task: TaskID) -> None:
        self.bars.remove_task(task)
        self.open -= 1
        if self.open == 0:
            self.bars.stop()


class _Bar:
    def __init__(self, owner: RichBars, task: TaskID) -> None:
        self.owner, self.task, self.closed = owner, task, False

    def advance(self, n: float = 1) -> None:
        self.owner.bars.advance(self.task, n)

    def note(self, text: str) -> None:
        self.owner.bars.update(self.task, note=f": {text}")

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.owner._close(self.task)


def install(console: Console) -> bool:
    """Draw progress as bars on `console` if it is a terminal (True), else leave the plain log lines."""
    if not console.is_terminal or console.is_dumb_terminal:
        return False
    progress.set_renderer(RichBars(console))
    return True
