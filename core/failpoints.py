"""Named crash points for fault-injection tests (the failpoint pattern of etcd/FreeBSD).

`failpoint("merge.after_global")` kills the process on the spot, as SIGKILL would, when the
environment variable ISLANDS_FAILPOINT names that point; otherwise it costs one dict lookup. The
reliability tests use it to stop the merge service between two writes that no signal could be
timed to hit, then check that `orchestrate resume` finishes the round exactly once.

`slowpoint("worker_002.publish")` sleeps instead, when ISLANDS_SLOWPOINT lists that point with a
number of seconds (`worker_002.publish=30`, several separated by commas): how the chaos run
(bench/chaos.py) makes one worker a straggler. Slurm jobs inherit it from the submitting service.
"""
from __future__ import annotations

import logging
import os
import time

log = logging.getLogger(__name__)

ENV = "ISLANDS_FAILPOINT"
SLOW_ENV = "ISLANDS_SLOWPOINT"


def failpoint(name: str) -> None:
    if os.environ.get(ENV) == name:
        os._exit(137)  # no cleanup, no finally blocks: like a kill -9 or a node dying


def armed(name: str) -> bool:
    """Is the point `name` named by ISLANDS_FAILPOINT (a point that changes a result rather than
    crash: `worker_001.replica` makes worker 1's replayed global differ, worker/replica.py)?"""
    return os.environ.get(ENV) == name


def slowpoint(name: str) -> None:
    for item in os.environ.get(SLOW_ENV, "").split(","):
        point, _, seconds = item.partition("=")
        if point.strip() == name:
            log.warning("slowpoint %s: sleeping %ss (%s)", name, seconds, SLOW_ENV)
            time.sleep(float(seconds))
