"""Queue-wait analysis as pure functions: parse traces, bucket by node count, summarise, project.

Three sources feed the same records (`JobWait`): a Standard Workload Format trace (Parallel
Workloads Archive), `sacct -P` output of a real cluster, and live probe jobs (queuewait_io). Nothing
here reads a file, runs a command or prints; see docs/scheduling.md for the model and its limits.
"""
from __future__ import annotations

import logging
import math
import re
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone

import numpy as np

from core.errors import IslandsError

log = logging.getLogger(__name__)

DEFAULT_BUCKETS = "1,2-4,5-8,9+"
SACCT_FIELDS = ("JobID", "Submit", "Start", "NNodes", "State", "Partition", "User")
_NOT_STARTED = {"", "unknown", "none"}
DAY_S = 86400


class QueueWaitError(IslandsError):
    """A trace, sacct output, bucket spec or projection request cannot be used as given."""


@dataclass(frozen=True, slots=True)
class JobWait:
    """One job that started: when it was submitted (seconds, wall clock read as UTC), its wait, its nodes."""

    submit_s: float
    wait_s: float
    nodes: int


@dataclass(frozen=True, slots=True)
class WaitData:
    """Parsed jobs plus what was skipped and why (reason -> count)."""

    source: str
    jobs: tuple[JobWait, ...]
    skipped: dict[str, int] = field(default_factory=dict)
    cores_per_node: float | None = None

    @property
    def n_skipped(self) -> int:
        return sum(self.skipped.values())


# ---------------------------------------------------------------- SWF


def swf_header(lines: Iterable[str]) -> dict[str, str]:
    """`; Key: value` header lines of an SWF trace as {key: value} (first occurrence wins)."""
    header: dict[str, str] = {}
    for line in lines:
        m = re.match(r"^\s*;\s*(\w+)\s*:\s*(.*?)\s*$", line)
        if m and m.group(1) not in header:
            header[m.group(1)] = m.group(2)
    return header


def header_cores_per_node(header: dict[str, str], where: str) -> float:
    """MaxProcs / MaxNodes from an SWF header; a clear error when either is missing."""
    try:
        procs, nodes = int(header["MaxProcs"]), int(header["MaxNodes"])
    except (KeyError, ValueError) as exc:
        raise QueueWaitError(f"{where}: cannot derive cores per node: the header lacks a numeric MaxProcs "
                             f"and MaxNodes ({exc}); pass --cores-per-node") from None
    if procs <= 0 or nodes <= 0:
        raise QueueWaitError(f"{where}: header MaxProcs={procs}, MaxNodes={nodes} must be positive; "
                             "pass --cores-per-node")
    if procs % nodes:
        log.warning("%s: MaxProcs %d is not a multiple of MaxNodes %d; using %.3f cores per node",
                    where, procs, nodes, procs / nodes)
    return procs / nodes


def parse_swf(lines: Iterable[str], cores_per_node: float | None = None, source: str = "swf") -> WaitData:
    """Jobs of an SWF trace: wait = field 3, processors = field 5 (allocated) or else 8 (requested).

    Node count = ceil(processors / cores per node); cores per node from the argument or the header.
    Jobs with wait -1 or no processor count are skipped and counted, as are malformed lines.
    """
    lines = list(lines)
    header = swf_header(line for line in lines if line.lstrip().startswith(";"))
    cpn = cores_per_node if cores_per_node else header_cores_per_node(header, source)
    if cpn <= 0:
        raise QueueWaitError(f"{source}: cores per node must be positive, got {cpn}")
    # SWF submit times count from UnixStartTime; TimeZone shifts them to the site's wall clock
    origin = float(header.get("UnixStartTime", 0) or 0) + float(header.get("TimeZone", 0) or 0)
    jobs: list[JobWait] = []
    skipped: Counter[str] = Counter()
    for line in lines:
        text = line.strip()
        if not text or text.startswith(";"):
            continue
        job, reason = _swf_job(text.split(), cpn, origin)
        if job is None:
            skipped[reason] += 1
        else:
            jobs.append(job)
    return WaitData(source, tuple(jobs), dict(skipped), cpn)


def _swf_job(fields: list[str], cpn: float, origin: float) -> tuple[JobWait | None, str]:
    if len(fields) < 8:
        return None, "malformed line"
    try:
        submit, wait, alloc, requested = float(fields[1]), float(fields[2]), float(fields[4]), float(fields[7])
    except ValueError:
        return None, "malformed line"
    if wait < 0:
        return None, "unknown wait (-1)"
    procs = alloc if alloc > 0 else requested
    if procs <= 0:
        return None, "no processor count"
    return JobWait(origin + submit, wait, max(1, math.ceil(procs / cpn - 1e-9))), ""


# ---------------------------------------------------------------- sacct


