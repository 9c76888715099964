"""A scheduler-neutral job state (local processes and Slurm jobs alike)."""
from __future__ import annotations

import datetime as dt
import time
from dataclasses import dataclass

# States in which a job may still produce its contribution (PREEMPTED/REQUEUED come back).
ACTIVE = frozenset({"PENDING", "RUNNING", "REQUEUED", "COMPLETING", "CONFIGURING", "SUSPENDED", "RESIZING",
                    "PREEMPTED", "REQUEUE_HOLD", "REQUEUE_FED", "UNKNOWN"})


@dataclass
class JobStatus:
    job_id: str
    state: str
    """Scheduler state, e.g. PENDING, RUNNING, COMPLETED, FAILED, "CANCELLED by alice"."""
    submit: str | None = None
    start: str | None = None
    end: str | None = None

    @property
    def alive(self) -> bool:
        return self.state.split()[0] in ACTIVE

    def timing(self, now: float | None = None) -> dict[str, float | None]:
        """Queue wait and run time in seconds, where the scheduler reported them."""
        sub, start, end = _epoch(self.submit), _epoch(self.start), _epoch(self.end)
        now = time.time() if now is None else now
        return {"queue_wait_s": None if sub is None else round((start if start is not None else now) - sub, 1),
                "run_s": None if start is None else round((end if end is not None else now) - start, 1)}

    def as_dict(self) -> dict[str, object]:
        return {"job_id": self.job_id, "state": self.state, **self.timing()}


def _epoch(stamp: str | None) -> float | None:
    """Slurm's local-time ISO stamps (2026-11-22T05:02:47) as epoch seconds."""
    if not stamp:
        return None
    try:
        return dt.datetime.fromisoformat(stamp).timestamp()
    except ValueError:
        return None
