"""Queue-wait statistics per node-count bucket: naive figures, Kaplan-Meier for censored waits,
and confidence intervals by a bootstrap over whole days. Pure functions; the report is a dict.

Kaplan-Meier is scipy's (`scipy.stats.ecdf` on `CensoredData`), not written here. Its quantile q
is the smallest wait by which the estimated fraction q of jobs has started (the inverse of the
estimated CDF, no interpolation), None where the estimate never gets there (the slowest waits are
all censored). Without censoring it is the empirical quantile of that convention, which can
differ from numpy's interpolated median beside it.
"""
from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy.stats import CensoredData, ecdf

from orchestrator.queuewait.waits import DAY_S, JobWait, QueueWaitError, WaitData

DEFAULT_BUCKETS = "1,2-4,5-8,9+"
MIN_JOBS, MIN_USERS = 100, 10
"""A bucket with fewer jobs or users is flagged: a few users' habits, not the cluster's queue."""


@dataclass(frozen=True, slots=True)
class Bucket:
    label: str
    lo: int
    hi: int | None  # None: no upper bound

    def __contains__(self, nodes: int) -> bool:
        return nodes >= self.lo and (self.hi is None or nodes <= self.hi)


def parse_buckets(spec: str = DEFAULT_BUCKETS) -> tuple[Bucket, ...]:
    """"1,2-4,5-8,9+" -> buckets; they must be increasing and must not overlap (gaps are allowed)."""
    buckets: list[Bucket] = []
    for part in (p.strip() for p in spec.split(",")):
        m = re.fullmatch(r"(\d+)(?:-(\d+)|(\+))?", part)
        if not m:
            raise QueueWaitError(f"bucket {part!r} in {spec!r} is not N, N-M or N+; e.g. --buckets {DEFAULT_BUCKETS}")
        lo = int(m.group(1))
        hi = None if m.group(3) else int(m.group(2) or lo)
        if lo < 1 or (hi is not None and hi < lo):
            raise QueueWaitError(f"bucket {part!r} in {spec!r} is empty or below 1 node")
        if buckets and (buckets[-1].hi is None or lo <= buckets[-1].hi):
            raise QueueWaitError(f"bucket {part!r} in {spec!r} overlaps or precedes {buckets[-1].label!r}; "
                                 "list buckets in increasing order without overlap")
        buckets.append(Bucket(part, lo, hi))
    return tuple(buckets)


def bucket_index(nodes: int, buckets: Sequence[Bucket]) -> int | None:
    return next((i for i, b in enumerate(buckets) if nodes in b), None)


def jobs_by_bucket(jobs: Sequence[JobWait], buckets: Sequence[Bucket]) -> list[list[JobWait]]:
    groups: list[list[JobWait]] = [[] for _ in buckets]
    for job in jobs:
        i = bucket_index(job.nodes, buckets)
        if i is not None:
            groups[i].append(job)
    return groups


def waits_by_bucket(jobs: Sequence[JobWait], buckets: Sequence[Bucket]) -> list[np.ndarray]:
    """Wait times (s) of the jobs in each bucket, censored ones included as recorded."""
    return [np.asarray([j.wait_s for j in g], dtype=float) for g in jobs_by_bucket(jobs, buckets)]


def km_quantiles(waits: np.ndarray, censored: np.ndarray, probs: Sequence[float] = (0.5, 0.9)) -> list[float | None]:
    """Kaplan-Meier quantiles of waits where `censored` marks lower bounds (see the module docstring)."""
    if waits.size == 0 or censored.all():
        return [None] * len(probs)
    data = CensoredData(uncensored=waits[~censored], right=waits[censored]) if censored.any() else waits
    sf = ecdf(data).sf
    t, s = sf.quantiles, sf.probabilities
    out: list[float | None] = []
    for p in probs:
        hit = np.flatnonzero(s <= 1 - p + 1e-12)
        out.append(float(t[hit[0]]) if hit.size else None)
    return out