def parse_sacct(text: str, source: str = "sacct", fields: Sequence[str] = SACCT_FIELDS,
                partition: str | None = None, user: str | None = None) -> WaitData:
    """Jobs of `sacct -P -o JobID,Submit,Start,NNodes,...` output (a header line, if present, wins).

    Steps (`12.batch`, `12.0`) are ignored; jobs that never started (PENDING, cancelled while
    queued: Start Unknown/None) are skipped and counted. Times are read as wall clock.
    """
    rows = [line.rstrip("\n").split("|") for line in text.splitlines() if line.strip()]
    if rows and rows[0] and rows[0][0].strip() == "JobID":
        fields, rows = [f.strip() for f in rows[0]], rows[1:]
        if fields[-1] == "":  # `sacct -p` ends every line with a "|"
            fields, rows = fields[:-1], [r[:-1] if r and r[-1] == "" else r for r in rows]
    missing = [f for f in ("JobID", "Submit", "Start", "NNodes") if f not in fields]
    if missing:
        raise QueueWaitError(f"{source}: sacct fields {list(fields)} lack {missing}; run sacct -P -o "
                             f"{','.join(SACCT_FIELDS)}")
    col = {name: i for i, name in enumerate(fields)}
    jobs: list[JobWait] = []
    skipped: Counter[str] = Counter()
    for parts in rows:
        if len(parts) != len(fields):
            skipped["malformed line"] += 1
            continue
        row = {name: parts[i].strip() for name, i in col.items()}
        if "." in row["JobID"]:
            continue  # a step of a job already counted
        if (partition and row.get("Partition", partition) != partition) or (user and row.get("User", user) != user):
            continue
        job, reason = _sacct_job(row)
        if job is None:
            skipped[reason] += 1
        else:
            jobs.append(job)
    return WaitData(source, tuple(jobs), dict(skipped))


def _sacct_job(row: dict[str, str]) -> tuple[JobWait | None, str]:
    if row["Start"].lower() in _NOT_STARTED or row.get("State", "").startswith("PENDING"):
        return None, "never started"
    try:
        submit, start = _sacct_time(row["Submit"]), _sacct_time(row["Start"])
        nodes = int(row["NNodes"])
    except ValueError:
        return None, "malformed line"
    if nodes <= 0:
        return None, "no node count"
    return JobWait(submit, max(0.0, start - submit), nodes), ""


def _sacct_time(text: str) -> float:
    """sacct's `2026-11-22T05:04:17` (no zone) as seconds, reading the wall clock as UTC."""
    return datetime.fromisoformat(text).replace(tzinfo=timezone.utc).timestamp()


# ---------------------------------------------------------------- buckets and statistics


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


def waits_by_bucket(jobs: Iterable[JobWait], buckets: Sequence[Bucket]) -> list[np.ndarray]:
    """Wait times (s) of the jobs in each bucket; jobs outside every bucket are left out."""
    groups: list[list[float]] = [[] for _ in buckets]
    for job in jobs:
        i = bucket_index(job.nodes, buckets)
        if i is not None:
            groups[i].append(job.wait_s)
    return [np.asarray(g, dtype=float) for g in groups]


