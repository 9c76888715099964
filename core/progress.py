"""Progress of long operations (corpus preparation, merges): plain log lines, or a bar on a terminal.

Library code reports progress through `progress()` / `track()` and nothing else; it never draws.
By default a running operation logs one plain line at most every `interval_s` seconds through
`logging` (what a Slurm log file wants: no carriage returns, no escape codes), and an operation
shorter than that logs nothing. The command line, and only when its output is a terminal, installs
a renderer (`set_renderer`) that draws a bar instead (orchestrator/progress_bars.py, with rich).

    with progress(len(files), "preparing corpus", unit="files") as bar:
        for f in files:
            ...
            bar.advance()
"""
from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Protocol, TypeVar

T = TypeVar("T")
log = logging.getLogger(__name__)

DEFAULT_INTERVAL_S = 30.0
"""Seconds between two plain progress lines of one operation: a few lines per minute in a Slurm log."""


class Task(Protocol):
    """One operation in progress, as a renderer shows it."""

    def advance(self, n: float = 1) -> None: ...

    def note(self, text: str) -> None:
        """What else the operation has done so far (e.g. "12k docs, 3.1M tokens"), shown beside it."""

    def close(self) -> None: ...


Renderer = Callable[[float | None, str, str], Task]
"""Makes the Task of one operation from (total, description, unit)."""

_renderer: Renderer | None = None


def set_renderer(renderer: Renderer | None) -> Renderer | None:
    """Draw every operation's progress with `renderer` from now on (None: plain log lines again);
    returns the previous one. For the command line's edge only."""
    global _renderer
    previous, _renderer = _renderer, renderer
    return previous


class LogLines:
    """The default Task: a log line at most every `interval_s` seconds while the operation runs."""

    def __init__(self, total: float | None, desc: str, unit: str, interval_s: float | None = None,
                 logger: logging.Logger = log) -> None:
        self.total, self.desc, self.unit, self.logger = total, desc, unit, logger
        self.interval_s = DEFAULT_INTERVAL_S if interval_s is None else interval_s
        self.done = 0.0
        self.t0 = self._last = time.monotonic()
        self.lines = 0
        self.extra = ""

    def note(self, text: str) -> None:
        self.extra = f", {text}"

    def advance(self, n: float = 1) -> None:
        self.done += n
        now = time.monotonic()
        if now - self._last >= self.interval_s:
            self._last = now
            self.lines += 1
            self.logger.info("%s: %s%s after %.0fs", self.desc, self._amount(), self.extra, now - self.t0)

    def close(self) -> None:
        # a closing line only for an operation that has already said it was running
        if self.lines:
            ended = "stopped at" if self.total and self.done < self.total else "done,"
            self.logger.info("%s: %s %s%s in %.0fs", self.desc, ended, self._amount(), self.extra, time.monotonic() - self.t0)

    def _amount(self) -> str:
        if not self.total:
            return f"{human(self.done)} {self.unit}"
        return f"{human(self.done)}/{human(self.total)} {self.unit} ({100 * self.done / self.total:.0f}%)"


def human(x: float) -> str:
    """1234567 -> 1.2M: amounts short enough for a log line or a bar."""
    for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return f"{x / scale:.1f}{suffix}"
    return f"{x:.0f}"


def bytes_sent(mean: float, fp32: int | None, when: str = "") -> str:
    """A contribution's size as status and the report say it: `contributions: 25.7kB per
    worker-round (round 7), 1/75 of the weights in fp32 (1.9MB)`."""
    if not (fp32 and mean):
        ratio = ""
    elif fp32 / mean >= 1.5:
        ratio = f", 1/{fp32 / mean:.0f} of the weights in fp32 ({human(fp32)}B)"
    else:  # dense: about the weights' size, which `1/1` would not say
        ratio = f", {mean / fp32:.2f}x the weights in fp32 ({human(fp32)}B)"
    return f"contributions: {human(mean)}B per worker-round{when}{ratio}"


def bytes_moved(read: float, written: float, fp32: int | None, replayed: int, workers: int, when: str = "") -> str:
    """What a worker-round moved through storage as status and the report say it: `worker I/O per
    worker-round (round 7): read 115kB (0.06 of the weights in fp32), wrote 34.5kB (0.02); 3/3 bases
    replayed` (the last part only when some were: worker/replica.py)."""
    part = (lambda n, of: f" ({n / fp32:.2f}{of})") if fp32 else (lambda n, of: "")
    return (f"worker I/O per worker-round{when}: read {human(read)}B{part(read, ' of the weights in fp32')}, "
            f"wrote {human(written)}B{part(written, '')}" + (f"; {replayed}/{workers} bases replayed" if replayed else ""))


@contextlib.contextmanager
def progress(total: float | None, desc: str, *, unit: str = "items") -> Iterator[Task]:
    """The Task of one operation of `total` units (None: unknown), closed when the block ends."""
    task = _renderer(total, desc, unit) if _renderer is not None else LogLines(total, desc, unit)
    try:
        yield task
    finally:
        task.close()


def track(items: Iterable[T], desc: str, *, total: float | None = None, unit: str = "items",
          size: Callable[[T], float] | None = None) -> Iterator[T]:
    """Yield `items`, advancing by `size(item)` (default 1) once each item has been dealt with."""
    if total is None and hasattr(items, "__len__"):
        total = sum(size(i) for i in items) if size else len(items)  # type: ignore[arg-type]
    with progress(total, desc, unit=unit) as task:
        for item in items:
            yield item
            task.advance(size(item) if size else 1)
