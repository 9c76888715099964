"""The `orchestrate` command itself: Ctrl-C at any moment prints no traceback.

A command handles its own Ctrl-C (orchestrator.cli.main: "interrupted", and what to do next). Outside
it, while the CLI's modules import and its parser is built, and while the interpreter exits (torch's
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
    # torch's C init imports numpy and drops a KeyboardInterrupt raised in it (the Ctrl-C is lost, and
    # numpy stays off for the process): numpy is imported here first, and the subcommands' modules
    import numpy  # noqa: F401, PLC0415
    parser = cli.build_parser()
    try:
        if handles:
            signal.signal(signal.SIGINT, signal.default_int_handler)
        return cli.main(parser=parser)
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
