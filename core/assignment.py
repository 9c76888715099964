"""What a worker job is asked to do (its assignment): plain data only (no tensors, no open handles).

submitit pickles this into its own job folder; everything else the worker needs (config, weights,
its own optimizer state) it reads from the run directory, so a requeued job needs nothing more.
"""
from __future__ import annotations

from dataclasses import dataclass


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
