"""The terminal: the one rich console every command prints to, and logging set up for it.
rich lives here and in the command modules only; off a terminal everything is plain lines.

Quiet by default: a person sees what the command prints and the warnings; log records below that
only with -v. A run also logs everything to its own file (`log_to_file`), whatever -v says."""
from __future__ import annotations

import argparse
import logging
import os
import sys
import textwrap
from pathlib import Path
from typing import Any

from rich.console import Console

console = Console(highlight=False, soft_wrap=True)
PLAIN = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """argparse's, without breaking words at hyphens (`task-` / `arithmetic` is not a name to type)."""

    def _split_lines(self, text: str, width: int) -> list[str]:
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)


def say_command(lead: str, command: str, out: Console | None = None) -> None:
    """`lead` and a command to paste after it: one line where it fits the terminal, else the
    command on a line of its own, never broken (the terminal wraps it; it copies as one line)."""
    out = out or console
    if out.is_terminal and len(lead) + 1 + len(command) > out.width:
        out.print(lead, markup=False, soft_wrap=True)
        out.print(command, markup=False, soft_wrap=True)
    else:
        out.print(f"{lead} {command}", markup=False, soft_wrap=True)


def say(text: str, out: Console | None = None) -> None:
    """One line of a command's output (on `out`, else the one console). On a terminal it is wrapped
    between words at its width, never inside a number or a word; a word longer than a line (a path)
    stays whole for the terminal to wrap, so that it copies as one. In a pipe or a log it goes whole."""
    out = out or console
    if out.is_terminal:
        text = "\n".join(textwrap.fill(line, out.width, break_long_words=False, break_on_hyphens=False)
                         for line in text.splitlines())
    out.print(text, markup=False, soft_wrap=True)


def break_path(path: str, width: int) -> str:
    """`path` in lines of at most `width`, each broken after a `/` (a name is cut only where it alone
    is longer than a line): a table cell that folds a path without cutting a name in two."""
    lines = [""]
    for part in path.replace("/", "/\0").split("\0"):
        while len(part) > width:  # one name longer than the column: folded, as nothing else can be
            lines[-1:] = [lines[-1], part[:width]] if lines[-1] else [part[:width]]
            part = part[width:]
        if len(lines[-1]) + len(part) > width:
            lines.append("")
        lines[-1] += part
    return "\n".join(x for x in lines if x)


def narrow_table(*columns: Any, title: str, fold: bool = False) -> Any:
    """A table for an 80-column terminal: no column rules or edge padding, its title on the left
    (wrapped at words); `fold`: a cell too long for its column folds onto more lines, never cut."""
    from rich import box
    from rich.table import Column, Table
    cols = [Column(c, overflow="fold") if fold and isinstance(c, str) else c for c in columns]
    return Table(*cols, title=title, title_justify="left", box=box.SIMPLE_HEAD, collapse_padding=True, pad_edge=False)


def setup_logging(verbose: bool) -> None:
    shown = logging.DEBUG if verbose else logging.WARNING
    if sys.stderr.isatty():
        from rich.logging import RichHandler

        from orchestrator import progress_bars
        # the one console when it is the terminal: records then print above the live footer, which
        # rich redraws below them (a console of their own would write through it, leaving footers behind)
        handler: logging.Handler = RichHandler(console=console if console.is_terminal else Console(stderr=True),
                                               show_path=False)
        handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))  # rich shows the time and level itself
        progress_bars.install(console)  # long operations draw bars on the one console, above the live view
    else:
        from core.progress import set_renderer
        set_renderer(None)  # a log file or a pipe: plain progress lines, no bars
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(PLAIN))
    # progress lines of long operations (core.progress, when no bar is drawn) are output, not chatter
    handler.addFilter(lambda rec: rec.levelno >= shown or rec.name == "core.progress")
    # the root lets INFO through for the run's log file; the terminal's handler filters
    logging.basicConfig(level=min(shown, logging.INFO), handlers=[handler], force=True)
    for noisy in ("submitit", "matplotlib", "PIL", "fsspec"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def log_to_file(path: Path) -> None:
    """Every log record of this process from now on also goes to `path` (appended: a resumed run
    continues its log)."""
    path.parent.mkdir(parents=True, mode=0o700, exist_ok=True)
    # private (0600), and never through a link planted at its name (O_NOFOLLOW)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    except OSError as exc:
        from core.errors import RunError
        raise RunError(f"cannot open the run's log {path} ({exc.strerror}): if it is a link someone planted, remove "
                       "it; islands writes only inside the run") from None
    os.fchmod(fd, 0o600)
    handler = logging.StreamHandler(os.fdopen(fd, "a", encoding="utf-8"))
    handler.setFormatter(logging.Formatter(PLAIN))
    logging.getLogger().addHandler(handler)