def km_draws(waits: np.ndarray, censored: np.ndarray, size: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Waits drawn from the Kaplan-Meier estimate (inverse CDF). The mass it leaves beyond its last
    event (jobs still waiting when censored) is drawn at the longest recorded wait: a lower bound."""
    if not censored.any():
        return rng.choice(waits, size=size)
    if censored.all():
        return np.full(size, float(waits.max()))
    cdf = ecdf(CensoredData(uncensored=waits[~censored], right=waits[censored])).cdf
    t, p = cdf.quantiles, cdf.probabilities
    i = np.searchsorted(p, rng.random(size))  # the smallest wait whose CDF reaches the draw
    return np.where(i < t.size, t[np.minimum(i, t.size - 1)], float(waits.max()))


def median_ci(jobs: Sequence[JobWait], rng: np.random.Generator, n_boot: int, level: float = 0.95) -> list[float | None]:
    """[lo, hi] of the Kaplan-Meier median by a bootstrap over whole days (waits within a day share
    one queue, so days, not jobs, are the independent units); None for a bound the estimate misses."""
    days = np.asarray([int(j.submit_s // DAY_S) for j in jobs])
    if days.size == 0 or n_boot <= 0:
        return [None, None]
    waits = np.asarray([j.wait_s for j in jobs], dtype=float)
    cens = np.asarray([j.censored for j in jobs], dtype=bool)
    _, inverse = np.unique(days, return_inverse=True)
    order = np.argsort(inverse, kind="stable")
    bounds = np.searchsorted(inverse[order], np.arange(inverse.max() + 2))
    slices = [order[bounds[d]:bounds[d + 1]] for d in range(bounds.size - 1)]
    medians = np.empty(n_boot)
    for b in range(n_boot):
        idx = np.concatenate([slices[d] for d in rng.integers(0, len(slices), len(slices))])
        m = km_quantiles(waits[idx], cens[idx], (0.5,))[0]
        medians[b] = np.inf if m is None else m
    lo, hi = np.quantile(medians, [(1 - level) / 2, (1 + level) / 2], method="inverted_cdf")
    return [float(v) if np.isfinite(v) else None for v in (lo, hi)]


def per_day_medians(jobs: Sequence[JobWait]) -> dict[int, float]:
    """{day number: median wait of that day's jobs}, days by submit time (the lo-fi paper's view)."""
    by_day: dict[int, list[float]] = {}
    for job in jobs:
        by_day.setdefault(int(job.submit_s // DAY_S), []).append(job.wait_s)
    return {day: float(np.median(w)) for day, w in sorted(by_day.items())}


def bucket_stats(data: WaitData, buckets: Sequence[Bucket], n_boot: int = 400, seed: int = 0) -> list[dict[str, object]]:
    """Per bucket: all jobs' naive mean / median / p90 (numpy, interpolated; censored waits as
    recorded), the censored count, Kaplan-Meier median and p90 with the median's day-bootstrap
    interval, distinct users, and the mean over days of each day's median. None where undefined."""
    rng = np.random.default_rng(seed)
    out = []
    for bucket, jobs in zip(buckets, jobs_by_bucket(data.jobs, buckets)):
        waits = np.asarray([j.wait_s for j in jobs], dtype=float)
        cens = np.asarray([j.censored for j in jobs], dtype=bool)
        days = per_day_medians(jobs)
        users = {j.user for j in jobs if j.user}
        km_median, km_p90 = km_quantiles(waits, cens)
        empty = waits.size == 0
        out.append({
            "nodes": bucket.label, "jobs": int(waits.size),
            "mean_wait_s": None if empty else float(np.mean(waits)),
            "median_wait_s": None if empty else float(np.percentile(waits, 50)),
            "p90_wait_s": None if empty else float(np.percentile(waits, 90)),
            "censored": int(cens.sum()), "km_median_wait_s": km_median, "km_p90_wait_s": km_p90,
            "median_ci_s": median_ci(jobs, rng, n_boot), "users": len(users) if users else None,
            "days": len(days),
            "per_day_median_wait_s": float(np.mean(list(days.values()))) if days else None,
        })
    return out


def warnings(stats: Sequence[dict[str, object]]) -> list[str]:
    """A line per bucket too small to speak for a cluster."""
    out = []
    for b in stats:
        jobs, users = int(b["jobs"]), b["users"]
        if jobs and (jobs < MIN_JOBS or (users is not None and int(users) < MIN_USERS)):  # type: ignore[arg-type]
            who = f" from {users} user(s)" if users is not None else ""
            out.append(f"bucket {b['nodes']}: {jobs} jobs{who}: under {MIN_JOBS} jobs or {MIN_USERS} users, "
                       "its figures describe a few users' habits more than the queue")
    return out


def summary(data: WaitData, buckets: Sequence[Bucket], n_boot: int = 400, seed: int = 0,
            selection: str = "all jobs") -> dict[str, object]:
    """The report: what `--json` prints (without a projection)."""
    stats = bucket_stats(data, buckets, n_boot, seed)
    return {"source": data.source, "jobs": len(data.jobs), "skipped": data.n_skipped,
            "skipped_reasons": dict(sorted(data.skipped.items())),
            "selection": selection, "filtered_out": dict(sorted(data.filtered.items())),
            "cores_per_node": data.cores_per_node,
            "outside_buckets": len(data.jobs) - sum(int(s["jobs"]) for s in stats),  # type: ignore[call-overload]
            "bootstrap": {"resamples": n_boot, "unit": "day", "level": 0.95, "seed": seed},
            "buckets": stats, "warnings": warnings(stats)}
