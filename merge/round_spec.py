"""What one round's merge is asked to do (RoundSpec) and what it reports (MergeResult).

The merge service builds a RoundSpec per round (orchestrator/round_merge.py), as do the rebuild of a
lost outer state and the replay; the merge functions take it whole, so that what a round reads,
writes and merges by is one typed object, not arguments passed down through the layers.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from core.config import OuterConfig
from core.errors import CheckpointError, RunError


@dataclass(frozen=True)
class Contribution:
    """One input of a round's merge: a worker's checkpoint and the weight the service gave it."""

    worker: int
    """The worker id (a late fold's input: a negative id, orchestrator/late.py)."""
    key: str
    """Its checkpoint in the run's storage."""
    weight: float
    """Its weight in the mean: derived from what the service asked of the worker, never from its manifest."""
    bound: float = math.inf
    """The largest magnitude an entry of its outer gradient may have (core.codec.max_update; the
    service's inputs); inf: not checked (a rebuild or late fold of what was checked already)."""

    def check_weight(self, label: str) -> None:
        if not (isinstance(self.weight, (int, float)) and math.isfinite(self.weight) and self.weight > 0):
            raise CheckpointError(f"{label}: its weight {self.weight!r} is not a positive finite number")


@dataclass(frozen=True)
class LteRule:
    """How an LTE round folds the heads into the base (merge/lte.py)."""

    scale: float
    """s in W <- W + s * sum_n c_n B_n A_n: lte.alpha / lte.rank."""
    rank: int | None = None
    """Every head's rank, checked; None: any."""
    expected: Mapping[str, tuple[int, ...]] | None = None
    """The tensor names and shapes a contribution must carry; None: the first valid one's."""


@dataclass(frozen=True)
class RoundSpec:
    """What one round's merge reads and writes, and the rules it merges by."""

    base: str
    """The global weights the round's workers trained from (global_r)."""
    out: str
    """Where the next global weights go (global_{r+1})."""
    outer: OuterConfig | None = None
    """The outer optimizer (diloco, lofi, fedavg); None with `lte`."""
    state_in: str | None = None
    """The outer optimizer state the step starts from; None: zero state (the first round)."""
    state_out: str | None = None
    """Where the new outer state goes, published with the new global weights."""
    lte: LteRule | None = None
    """An LTE round: the heads folded into the base, no outer optimizer."""
    min_inputs: int = 1
    """The quorum: fewer valid contributions raise QuorumError and nothing is written."""
    aggregate: str = "mean"
    """round.aggregate: mean, or a robust median / trimmed_mean (merge/robust.py)."""
    trim: float = 0.2
    """round.trim: the share cut from each end by trimmed_mean."""
    metadata: Mapping[str, str] = field(default_factory=dict)
    """safetensors metadata of the new global weights (the model's config)."""
    manifest: Mapping[str, Any] = field(default_factory=dict)
    """Fields of the new global's manifest (its round)."""


@dataclass
class MergeResult:
    merged: list[int]
    rejected: dict[int, str]
    bytes_read: int
    seconds: float
    outer_grad_norm: float
    manifest: dict[str, Any] = field(default_factory=dict)
    order: list[int] = field(default_factory=list)
    """The order the inputs were summed in, which the bytes depend on."""


class QuorumError(RunError):
    """Too few valid contributions remain; `rejected` says which were refused and why."""

    def __init__(self, message: str, rejected: dict[int, str]) -> None:
        super().__init__(message)
        self.rejected = rejected
