"""The terminal: the one rich console every command prints to, and logging set up for it.
rich lives here and in the command modules only; off a terminal everything is plain lines."""
from __future__ import annotations

import logging
import sys

from rich.console import Console

console = Console(highlight=False, soft_wrap=True)


def setup_logging(verbose: bool) -> None:
    level = logging.DEBUG if verbose else logging.INFO
    if sys.stderr.isatty():
        from rich.logging import RichHandler

        from orchestrator import progress_bars
        err = Console(stderr=True)
        handler: logging.Handler = RichHandler(console=err, show_path=False)
        progress_bars.install(err)  # long operations draw bars here, above the log lines
    else:
        from core.progress import set_renderer
        set_renderer(None)  # a log file or a pipe: plain progress lines, no bars
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=level, handlers=[handler], force=True)
    logging.getLogger("submitit").setLevel(logging.WARNING)
