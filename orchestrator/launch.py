"""The `orchestrate` command itself: Ctrl-C at any moment prints no traceback.

A command handles its own Ctrl-C (orchestrator.cli.main: "interrupted", and what to do next). Outside
it, while the command's modules import (torch takes seconds) and while the interpreter exits (torch's
exit hooks), Python would print a KeyboardInterrupt traceback; there SIGINT has the default action
instead, as in any C program: the process ends at once, silently, and the shell sees it was
interrupted. A SIGINT the caller ignores (`nohup`, a background job) stays ignored throughout.
"""
from __future__ import annotations

import signal
import sys


def main() -> int:
    handles = signal.getsignal(signal.SIGINT) is signal.default_int_handler
    if handles:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
    from orchestrator import cli  # noqa: PLC0415 (after the handler: the import is the slow part)
    try:
        if handles:
            signal.signal(signal.SIGINT, signal.default_int_handler)
        return cli.main()
    finally:
        if handles:
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()  # what the command printed, before a Ctrl-C could end the exit silently
                except (OSError, ValueError):
                    pass
            signal.signal(signal.SIGINT, signal.SIG_DFL)


if __name__ == "__main__":
    sys.exit(main())
