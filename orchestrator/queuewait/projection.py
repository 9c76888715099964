"""What queue waits do to a run's end-to-end time: four ways to run the same training, simulated.

Waits are drawn (seeded, with replacement) from the Kaplan-Meier estimate of jobs *matched* to
the modelled job: the same node count and a requested time limit within a factor of two of the
job time limit, where the source records them (a 1-minute job backfills into gaps a 24-hour job
cannot use). Where fewer than MIN_MATCHED jobs match, the match widens (node count only, then the
node-count bucket) and the report says so. Assumptions: docs/scheduling.md.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from orchestrator.queuewait.stats import Bucket, bucket_index, km_draws
from orchestrator.queuewait.waits import JobWait, QueueWaitError, WaitData, duration

MODELS = {
    "data_parallel": "(a) one {k}-node data-parallel job",
    "per_round": "(b) {k} single-node jobs, resubmitted every round",
    "persistent": "(c) {k} persistent single-node workers",
    "elastic": "(d) {k} persistent workers, training once {m} have started",
}
MIN_MATCHED = 30
_CHUNK_ELEMENTS = 4_000_000  # draws per batch of samples: bounds memory for large T x K
Draw = Callable[[tuple[int, ...]], np.ndarray]


@dataclass(frozen=True, slots=True)
class ProjectionSpec:
    """T rounds of S seconds of compute with K workers; jobs run at most `job_time_limit_s`."""

    rounds: int
    round_seconds: float
    workers: int
    job_time_limit_s: float = 24 * 3600.0
    samples: int = 2000
    seed: int = 0
    min_workers: int | None = None
    """(d): training starts, every job lifetime, once this many workers run (islands' round.min_workers);
    the others join at a later round. Default: half of K, rounded up."""

    @property
    def round_job_limit_s(self) -> float:
        """What a per-round job (b) asks for: its round, in whole minutes, at least one. Its waits are
        drawn from trace jobs that asked for about that, not for the persistent jobs' limit: a
        short job backfills where a long one cannot."""
        return 60.0 * max(1, math.ceil(self.round_seconds / 60))

    def problems(self) -> list[str]:
        out = [f"{name} must be positive, got {value}" for name, value in (
            ("--rounds", self.rounds), ("--round-seconds", self.round_seconds), ("--workers", self.workers),
            ("--job-time-limit", self.job_time_limit_s), ("--samples", self.samples)) if value <= 0]
        if self.min_workers is not None and not 1 <= self.min_workers <= max(self.workers, 1):
            out.append(f"--min-workers must be between 1 and --workers ({self.workers}), got {self.min_workers}")
        if not out and self.lifetime_rounds < 1:
            out.append(f"a round of {self.round_seconds:g} s does not fit in the job time limit of "
                       f"{self.job_time_limit_s:g} s; raise --job-time-limit or lower --round-seconds")
        return out

    @property
    def quorum(self) -> int:
        return self.min_workers or math.ceil(self.workers / 2)

    @property
    def lifetime_rounds(self) -> int:
        """Rounds one job can serve before its time limit: floor(time limit / round time)."""
        return math.floor(self.job_time_limit_s / self.round_seconds + 1e-9)

    @property
    def lifetimes(self) -> int:
        return math.ceil(self.rounds / self.lifetime_rounds)


def queue_time(draw: Draw, waits: int, parallel: int, samples: int, order: int | None = None,
               idle_waits: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Monte-Carlo queue time of `waits` successive waits, each until the `order`-th of `parallel`
    jobs has started (default: the last). Returns per sample (queue seconds, idle node-seconds: what
    the jobs started before that hold a node, waiting, in the first `idle_waits` groups)."""
    order = order or parallel
    queue, idle = np.empty(samples), np.empty(samples)
    chunk = max(1, _CHUNK_ELEMENTS // max(1, waits * parallel))
    for lo in range(0, samples, chunk):
        hi = min(samples, lo + chunk)
        draws = draw((hi - lo, waits, parallel))
        go = np.sort(draws, axis=2)[:, :, order - 1]
        queue[lo:hi] = go.sum(axis=1)
        idle[lo:hi] = np.clip(go[:, :idle_waits, None] - draws[:, :idle_waits], 0, None).sum(axis=(1, 2))
    return queue, idle


def matched(jobs: Sequence[JobWait], buckets: Sequence[Bucket], nodes: int, limit_s: float) -> tuple[list[JobWait], str]:
    """The jobs standing for a `nodes`-node job asking for `limit_s`, and how they were matched."""
    same = [j for j in jobs if j.nodes == nodes]
    near = [j for j in same if j.requested_s is not None and limit_s / 2 <= j.requested_s < limit_s * 2]
    if len(near) >= MIN_MATCHED:
        return near, f"{nodes} node(s), requested time {duration(limit_s / 2)} to {duration(limit_s * 2)}"
    if len(same) >= MIN_MATCHED:
        return same, f"{nodes} node(s), any requested time (only {len(near)} asked for about {duration(limit_s)})"
    i = bucket_index(nodes, buckets)
    pool = [j for j in jobs if i is not None and j.nodes in buckets[i]]
    if not pool:
        raise QueueWaitError(f"the projection needs measured waits of {nodes}-node jobs, but no job of that size "
                             "(or of its bucket) is in the data; pick --buckets / --workers that the data covers")
    return pool, f"bucket {buckets[i].label} (only {len(same)} jobs of exactly {nodes} node(s))"  # type: ignore[index]


def _drawer(pool: list[JobWait], rng: np.random.Generator) -> Draw:
    waits = np.asarray([j.wait_s for j in pool], dtype=float)
    cens = np.asarray([j.censored for j in pool], dtype=bool)
    return lambda size: km_draws(waits, cens, size, rng)


def project(data: WaitData, buckets: Sequence[Bucket], spec: ProjectionSpec) -> dict[str, object]:
    """End-to-end time of (a) one K-node job, (b) per-round jobs, (c) persistent workers and (d)
    persistent workers that start training at a quorum, as distributions.

    Every model computes T*S seconds; they differ in the queue waits they pay: (a) one wait of a
    K-node job per job lifetime, (b) per round the slowest of K single-node waits, (c) per job
    lifetime the slowest of K single-node waits, (d) per lifetime the quorum-th of K.
    """
    if spec.problems():
        raise QueueWaitError("cannot project: " + "; ".join(spec.problems()))
    rng = np.random.default_rng(spec.seed)
    k, n, compute = spec.workers, spec.samples, spec.rounds * spec.round_seconds
    one, one_how = matched(data.jobs, buckets, 1, spec.job_time_limit_s)
    short, short_how = matched(data.jobs, buckets, 1, spec.round_job_limit_s)
    many, many_how = matched(data.jobs, buckets, k, spec.job_time_limit_s)
    draw_one, draw_short, draw_many = _drawer(one, rng), _drawer(short, rng), _drawer(many, rng)
    # a persistent worker that started early idles after its first round of a lifetime until the
    # slowest peer's contribution is merged; not after the run's very last round
    last_rounds = spec.rounds - (spec.lifetimes - 1) * spec.lifetime_rounds
    held = spec.lifetimes - (last_rounds == 1)
    runs = {
        "data_parallel": (queue_time(draw_many, spec.lifetimes, 1, n), spec.lifetimes),
        "per_round": (queue_time(draw_short, spec.rounds, k, n), spec.rounds * k),
        "persistent": (queue_time(draw_one, spec.lifetimes, k, n, idle_waits=held), spec.lifetimes * k),
        "elastic": (queue_time(draw_one, spec.lifetimes, k, n, order=spec.quorum, idle_waits=spec.lifetimes),
                    spec.lifetimes * k),
    }
    models = []
    for key, ((queue, idle), submissions) in runs.items():
        total = queue + compute
        p10, median, p90 = (float(v) for v in np.percentile(total, [10, 50, 90]))
        models.append({
            "model": key, "label": MODELS[key].format(k=k, m=spec.quorum), "job_submissions": submissions,
            "median_s": median, "p10_s": p10, "p90_s": p90, "mean_s": float(np.mean(total)),
            "queue_median_s": float(np.percentile(queue, 50)),
            "idle_node_hours_median": float(np.percentile(idle, 50)) / 3600,
        })
    best = min(models, key=lambda m: m["median_s"])
    return {"rounds": spec.rounds, "round_seconds": spec.round_seconds, "workers": k, "min_workers": spec.quorum,
            "job_time_limit_s": spec.job_time_limit_s, "lifetime_rounds": spec.lifetime_rounds,
            "compute_s": compute, "samples": n, "seed": spec.seed, "models": models, "fastest": best["model"],
            "pools": {"single_node": {"jobs": len(one), "censored": sum(j.censored for j in one), "matched": one_how},
                      "per_round": {"jobs": len(short), "censored": sum(j.censored for j in short),
                                    "matched": f"(b)'s {duration(spec.round_job_limit_s)} jobs: {short_how}"},
                      "k_node": {"jobs": len(many), "censored": sum(j.censored for j in many), "matched": many_how}}}
