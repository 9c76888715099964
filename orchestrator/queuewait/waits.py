"""Queue-wait records from traces, as pure functions: parse, then select the jobs that matter.

Three sources feed the same records (`JobWait`): a Standard Workload Format trace (Parallel
Workloads Archive), `sacct -P` output of a real cluster, and live probe jobs (io.py). A job that
never started (cancelled while queued) is kept, *censored*: its wait is only known to be at least
the time it spent queued (stats.py estimates the distribution with Kaplan-Meier). Nothing here
reads a file, runs a command or prints; see docs/scheduling.md for the model and its limits.
"""
from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone

from core.errors import IslandsError

SACCT_FIELDS = ("JobID", "Submit", "Eligible", "Start", "End", "NNodes", "NCPUS", "Timelimit", "State",
                "Partition", "User", "ReqTRES")
SACCT_NEEDED = ("JobID", "Submit", "Start", "NNodes")
_NOT_STARTED = {"", "unknown", "none"}
DAY_S = 86400
SWF_CANCELLED = 5


class QueueWaitError(IslandsError):
    """A trace, sacct output, bucket spec, filter or projection request cannot be used as given."""


@dataclass(frozen=True, slots=True)
class JobWait:
    """One job: when it started waiting (seconds, wall clock read as UTC), its wait, its nodes, and
    what a filter or a match needs (0, None or "" where the source does not say)."""

    submit_s: float
    wait_s: float  # submit (sacct: eligible) to start; censored: to cancellation
    nodes: int
    censored: bool = False  # never started: the wait is a lower bound
    procs: int = 0  # processors (SWF) or CPUs (sacct NCPUS)
    requested_s: float | None = None  # the requested time limit
    user: str = ""
    partition: str = ""
    gpus: int = 0


@dataclass(frozen=True, slots=True)
class WaitData:
    """Parsed jobs plus what was left out and why (reason -> count)."""

    source: str
    jobs: tuple[JobWait, ...]
    skipped: dict[str, int] = field(default_factory=dict)
    cores_per_node: float | None = None
    filtered: dict[str, int] = field(default_factory=dict)  # left out by a filter (what -> count)

    @property
    def n_skipped(self) -> int:
        return sum(self.skipped.values())


def slurm_duration(text: str) -> float | None:
    """Slurm's `[D-]HH:MM:SS`, `MM:SS` or minutes as seconds; None for UNLIMITED, Partition_Limit, unknown."""
    t = text.strip()
    m = re.fullmatch(r"(?:(\d+)-)?(\d+)(?::(\d\d))?(?::(\d\d))?", t)
    if not m:
        return None
    days, a, b, c = (int(g) if g else 0 for g in m.groups())
    if m.group(4) is not None or (m.group(1) and m.group(3) is not None):
        return days * 86400 + a * 3600 + b * 60 + c  # [D-]HH:MM:SS or D-HH:MM
    if m.group(1):
        return days * 86400 + a * 3600  # D-HH
    return days * 86400 + (a * 60 + b if m.group(3) is not None else a * 60)  # MM:SS or minutes


def duration(seconds: float) -> str:
    """12h, 90min, 30s: a requested time as people write it."""
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size and seconds % size == 0 or seconds >= 10 * size:
            return f"{seconds / size:g}{unit}"
    return f"{seconds:g}s"


# ---------------------------------------------------------------- SWF


def swf_header(lines: Iterable[str]) -> dict[str, str]:
    """`; Key: value` header lines of an SWF trace as {key: value} (first occurrence wins)."""
    header: dict[str, str] = {}
    for line in lines:
        m = re.match(r"^\s*;\s*(\w+)\s*:\s*(.*?)\s*$", line)
        if m and m.group(1) not in header:
            header[m.group(1)] = m.group(2)
    return header


