"""`executor.kind: inline`: each worker job is a thread of the orchestrating process.

For debugging and for tests: a breakpoint, a profiler or a debugger attached to `orchestrate
submit` sees every worker, and a run starts no interpreter (and imports no torch) per worker. The
model is submitit's DebugExecutor, which runs a job in the calling process; here the job runs at
once, on a thread of its own, so the merge service polls it as it polls any job. What a process
gives and a thread cannot: nothing survives the orchestrating process (a `resume` resubmits), a
job has one rank, and a cancelled job stops at its next Python line, its `finally` blocks run
(a process is killed outright). The registry is the process's own, so every Executor of this
process (a run's service, then `status` or `cancel` in the same process) sees the same jobs.
"""
from __future__ import annotations

import ctypes
import datetime as dt
import itertools
import logging
import os
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from core.assignment import INLINE_JOB_ID
from orchestrator.jobstatus import JobStatus

log = logging.getLogger(__name__)


class JobCancelled(BaseException):
    """Raised in a cancelled job's thread (a BaseException: no `except Exception` of the worker takes it)."""


def _now() -> str:
    return dt.datetime.now().isoformat(timespec="milliseconds")


@dataclass
class _Job:
    thread: threading.Thread
    start: str = field(default_factory=_now)
    end: str | None = None
    state: str = "RUNNING"
    error: str = ""


_JOBS: dict[str, _Job] = {}
_LOCK = threading.Lock()
_IDS = itertools.count()


def submit(fn: Callable[[Any], Any], arg: Any) -> str:
    """Start `fn(arg)` on a daemon thread; its job id, `PID_N` (unique in this process).

    torch's intra-op thread count is partly the process's (MKL's is global, and a thread takes
    the process's count at its first operation), and the service changes it around a merge; so
    the whole process runs one intra-op thread, as each inline worker does (its assignment says
    1): what a worker computes then does not depend on when the service merged, and a run is
    bit-reproducible. K workers are K threads: the cores are still used."""
    import torch
    torch.set_num_threads(1)
    job_id = f"{os.getpid()}_{next(_IDS)}"

    def run() -> None:
        INLINE_JOB_ID.set(job_id)  # what the worker reads as its job id (core.assignment.current_job_id)
        state, error = "COMPLETED", ""
        try:
            fn(arg)
        except JobCancelled:
            pass  # cancel() marked it CANCELLED
        except BaseException:  # a job's failure is its state, as a process's is: never the service's
            state, error = "FAILED", traceback.format_exc()
            log.warning("inline job %s failed:\n%s", job_id, error)
        with _LOCK:
            job = _JOBS[job_id]
            if job.state != "CANCELLED":
                job.state = state
            job.end, job.error = _now(), error

    thread = threading.Thread(target=run, name=f"islands-job-{job_id}", daemon=True)
    with _LOCK:
        _JOBS[job_id] = _Job(thread)
    thread.start()
    return job_id


def status(job_id: str) -> JobStatus:
    """A job of this process as it stands. One of another process is out of sight: ENDED (not a
    state of the living, so a resume, whose lease says that process's service is gone, resubmits
    its work; `status` from another terminal says what it knows)."""
    with _LOCK:
        job = _JOBS.get(job_id)
        if job is None:
            return JobStatus(job_id, "ENDED")
        return JobStatus(job_id, job.state, job.start, job.start, job.end)


def running() -> list[str]:
    """This process's jobs whose threads still run."""
    with _LOCK:
        return [j for j, job in _JOBS.items() if job.thread.is_alive()]


def cancel(job_id: str) -> None:
    """Mark the job CANCELLED and stop its thread with JobCancelled at its next Python line."""
    with _LOCK:
        job = _JOBS.get(job_id)
        if job is None or not job.thread.is_alive():
            return
        job.state = "CANCELLED"
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(job.thread.ident), ctypes.py_object(JobCancelled))


def error_tail(job_id: str, lines: int) -> str:
    """The end of a failed job's traceback (what a process's stderr would end with)."""
    with _LOCK:
        job = _JOBS.get(job_id)
    return "" if job is None else "\n".join(job.error.strip().splitlines()[-lines:])
