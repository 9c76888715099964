"""One error family for the whole toolkit.

Every error says what went wrong, where (file, tensor, worker, job id) and how to fix it, so a
message read in a Slurm log at 3 a.m. is enough to act on. Problems are collected and raised once.
"""
from __future__ import annotations

from collections.abc import Iterable


class IslandsError(Exception):
    """Base class: catch this at the CLI edge and print the message, no traceback."""


class ConfigError(IslandsError):
    """The configuration is invalid. Carries every problem found, not just the first."""

    def __init__(self, problems: Iterable[str], source: str = "configuration") -> None:
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"{len(self.problems)} problem(s) in {source}:\n{lines}")


class StorageError(IslandsError):
    """Reading or writing the run directory failed (after retries where retrying made sense)."""


class CheckpointError(IslandsError):
    """A checkpoint is missing, truncated, corrupt, or does not match what it should be."""


class NotARegularFile(CheckpointError):
    """A path in a run directory is a link, a FIFO, a device or a folder, or resolves outside the
    run: islands reads only regular files inside the run directory (core.storage)."""


class ContributionRejected(CheckpointError):
    """One worker's contribution cannot be merged; the round goes on without it."""

    def __init__(self, worker: int, reason: str) -> None:
        self.worker = worker
        self.reason = reason
        super().__init__(f"worker {worker}: {reason}")


class RunError(IslandsError):
    """The run cannot proceed (quorum impossible, run directory in use, cancelled...)."""