def header_cores_per_node(header: dict[str, str], where: str) -> int:
    """MaxProcs / MaxNodes from an SWF header, when it is unambiguous; otherwise an error asking for
    --cores-per-node (a guess would silently move thousands of jobs between buckets)."""
    try:
        procs, nodes = int(header["MaxProcs"]), int(header["MaxNodes"])
    except (KeyError, ValueError) as exc:
        raise QueueWaitError(f"{where}: cannot derive cores per node: the header lacks a numeric MaxProcs "
                             f"and MaxNodes ({exc}); pass --cores-per-node (see the machine's description)") from None
    if procs <= 0 or nodes <= 0:
        raise QueueWaitError(f"{where}: header MaxProcs={procs}, MaxNodes={nodes} must be positive; "
                             "pass --cores-per-node")
    if procs == nodes:
        raise QueueWaitError(f"{where}: header MaxProcs = MaxNodes = {procs}: either the nodes have one core each "
                             "or the header counts nodes as processors; pass --cores-per-node (e.g. 1 for KTH's SP2)")
    if procs % nodes:
        raise QueueWaitError(f"{where}: header MaxProcs {procs} is not a multiple of MaxNodes {nodes} (nodes of "
                             "different sizes?); pass --cores-per-node")
    return procs // nodes


def parse_swf(lines: Iterable[str], cores_per_node: float | None = None, source: str = "swf") -> WaitData:
    """Jobs of an SWF trace: wait = field 3, processors = field 5 (allocated) or else 8 (requested),
    requested time = field 9, user = 12, partition = 16. A job cancelled before it started
    (status 5, run time <= 0) is censored at its wait.

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
        submit, wait, run, alloc, requested = (float(fields[i]) for i in (1, 2, 3, 4, 7))
        req_time, status = (float(fields[i]) if len(fields) > i else -1.0 for i in (8, 10))
    except ValueError:
        return None, "malformed line"
    if wait < 0:
        return None, "unknown wait (-1)"
    procs = alloc if alloc > 0 else requested
    if procs <= 0:
        return None, "no processor count"
    extra = {i: fields[i] if len(fields) > i and fields[i] != "-1" else "" for i in (11, 15)}
    return JobWait(origin + submit, wait, max(1, math.ceil(procs / cpn - 1e-9)),
                   censored=status == SWF_CANCELLED and run <= 0, procs=int(procs),
                   requested_s=req_time if req_time > 0 else None, user=extra[11], partition=extra[15]), ""


# ---------------------------------------------------------------- sacct


def parse_sacct(text: str, source: str = "sacct", fields: Sequence[str] = SACCT_FIELDS,
                partition: str | None = None, user: str | None = None, now: float | None = None) -> WaitData:
    """Jobs of `sacct -P -X -o JobID,Submit,Eligible,Start,End,NNodes,...` output (a header line, if
    present, wins; of the fields only JobID, Submit, Start and NNodes are required).

    The wait runs from Eligible (when the job could start: not held, dependencies met), else from
    Submit. A job cancelled before it started is censored at End; one still pending is censored at
    `now` (when sacct ran: the caller knows it, a saved file does not say, and then such jobs are
    skipped and counted), jobs never eligible are skipped and counted. Steps
    (`12.batch`, `12.0`) are ignored. Times are read as wall clock.
    """
    rows = [line.rstrip("\n").split("|") for line in text.splitlines() if line.strip()]
    if rows and rows[0] and rows[0][0].strip() == "JobID":
        fields, rows = [f.strip() for f in rows[0]], rows[1:]
        if fields[-1] == "":  # `sacct -p` ends every line with a "|"
            fields, rows = fields[:-1], [r[:-1] if r and r[-1] == "" else r for r in rows]
    missing = [f for f in SACCT_NEEDED if f not in fields]
    if missing:
        raise QueueWaitError(f"{source}: sacct fields {list(fields)} lack {missing}; run sacct -P -X -o "
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
        job, reason = _sacct_job(row, now)
        if job is None:
            skipped[reason] += 1
        else:
            jobs.append(job)
    return WaitData(source, tuple(jobs), dict(skipped))


def _sacct_job(row: dict[str, str], now: float | None = None) -> tuple[JobWait | None, str]:
    state = row.get("State", "")
    pending = state.startswith("PENDING")
    started = row["Start"].lower() not in _NOT_STARTED and not pending
    if not started and not state.startswith("CANCELLED") and not (pending and now is not None):
        return None, "still pending" if pending else "never started"
    try:
        submit = _sacct_time(row["Submit"])
        eligible = row.get("Eligible")  # absent from older saved output: then the wait runs from Submit
        if eligible is not None and eligible.lower() not in _NOT_STARTED:
            submit = max(submit, _sacct_time(eligible))
        elif eligible is not None and not started:
            return None, "never eligible"
        end = _sacct_time(row["Start"]) if started else now if pending else _sacct_time(row.get("End", ""))
        assert end is not None
        nodes = int(row["NNodes"])
        procs = int(row.get("NCPUS") or 0)
    except ValueError:
        return None, "never started, no end time" if not started else "malformed line"
    if nodes <= 0:
        return None, "no node count"
    limit = slurm_duration(row.get("Timelimit", ""))
    gpus = sum(int(n) for n in re.findall(r"gres/gpu(?::[^=,]+)?=(\d+)", row.get("ReqTRES", "")))
    return JobWait(submit, max(0.0, end - submit), nodes, censored=not started, procs=procs, requested_s=limit,
                   user=row.get("User", ""), partition=row.get("Partition", ""), gpus=gpus), ""


def _sacct_time(text: str) -> float:
    """sacct's `2026-11-22T05:04:17` (no zone) as seconds, reading the wall clock as UTC."""
    return datetime.fromisoformat(text).replace(tzinfo=timezone.utc).timestamp()


