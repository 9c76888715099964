"""What the merge service writes about a round: the jobs it submitted and the record that commits it.

Both are JSON files in the run directory (rounds/r/jobs.json, rounds/r/record.json; their keys in
docs/observability.md), read back by a resumed service, `status`, `report` and the chaos check.
Reading one checks its shape: a file that is not what the service wrote is refused with its path.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from core.errors import RunError
from core.layout import RunLayout
from core.storage import Storage

L = RunLayout()


def text(v: Any, limit: int = 4000) -> str | None:
    """A string from a run directory, fit for a terminal: control characters (escape sequences that
    retitle a window or clear a screen) removed, length bounded; None for anything not a string."""
    if not isinstance(v, str):
        return None
    return "".join(c for c in v[:limit] if c.isprintable() or c in "\n\t")


def number(v: Any) -> float | None:
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    return v if ok else None


LIMIT = 16 << 20


@dataclass
class JobEntry:
    """One worker's jobs in a round: every attempt's job id, and what it was asked to train from."""

    attempts: int = 0
    job_ids: list[str] = field(default_factory=list)
    base: str = ""
    """The checkpoint the worker starts the round from."""
    base_digest: str = ""
    """Its digest: a contribution naming another base is stale."""
    persistent: bool = False
    submitted_at: float = 0.0
    failures: list[dict[str, Any]] = field(default_factory=list)
    """Each attempt that ended without a contribution (its state and log tail), or was rejected."""

    @property
    def latest(self) -> str:
        return self.job_ids[-1]


@dataclass
class RoundJobs:
    round: int
    workers: dict[int, JobEntry] = field(default_factory=dict)
    submitted_at: float | None = None
    """When the round's first jobs were submitted (the deadline counts from it)."""
    sbatch_calls: int = 0

    def latest(self) -> dict[int, str]:
        """worker -> its latest job id."""
        return {w: e.latest for w, e in self.workers.items()}

    def to_json(self) -> dict[str, Any]:
        return {"round": self.round, "submitted_at": self.submitted_at, "sbatch_calls": self.sbatch_calls,
                "workers": {str(w): dataclasses.asdict(e) for w, e in sorted(self.workers.items())}}

    @classmethod
    def load(cls, storage: Storage, r: int) -> RoundJobs:
        raw = storage.read_json(L.round_jobs(r), limit=LIMIT)
        if raw is None:
            return cls(r)
        try:
            workers = {int(w): _entry(e) for w, e in raw["workers"].items()}
            return cls(r, workers, raw.get("submitted_at"), int(raw.get("sbatch_calls", 0)))
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise RunError(f"{storage.display(L.round_jobs(r))} is not a jobs file this service wrote "
                           f"({type(exc).__name__}: {exc}); move it aside and `orchestrate resume` resubmits the round") from None

    def save(self, storage: Storage) -> None:
        storage.write_json(L.round_jobs(self.round), self.to_json())


def _entry(raw: dict[str, Any]) -> JobEntry:
    known = {f.name for f in dataclasses.fields(JobEntry)}
    e = JobEntry(**{k: v for k, v in raw.items() if k in known})
    if not e.job_ids or not all(isinstance(j, str) for j in e.job_ids) or not isinstance(e.attempts, int):
        raise ValueError("job_ids must be a non-empty list of strings and attempts an int")
    return e


@dataclass
class RoundRecord:
    """The commit of round r, written last: global_{r+1} and outer/state_{r+1} exist once it does."""

    round: int
    merged: list[int]
    """Workers whose on-time contributions were merged."""
    dropped: list[int]
    """Workers not merged and not rejected (ended without a contribution, or stragglers)."""
    rejected: list[int]
    rejected_reasons: dict[str, str]
    dropped_reasons: dict[str, str]
    late: list[int]
    """Dropped workers whose contribution had arrived by the time of the record (too late)."""
    reason: str
    """Why the round was merged when it was (orchestrator.plan.decide)."""
    merge_seconds: float
    bytes_read: int
    outer_grad_norm: float | None
    weights: dict[str, float]
    submitted_at: float
    merge_started_at: float
    committed_at: float
    global_digest: str
    merge_order: list[int]
    """The order the inputs were summed in (floating-point sums depend on it): a replay needs it."""
    contrib_digest: dict[str, str]
    folded: list[dict[str, Any]]
    fold_rejected: list[dict[str, Any]]
    worker_idle_s: dict[str, float]
    """Persistent workers: seconds each sat idle before the round, waiting for its global (not the queue)."""
    jobs: dict[str, dict[str, Any]]
    """worker -> its latest job's state, queue wait, run time and attempts."""
    eval_loss: float | None = None
    """Filled in after the commit (the evaluation is off the critical path)."""
    worker_train_s: dict[str, float] = field(default_factory=dict)
    """Seconds each contributing worker spent on the round: loading its base, training, writing its contribution."""

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def load(cls, storage: Storage, r: int) -> RoundRecord | None:
        raw = storage.read_json(L.round_record(r), limit=LIMIT)
        if raw is None:
            return None
        known = {f.name for f in dataclasses.fields(cls)}
        try:
            return cls(**{k: v for k, v in raw.items() if k in known})
        except TypeError as exc:
            raise RunError(f"{storage.display(L.round_record(r))} is not a round record this service wrote: {exc}") from None

    def save(self, storage: Storage) -> None:
        storage.write_json(L.round_record(self.round), self.to_json())


def utilization(records: Iterable[Mapping[str, Any]]) -> float | None:
    """Busy time / (busy + idle) of the persistent workers in `records` (round records as JSON):
    how much of the time their nodes were held they trained. None without persistent workers
    (a per-round job's node is given back between rounds: its idle time is not measured)."""
    busy = idle = 0.0
    for rec in records:
        train, wait = rec.get("worker_train_s") or {}, rec.get("worker_idle_s") or {}
        for w in set(train) & set(wait):
            busy, idle = busy + train[w], idle + wait[w]
    return round(busy / (busy + idle), 4) if busy + idle > 0 else None
