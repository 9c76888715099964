"""A scheduler-neutral job state (local processes and Slurm jobs alike)."""
from __future__ import annotations

from dataclasses import dataclass

# States in which a job may still produce its contribution (PREEMPTED/REQUEUED come back).
ACTIVE = frozenset({"PENDING", "RUNNING", "REQUEUED", "COMPLETING", "CONFIGURING", "SUSPENDED", "RESIZING",
                    "PREEMPTED", "REQUEUE_HOLD", "REQUEUE_FED", "UNKNOWN"})


@dataclass
class JobStatus:
    job_id: str
    state: str
    """Scheduler state, e.g. PENDING, RUNNING, COMPLETED, FAILED, "CANCELLED by 0"."""
    submit: str | None = None
    start: str | None = None
    end: str | None = None

    @property
    def alive(self) -> bool:
        return self.state.split()[0] in ACTIVE