# ---------------------------------------------------------------- selection


@dataclass(frozen=True)
class JobFilter:
    """Which jobs a report counts; the default is every job (comparable with the lo-fi paper)."""

    whole_nodes: bool = False
    """Only jobs whose processors are a whole number of nodes (an islands worker takes a node)."""
    requested: tuple[float, float | None] | None = None
    """Only jobs whose requested time limit is in [lo, hi) seconds (hi None: no upper bound)."""
    partition: str | None = None
    gpus: bool = False
    """Only jobs that asked for GPUs (sacct's ReqTRES gres/gpu)."""

    def describe(self) -> str:
        parts = ["whole nodes"] if self.whole_nodes else []
        if self.requested:
            lo, hi = self.requested
            parts.append(f"requested time >= {duration(lo)}" if hi is None else f"requested time < {duration(hi)}"
                         if lo == 0 else f"requested time {duration(lo)} to {duration(hi)}")
        parts += [f"partition {self.partition}"] * bool(self.partition) + ["GPU jobs"] * self.gpus
        return ", ".join(parts) or "all jobs"


def select(data: WaitData, flt: JobFilter) -> WaitData:
    """The jobs of `data` that `flt` keeps; each one left out is counted under the first test it fails."""
    if flt.whole_nodes and not data.cores_per_node:
        raise QueueWaitError(f"{data.source}: --whole-nodes needs the cores per node; pass --cores-per-node")
    kept: list[JobWait] = []
    out: Counter[str] = Counter()
    for job in data.jobs:
        why = _rejects(job, flt, data.cores_per_node)
        if why:
            out[why] += 1
        else:
            kept.append(job)
    return replace(data, jobs=tuple(kept), filtered={**data.filtered, **out})


def _rejects(job: JobWait, flt: JobFilter, cpn: float | None) -> str:
    if flt.whole_nodes:
        if job.procs <= 0:
            return "whole nodes: processor count unknown"
        if cpn and abs(job.procs / cpn - round(job.procs / cpn)) > 1e-9:
            return "not whole nodes"
    if flt.requested is not None:
        lo, hi = flt.requested
        if job.requested_s is None:
            return "requested time unknown"
        if job.requested_s < lo or (hi is not None and job.requested_s >= hi):
            return "requested time outside the range"
    if flt.partition and job.partition != flt.partition:
        return "other partition"
    if flt.gpus and job.gpus <= 0:
        return "no GPUs"
    return ""
