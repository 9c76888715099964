"""The round a worker is training, and when its training stops: plain data and pure rules.

`RoundInProgress` holds every fact of one (round, worker) as it is trained, read and published:
which assignment, from which base (`Base`: how the worker took it in), how far, for how long, and
(round.overlap) how far ahead of its base. A new round is a new one: nothing of the previous round
leaks into it. `StopRule` decides when a round's training stops (its steps, its time budget, its
share trained ahead of its base, or the steps a replay's source run took) and `lr_at` the learning
rate of a global step.
"""
from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

import torch

from core.assignment import Assignment
from core.config import Config
from core.replay import Schedule
from worker.ranks import Ranks


@dataclasses.dataclass(frozen=True)
class Base:
    """The round's base weights as this worker took them in."""
    digest: str
    """Of the global checkpoint the round trains from, recorded in its contribution."""
    weights: dict[str, torch.Tensor] | None
    """Kept to code a delta contribution from (round.contribution delta); None otherwise."""
    replayed: bool
    """Made from the previous round's contributions (worker/replica.py), not read."""
    seconds: float
    """Seconds it took to have the base in the model (read, or replayed)."""
    at: float
    """When (epoch seconds) the base was in the model: the round's turnaround ends there."""


@dataclasses.dataclass
class RoundInProgress:
    """One (round, worker) of this job, from its start to its publish."""
    assignment: Assignment
    """The round, the worker, the base checkpoint and the attempt this job was given."""
    step0: int
    """The global step the round starts at (round x inner.steps): the lr schedule and the batches."""
    base: Base | None = None
    """The round's base, once it is in the model (round.overlap: None while training ahead of it)."""
    done: int = 0
    """Inner steps taken."""
    finished: bool = False
    """Its steps, or its time budget, are spent (not stopped early to adopt a base)."""
    trained_s: float = 0.0
    """Seconds of training (round.budget seconds spends them); a resumed round goes on from its checkpoint's."""
    started: float | None = None
    """time.monotonic() at which training would have started had it run without a break, while it trains."""
    losses: list[float] = dataclasses.field(default_factory=list)
    """The loss of every step taken, averaged over the job's ranks."""
    waited_s: float | None = None
    """A persistent worker's idle wait before this round."""
    resumed_at: int | None = None
    """The step of the in-flight checkpoint this job resumed the round from."""
    inflight_at: int | None = None
    """The step of the in-flight checkpoint this job saved."""
    state_from: int | None = None
    """The round of the optimizer-state snapshot the round started from, when read from storage."""
    state_refused: list[int] = dataclasses.field(default_factory=list)
    """The rounds of the snapshots refused (set aside) before it: it started from an older one, or fresh."""
    state_fresh: bool = False
    """A job's first round, past round 0, started from fresh AdamW state: no usable snapshot on storage."""
    published: dict[str, torch.Tensor] | None = None
    """round.overlap, while training ahead of its base: the weights the previous round published."""
    adopted_at: int | None = None
    """round.overlap: the step at which the round's base was adopted."""
    ahead_s: float = 0.0
    """round.overlap: seconds trained on this round before its base existed (part of its busy time)."""

    @classmethod
    def start(cls, assignment: Assignment, cfg: Config) -> RoundInProgress:
        return cls(assignment, step0=assignment.round * cfg.inner.steps)

    @property
    def worker(self) -> int:
        return self.assignment.worker

    @property
    def number(self) -> int:
        return self.assignment.round

    @property
    def base_digest(self) -> str:
        """The base's digest; "" while training ahead of it."""
        return self.base.digest if self.base is not None else ""

    @property
    def ahead(self) -> bool:
        """Training before the round's base exists (round.overlap)."""
        return self.published is not None

    def training_s(self) -> float:
        """Seconds of training so far (also mid-round, from a preemption handler)."""
        return self.trained_s if self.started is None else time.monotonic() - self.started

    def overlap_record(self, cfg: Config) -> dict[str, Any] | None:
        """What the contribution's manifest says of a round that began ahead of its base."""
        if self.adopted_at is None:
            return None
        rc = cfg.round
        return {"mode": rc.overlap, "adopted_at_step": self.adopted_at, "ahead_s": round(self.ahead_s, 3),
                **({"mix": rc.overlap_mix} if rc.overlap == "mix" else {})}


def lr_at(step: int, cfg: Config) -> float:
    """Linear warm-up, then cosine decay to lr * min_lr_ratio at the worker's last step (T x H)."""
    inner = cfg.inner
    if step < inner.warmup_steps:
        return inner.lr * (step + 1) / inner.warmup_steps
    span = max(1, cfg.total_inner_steps - inner.warmup_steps)
    progress = min(1.0, (step - inner.warmup_steps) / span)
    floor = inner.lr * inner.min_lr_ratio
    return floor + 0.5 * (1.0 + math.cos(math.pi * progress)) * (inner.lr - floor)


@dataclasses.dataclass(frozen=True)
class StopRule:
    """When a round's training stops."""
    cfg: Config
    replay: Schedule | None
    """A replay (round.replay): the steps and adoption steps its source run recorded."""
    ranks: Ranks
    """The job's ranks: all stop at the same step, on rank 0's clock."""

    def spent(self, rnd: RoundInProgress) -> bool:
        """Are the round's steps, or its time budget, spent (round.budget; after one step at least)?
        Training ahead (round.overlap): its share ahead, round.overlap_ahead of either. A replay: its
        recorded steps, whatever its budget."""
        cfg, rc = self.cfg, self.cfg.round
        if self.replay is not None:
            return rnd.done >= self.replay.steps[rnd.number, rnd.worker]
        share = rc.overlap_ahead if rnd.ahead else 1.0
        if rnd.done >= math.ceil(share * cfg.inner.steps):
            return True
        if rc.budget != "seconds" or rnd.done == 0:
            return False
        # round.overlap: the budget runs from the adoption of the round's global (the ahead_s before it
        # are extra), so every worker publishes S after its global and none drifts towards a round ahead
        spent = rnd.training_s() - rnd.ahead_s >= share * rc.budget_seconds
        return bool(self.ranks.lead_says(spent)) if self.ranks.world > 1 else spent

    def adoption(self, rnd: RoundInProgress, ahead: int = 0) -> int | None:
        """A replay: the step at which the source run's worker adopted its base in round rnd + `ahead`;
        None when it trained that round from its base, or when this run is no replay."""
        return None if self.replay is None else self.replay.adopted_at.get((rnd.number + ahead, rnd.worker))
