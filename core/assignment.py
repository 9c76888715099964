"""What a worker job is asked to do (its assignment): plain data only (no tensors, no open handles).

submitit pickles this into its own job folder; everything else the worker needs (config, weights,
its own optimizer state) it reads from the run directory, so a requeued job needs nothing more.
"""
from __future__ import annotations

import os
from contextvars import ContextVar
from dataclasses import dataclass

INLINE_JOB_ID: ContextVar[str | None] = ContextVar("islands_inline_job_id", default=None)
"""The job id of an inline job (executor.kind inline: a thread of the orchestrating process), set
on its thread; a process's job has its id in its environment instead."""


def current_job_id() -> str | None:
    """This job's id as the scheduler (and so the merge service) names it: 12_3 for array tasks."""
    env = os.environ
    if (inline := INLINE_JOB_ID.get()) is not None:
        return inline
    if env.get("SLURM_ARRAY_JOB_ID") and env.get("SLURM_ARRAY_TASK_ID"):
        return f"{env['SLURM_ARRAY_JOB_ID']}_{env['SLURM_ARRAY_TASK_ID']}"
    return env.get("SLURM_JOB_ID") or env.get("SUBMITIT_LOCAL_JOB_ID")


@dataclass(frozen=True)
class Assignment:
    run_url: str
    """The run directory (any fsspec URL)."""
    round: int
    """The round to train."""
    worker: int
    """Worker id, 0..K-1: picks the data shard and the worker's own optimizer state."""
    base_key: str
    """Checkpoint the round starts from: the global weights, or the worker's own last weights
    (when its previous contribution missed the merge and the late policy is `continue`)."""
    attempt: int = 0
    """How often this (round, worker) was submitted before; logged and recorded."""
    threads: int = 0
    """torch CPU threads (0 = leave torch's default)."""
    persistent: bool = False
    """Serve this round and then the following ones (round.worker_mode: persistent)."""
