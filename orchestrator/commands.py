"""The one way islands runs a scheduler command (scontrol, sinfo, sbatch --test-only, squeue, sacct,
scancel) and reads its answer: decoded with replacement, since a site's wrapper or a node's name
may print bytes that are not UTF-8, and with control characters removed before any of it reaches a
message or the terminal (an escape sequence in a partition's name would retitle the window or
clear the screen). Lines and tabs are kept: they are what the parsers split on.
"""
from __future__ import annotations

import subprocess

# C0 controls but tab and newline, DEL, and C1 (U+009B opens an escape sequence on its own)
_CONTROLS = dict.fromkeys([*range(0x00, 0x09), *range(0x0B, 0x20), *range(0x7F, 0xA0)])


def plain(s: str) -> str:
    """`s` without control characters (but newlines and tabs): safe to print, safe to parse."""
    return s.translate(_CONTROLS)


def run(args: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    """`args` run to its end (or TimeoutExpired / OSError), its stdout and stderr as plain text."""
    done = subprocess.run(args, capture_output=True, text=True, errors="replace", timeout=timeout, check=False)
    done.stdout, done.stderr = plain(done.stdout or ""), plain(done.stderr or "")
    return done