def per_day_medians(jobs: Iterable[JobWait], bucket: Bucket) -> dict[int, float]:
    """{day number: median wait of that day's jobs in the bucket}, days by submit time."""
    by_day: dict[int, list[float]] = {}
    for job in jobs:
        if job.nodes in bucket:
            by_day.setdefault(int(job.submit_s // DAY_S), []).append(job.wait_s)
    return {day: float(np.median(w)) for day, w in sorted(by_day.items())}


def bucket_stats(data: WaitData, buckets: Sequence[Bucket]) -> list[dict[str, object]]:
    """Per bucket: jobs, mean / median / p90 wait (numpy linear interpolation), and the paper's
    view: the mean over days of each day's median wait. None where a bucket has no job."""
    out = []
    for bucket, waits in zip(buckets, waits_by_bucket(data.jobs, buckets)):
        days = per_day_medians(data.jobs, bucket)
        empty = waits.size == 0
        out.append({
            "nodes": bucket.label, "jobs": int(waits.size),
            "mean_wait_s": None if empty else float(np.mean(waits)),
            "median_wait_s": None if empty else float(np.percentile(waits, 50)),
            "p90_wait_s": None if empty else float(np.percentile(waits, 90)),
            "days": len(days),
            "per_day_median_wait_s": float(np.mean(list(days.values()))) if days else None,
        })
    return out


def summary(data: WaitData, buckets: Sequence[Bucket]) -> dict[str, object]:
    """The report: what `--json` prints (without a projection)."""
    stats = bucket_stats(data, buckets)
    return {"source": data.source, "jobs": len(data.jobs), "skipped": data.n_skipped,
            "skipped_reasons": dict(sorted(data.skipped.items())),
            "cores_per_node": data.cores_per_node,
            "outside_buckets": len(data.jobs) - sum(int(s["jobs"]) for s in stats),
            "buckets": stats}


# ---------------------------------------------------------------- projection

MODELS = {
    "data_parallel": "(a) one {k}-node data-parallel job",
    "per_round": "(b) {k} single-node jobs, resubmitted every round",
    "persistent": "(c) {k} persistent single-node workers",
}
_CHUNK_ELEMENTS = 4_000_000  # draws per batch of samples: bounds memory for large T x K


@dataclass(frozen=True, slots=True)
class ProjectionSpec:
    """T rounds of S seconds of compute with K workers; jobs run at most `job_time_limit_s`."""

    rounds: int
    round_seconds: float
    workers: int
    job_time_limit_s: float = 24 * 3600.0
    samples: int = 2000
    seed: int = 0

    def problems(self) -> list[str]:
        out = [f"{name} must be positive, got {value}" for name, value in (
            ("--rounds", self.rounds), ("--round-seconds", self.round_seconds), ("--workers", self.workers),
            ("--job-time-limit", self.job_time_limit_s), ("--samples", self.samples)) if value <= 0]
        if not out and self.lifetime_rounds < 1:
            out.append(f"a round of {self.round_seconds:g} s does not fit in the job time limit of "
                       f"{self.job_time_limit_s:g} s; raise --job-time-limit or lower --round-seconds")
        return out

    @property
    def lifetime_rounds(self) -> int:
        """Rounds one job can serve before its time limit: floor(time limit / round time)."""
        return math.floor(self.job_time_limit_s / self.round_seconds + 1e-9)

    @property
    def lifetimes(self) -> int:
        return math.ceil(self.rounds / self.lifetime_rounds)


def queue_time(pool: np.ndarray, waits: int, parallel: int, samples: int, rng: np.random.Generator,
               idle_waits: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Monte-Carlo queue time of `waits` successive waits, each the slowest of `parallel` jobs
    drawn from `pool` (with replacement). Returns per sample (queue seconds, idle node-seconds:
    time the early jobs of the first `idle_waits` groups hold a node until the slowest starts)."""
    queue, idle = np.empty(samples), np.empty(samples)
    chunk = max(1, _CHUNK_ELEMENTS // max(1, waits * parallel))
    for lo in range(0, samples, chunk):
        hi = min(samples, lo + chunk)
        draws = rng.choice(pool, size=(hi - lo, waits, parallel))
        slowest = draws.max(axis=2)
        queue[lo:hi] = slowest.sum(axis=1)
        idle[lo:hi] = (slowest[:, :idle_waits, None] - draws[:, :idle_waits]).sum(axis=(1, 2))
    return queue, idle


def _pool(waits: Sequence[np.ndarray], buckets: Sequence[Bucket], nodes: int, source: str) -> np.ndarray:
    i = bucket_index(nodes, buckets)
    if i is None or waits[i].size == 0:
        where = "no bucket holds" if i is None else f"bucket {buckets[i].label!r} has no job of"
        raise QueueWaitError(f"the projection needs measured waits of {nodes}-node jobs, but {where} them "
                             f"in {source}; pick --buckets / --workers that the data covers")
    return waits[i]


def project(data: WaitData, buckets: Sequence[Bucket], spec: ProjectionSpec) -> dict[str, object]:
    """End-to-end time of (a) data-parallel, (b) per-round and (c) persistent workers, by simulation.

    Every model computes T*S seconds; they differ in the queue waits they pay: (a) one wait of a
    K-node job per job lifetime, (b) per round the slowest of K single-node waits, (c) per job
    lifetime the slowest of K single-node waits. Merge time and communication are ignored.
    """
    if spec.problems():
        raise QueueWaitError("cannot project: " + "; ".join(spec.problems()))
    waits = waits_by_bucket(data.jobs, buckets)
    one, many = _pool(waits, buckets, 1, data.source), _pool(waits, buckets, spec.workers, data.source)
    rng = np.random.default_rng(spec.seed)
    k, n, compute = spec.workers, spec.samples, spec.rounds * spec.round_seconds
    # a persistent worker that started early idles after its first round of a lifetime until the
    # slowest peer's contribution is merged; not after the run's very last round
    last_rounds = spec.rounds - (spec.lifetimes - 1) * spec.lifetime_rounds
    held = spec.lifetimes - (last_rounds == 1)
    runs = {
        "data_parallel": (queue_time(many, spec.lifetimes, 1, n, rng), spec.lifetimes),
        "per_round": (queue_time(one, spec.rounds, k, n, rng), spec.rounds * k),
        "persistent": (queue_time(one, spec.lifetimes, k, n, rng, idle_waits=held), spec.lifetimes * k),
    }
    models = []
    for key, ((queue, idle), submissions) in runs.items():
        total = queue + compute
        models.append({
            "model": key, "label": MODELS[key].format(k=k), "job_submissions": submissions,
            "median_s": float(np.percentile(total, 50)), "p90_s": float(np.percentile(total, 90)),
            "mean_s": float(np.mean(total)), "queue_median_s": float(np.percentile(queue, 50)),
            "idle_node_hours_median": float(np.percentile(idle, 50)) / 3600,
        })
    return {"rounds": spec.rounds, "round_seconds": spec.round_seconds, "workers": k,
            "job_time_limit_s": spec.job_time_limit_s, "lifetime_rounds": spec.lifetime_rounds,
            "compute_s": compute, "samples": n, "seed": spec.seed, "models": models}
