"""Pure decisions of the round loop: no I/O, no clocks, no scheduler. Tested with plain values.

Given who has contributed, whose job is still alive and how often each was submitted, decide
whether to wait, merge, resubmit lost workers, or give up; once merged, which workers were dropped,
why, and whose jobs are cancelled; which weights each worker starts the next round from; and what
a contribution weighs in the merge.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from core.config import Config


@dataclass(frozen=True)
class WorkerView:
    worker: int
    arrived: bool
    """A published (manifest-complete) contribution for this round exists."""
    alive: bool
    """Its latest job is pending or running."""
    attempts: int
    """Jobs submitted for this (round, worker) so far, less those islands stopped itself."""


@dataclass(frozen=True)
class Decision:
    action: Literal["wait", "merge", "resubmit", "fail"]
    workers: tuple[int, ...] = ()
    """merge: the contributions to merge; resubmit: the workers to submit again."""
    reason: str = ""


def decide(
    views: Sequence[WorkerView], *, quorum: int, elapsed_s: float, deadline_s: float, max_retries: int
) -> Decision:
    arrived = tuple(v.worker for v in views if v.arrived)
    pending = [v.worker for v in views if not v.arrived and v.alive]
    lost = [v for v in views if not v.arrived and not v.alive]
    retry = tuple(v.worker for v in lost if v.attempts <= max_retries)
    if not pending and not lost:
        return Decision("merge", arrived, "every worker contributed")
    if len(arrived) >= quorum:
        if not pending and not retry:
            return Decision("merge", arrived, f"quorum in; workers {[v.worker for v in lost]} ended without a contribution")
        if deadline_s > 0 and elapsed_s >= deadline_s:
            return Decision("merge", arrived, f"deadline of {deadline_s:g}s passed with the quorum in; dropping {pending + [v.worker for v in lost]}")
    if retry:
        return Decision("resubmit", retry, f"workers {list(retry)} ended without a contribution")
    if pending:
        return Decision("wait", (), f"waiting for workers {pending}")
    if len(arrived) >= quorum:
        return Decision("merge", arrived, "quorum in; nothing else can arrive")
    return Decision("fail", (), f"only {len(arrived)} of the quorum of {quorum} contributed and workers "
                    f"{[v.worker for v in lost]} failed {max_retries + 1} time(s) each")


@dataclass(frozen=True)
class JobView:
    job_id: str
    state: str
    """The scheduler's word for it (RUNNING, COMPLETED, ...)."""
    alive: bool
    """Pending or running."""


@dataclass(frozen=True)
class Dropped:
    """The workers of a merged round in neither its merged nor its rejected list."""
    workers: tuple[int, ...]
    reasons: dict[str, str]
    """Worker (as a str, the record's key) -> why it is not in the merge."""
    ended: tuple[int, ...]
    """Those whose job ended without a contribution: lost work, to record."""
    cancel: tuple[str, ...]
    """The jobs of stragglers to cancel (none while a later round can fold their work in)."""


def dropped_workers(workers: int, merged: Sequence[int], rejected: Sequence[int], jobs: Mapping[int, JobView],
                    *, runs_on: bool) -> Dropped:
    """Who a merged round dropped and what becomes of them. `jobs`: each worker's latest job;
    `runs_on`: late_policy fold with a later round to fold a straggler's work into."""
    dropped = tuple(sorted(set(range(workers)) - set(merged) - set(rejected)))
    reasons, ended, cancel = {}, [], []
    for w in dropped:
        job = jobs[w]
        if job.alive:
            reasons[str(w)] = (f"still {job.state} at the merge (straggler): job {job.job_id} "
                               + ("runs on, to be folded in later" if runs_on else "cancelled"))
            if not runs_on:
                cancel.append(job.job_id)
        else:
            reasons[str(w)] = f"job {job.job_id} ended {job.state} without a contribution"
            ended.append(w)
    return Dropped(dropped, reasons, tuple(ended), tuple(cancel))


def next_bases(
    workers: int, merged: Sequence[int], late: Mapping[int, str], policy: str, global_key: str
) -> dict[int, str]:
    """The checkpoint each worker starts the next round from.

    `late` maps a worker whose published contribution was not merged (dropped, not rejected) to
    that contribution's key. With policy `continue` such a worker trains on from its own weights,
    as in the DiLoCo paper's dropped outer gradients; everyone else starts from the new global.
    Under `drop`/`restart` the late work is discarded and under `fold` it reaches the global model
    through a later merge (fold_plan), so those workers start from the new global too.
    """
    bases = {}
    for w in range(workers):
        if policy == "continue" and w not in merged and w in late:
            bases[w] = late[w]
        else:
            bases[w] = global_key
    return bases


@dataclass(frozen=True)
class Fold:
    from_round: int
    """The round the late contribution was trained for."""
    worker: int
    staleness: int
    """Rounds late: the merging round minus from_round (>= 1)."""
    factor: float
    """staleness_decay ** staleness: what its usual weight is multiplied by."""


def fold_plan(
    merging: int, unmerged: Mapping[int, Sequence[int]], done: set[tuple[int, int]], *, decay: float, max_staleness: int
) -> list[Fold]:
    """Which late contributions the merge of round `merging` folds in, in a fixed order (so a
    replay merges them identically): every (round, worker) published but never merged, rejected
    or folded before (`done`), at most `max_staleness` rounds late, sorted by round then worker."""
    out = []
    for q in sorted(unmerged):
        late = merging - q
        if not 1 <= late <= max_staleness:
            continue
        for w in sorted(set(unmerged[q])):
            if (q, w) not in done:
                out.append(Fold(q, w, late, decay ** late))
    return out


def contribution_weight(manifest: Mapping[str, Any], cfg: Config) -> float | str:
    """A contribution's weight in its round's merge, or why it cannot have one (a str).

    Never taken on the manifest's word: with `outer.weighting: tokens` it is the tokens of the
    steps the worker trained, steps x the worker's batch x the block size (other tasks: examples), all but the step count
    fixed by the run's config; the step count must lie in [1, inner.steps], and the manifest's own
    `tokens`, when it has one, must be that product (a worker writes exactly that). `uniform`: 1."""
    if cfg.outer.weighting != "tokens":
        return 1.0
    steps, claimed = manifest.get("steps"), manifest.get("tokens")
    if not (isinstance(steps, int) and not isinstance(steps, bool) and 1 <= steps <= cfg.inner.steps):
        return f"its manifest says it trained {steps!r} steps, not a whole number in [1, inner.steps = {cfg.inner.steps}]"
    tokens = steps * cfg.worker_batch_size * cfg.tokens_per_example
    if claimed is not None and not (isinstance(claimed, (int, float)) and math.isfinite(claimed) and claimed == tokens):
        return (f"its manifest claims {claimed!r} tokens, but {steps} steps of {cfg.worker_batch_size} x "
                f"{cfg.tokens_per_example} tokens are {tokens}: the figures were not written by its worker")
    return float(tokens)
