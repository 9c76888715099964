"""The bytes a process read and wrote, for benchmarks that measure what a round moves (the
failpoint pattern: one environment variable, nothing otherwise).

With ISLANDS_IO_REPORT naming a folder, `report_at_exit("worker")` makes the process write
`ROLE-PID.json` there as it exits: its /proc/self/io counters (rchar and wchar: every byte passed
to read and write calls, page cache or not, so they count what crossed a shared filesystem's client
too) and its peak resident memory (maxrss). A benchmark takes the difference of two runs that
differ only in their number of rounds, so what does not grow with rounds (imports, the corpus
index) cancels out (bench/round_footprint.py).
"""
from __future__ import annotations

import atexit
import json
import os
from pathlib import Path

from core.assignment import INLINE_JOB_ID

ENV = "ISLANDS_IO_REPORT"


def counters() -> dict[str, int]:
    """This process's /proc/self/io counters ({} where there is no /proc, and on an inline job's
    thread, whose process's counts are the service's and every other worker's too)."""
    if INLINE_JOB_ID.get() is not None:
        return {}
    try:
        with open("/proc/self/io") as f:
            return {k: int(v) for k, v in (line.split(":") for line in f if ":" in line)}
    except OSError:
        return {}


def report_at_exit(role: str) -> None:
    folder = os.environ.get(ENV)
    if not folder:
        return

    def write() -> None:
        import resource  # the process's peak resident memory, in bytes (Linux counts ru_maxrss in KiB)
        report = {"role": role, "pid": os.getpid(), **counters(),
                  "maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
        (Path(folder) / f"{role}-{os.getpid()}.json").write_text(json.dumps(report))
    atexit.register(write)
