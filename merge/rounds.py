"""One round's merge for the merge service: the contributions of a round and the global weights
in, the next global weights (and outer optimizer state) out, bad contributions rejected.

The linear merge (`average`, DiLoCo's and lo-fi's) sums the contributions first, one at a time
(merge.incremental.RunningSum, which also decodes delta contributions) and streams that one mean
through the outer step; the other methods stream every input at once through the engine
(merge.engine.run_merge), retried without a contribution the engine refuses.
"""
from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from core.checkpoint import TensorSpec
from core.config import OuterConfig
from core.errors import CheckpointError, ContributionRejected, RunError
from core.storage import Storage
from merge.engine import MergeStats, compare_specs, model_specs, run_merge
from merge.outer import state_out_specs
from merge.reader import ITEMSIZE, InputError, Model, open_file_model
from merge.writer import OutputFile, PendingWrite

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Contribution:
    worker: int
    key: str
    weight: float


@dataclass
class MergeResult:
    merged: list[int]
    rejected: dict[int, str]
    bytes_read: int
    seconds: float
    outer_grad_norm: float
    manifest: dict[str, Any] = field(default_factory=dict)
    order: list[int] = field(default_factory=list)
    """The order the inputs were summed in (merge/incremental.py), when it matters to the bytes."""
    pending_state: PendingWrite | None = None
    """With `defer_state`: the new outer state, not written yet (PendingWrite.start / wait)."""


class QuorumError(RunError):
    """Too few valid contributions remain; `rejected` says which were refused and why."""

    def __init__(self, message: str, rejected: dict[int, str]) -> None:
        super().__init__(message)
        self.rejected = rejected


def merge_round(
    storage: Storage,
    base_key: str,
    contributions: Sequence[Contribution],
    out_key: str,
    outer: OuterConfig,
    *,
    state_in_key: str | None,
    state_out_key: str | None,
    min_inputs: int = 1,
    method: str = "average",
    metadata: Mapping[str, str] | None = None,
    manifest: Mapping[str, Any] | None = None,
    accumulator: Any = None,
    defer_state: bool = False,
) -> MergeResult:
    """Merge `contributions` into the weights at `base_key`; write `out_key` (and the outer state).

    Rejected contributions are reported in the result, not raised; RunError if fewer than
    `min_inputs` valid ones remain. `average` is summed in the contributions' order, or through
    `accumulator` (a merge.incremental.RunningSum folded while they arrived), which decode delta
    contributions (core/codec.py); the other methods stream every input at once, here.
    `defer_state`: the new outer state is returned unwritten, as the result's `pending_state`
    (the service writes it after the round's record: the next round needs only the new global).
    """
    if method == "average":
        return merge_summed(storage, base_key, contributions, out_key, outer, accumulator=accumulator,
                            state_in_key=state_in_key, state_out_key=state_out_key, min_inputs=min_inputs,
                            metadata=metadata, manifest=manifest, defer_state=defer_state)
    t0 = time.perf_counter()
    rejected: dict[int, str] = {}
    live = list(contributions)
    while True:
        if len(live) < min_inputs:
            raise QuorumError(f"only {len(live)} valid contribution(s) for {out_key}, the quorum is {min_inputs}; "
                              f"rejected: {rejected or 'none'}", rejected)
        try:
            stats = _merge_once(storage, base_key, live, out_key, outer, state_in_key, state_out_key,
                                method, metadata, manifest, defer_state)
        except ContributionRejected as exc:
            log.warning("merge: rejected worker %d: %s", exc.worker, exc.reason)
            rejected[exc.worker] = exc.reason
            live = [c for c in live if c.worker != exc.worker]
            continue
        return MergeResult(merged=[c.worker for c in live], rejected=rejected, bytes_read=stats.bytes_read,
                           seconds=time.perf_counter() - t0, outer_grad_norm=stats.grad_sq ** 0.5,
                           manifest=stats.manifests[0], pending_state=stats.pending_state)


def _merge_once(storage, base_key, live, out_key, outer, state_in_key, state_out_key, method, metadata,
                manifest, defer_state=False) -> MergeStats:
    opened: list[Model] = []
    try:
        base = open_file_model(storage, base_key, f"global weights {storage.display(base_key)}", "base",
                               require_manifest=True)
        opened.append(base)
        ref = model_specs(base)
        inputs = []
        for c in live:
            try:
                m = open_file_model(storage, c.key, f"worker {c.worker} ({storage.display(c.key)})", c.worker,
                                    require_manifest=True)
            except CheckpointError as exc:
                raise ContributionRejected(c.worker, str(exc)) from None
            opened.append(m)
            problems = compare_specs(ref, model_specs(m), "the global weights")
            if problems:
                raise ContributionRejected(c.worker, problems[0])
            inputs.append(m)
        state_in = None
        if state_in_key is not None:
            state_in = open_file_model(storage, state_in_key, f"outer optimizer state {storage.display(state_in_key)}",
                                       "state", require_manifest=True)
            opened.append(state_in)
    except BaseException:
        for m in opened:
            m.close()
        raise
    out, state_out = round_outputs(storage, ref, out_key, state_out_key, outer, metadata, manifest)
    try:
        return run_merge(inputs, [c.weight for c in live], "outer", [out], params={"optimizer": outer, "inner": method},
                         base=base, state_in=state_in, state_out=state_out, defer_state=defer_state)
    except InputError as exc:
        if isinstance(exc.ident, int):
            raise ContributionRejected(exc.ident, exc.reason) from None
        raise CheckpointError(exc.reason) from None


def round_outputs(storage: Storage, ref: Mapping[str, TensorSpec], out_key: str, state_out_key: str | None,
                  outer: OuterConfig, metadata: Mapping[str, str] | None, manifest: Mapping[str, Any] | None
                  ) -> tuple[OutputFile, OutputFile | None]:
    """The files a round's merge writes: the next global weights, laid out as `ref` (the current
    ones), and the outer optimizer's state if `state_out_key` is given."""
    order = [(n, sp.dtype, sp.shape) for n, sp in ref.items()]
    out = OutputFile(storage, out_key, [(n, d, sh, math.prod(sh) * ITEMSIZE[d]) for n, d, sh in order], metadata,
                     dict(manifest or {}))
    state_out = None if state_out_key is None else OutputFile(
        storage, state_out_key, state_out_specs(order, outer), None, {"optimizer": outer.optimizer})
    return out, state_out


def merge_summed(storage: Storage, base_key: str, contributions: Sequence[Contribution], out_key: str,
                 outer: OuterConfig, *, accumulator: Any = None, **kw: Any) -> MergeResult:
    """merge_round for the linear merge: through `accumulator` (a merge.incremental.RunningSum: what
    a streaming service folded so far) or a fresh one fed `contributions` in their order."""
    from merge.incremental import RunningSum  # it builds on this module's types

    acc = accumulator if accumulator is not None else RunningSum(storage, base_key)
    return acc.merge(contributions, out_key, outer, **kw)
