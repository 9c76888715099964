"""Named crash points for fault-injection tests (the failpoint pattern of etcd/FreeBSD).

`failpoint("merge.after_global")` kills the process on the spot, as SIGKILL would, when the
environment variable ISLANDS_FAILPOINT names that point; otherwise it costs one dict lookup. The
reliability tests use it to stop the merge service between two writes that no signal could be
timed to hit, then check that `orchestrate resume` finishes the round exactly once.
"""
from __future__ import annotations

import os

ENV = "ISLANDS_FAILPOINT"


def failpoint(name: str) -> None:
    if os.environ.get(ENV) == name:
        os._exit(137)  # no cleanup, no finally blocks: like a kill -9 or a node dying
