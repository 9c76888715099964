"""`orchestrate bench queue-wait`: arguments, and the report as a table, plain lines or JSON.

The only place of the queue-wait tool that prints; analysis in orchestrator/queuewait/waits.py, I/O in
orchestrator/queuewait/io.py, the figure in orchestrator/queuewait/plot.py.
"""
from __future__ import annotations

import argparse
import json
import re
from collections.abc import Callable
from typing import Any

from orchestrator.console import console, narrow_table  # the one console
from orchestrator.queuewait.waits import slurm_duration  # torch-free, stdlib only

_LIVE_SACCT = "<live sacct>"
_UNITS = {"s": 1, "m": 60, "min": 60, "h": 3600, "d": 86400}


def duration_s(text: str) -> float:
    """"24h", "90m", "3600", "3600s", "2d" or Slurm's "[D-]HH:MM:SS" as seconds."""
    t = text.strip().lower()
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*(s|m|min|h|d)?", t)
    if m:
        return float(m.group(1)) * _UNITS[m.group(2) or "s"]
    if (":" in t or "-" in t) and (seconds := slurm_duration(t)) is not None:
        return seconds
    raise argparse.ArgumentTypeError(f"{text!r} is not a duration; use e.g. 24h, 90m, 3600 or 1-00:00:00")


def duration_range(text: str) -> tuple[float, float | None]:
    """"4h..24h", "4h.." (no upper bound) or "..1h" as [lo, hi) seconds."""
    lo, sep, hi = text.partition("..")
    if not sep:
        raise argparse.ArgumentTypeError(f"{text!r} is not a range; use LO..HI, LO.. or ..HI, e.g. 4h..24h")
    bounds = (duration_s(lo) if lo.strip() else 0.0, duration_s(hi) if hi.strip() else None)
    if bounds[1] is not None and bounds[1] <= bounds[0]:
        raise argparse.ArgumentTypeError(f"{text!r}: the upper bound must be above the lower")
    return bounds


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of node counts, e.g. 1,2,4") from None


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register `queue-wait` under `orchestrate bench`; the handler is in defaults as bench_handler."""
    p = subparsers.add_parser("queue-wait", help="measure queue wait by job size; project end-to-end time",
                              description="Queue wait by node count from an SWF trace, sacct, or live probes "
                                          "(docs/scheduling.md).")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--swf", metavar="FILE", help="Standard Workload Format trace (.swf or .swf.gz)")
    src.add_argument("--sacct", nargs="?", const=_LIVE_SACCT, metavar="FILE",
                     help="`sacct -P` output; without FILE, run sacct on this cluster")
    src.add_argument("--live", action="store_true",
                     help="ask the scheduler when a whole-node job of each --probe-nodes size and --job-time-limit "
                          "would start (sbatch --test-only: nothing is submitted); with --submit, submit short "
                          "probe jobs and time their start")
    p.add_argument("--cores-per-node", type=float,
                   help="processors per node (SWF default: header MaxProcs/MaxNodes when unambiguous; "
                        "sacct: needed for --whole-nodes)")
    p.add_argument("--since", help="live sacct: start of the window (sacct -S), default now-7days")
    p.add_argument("--partition", help="only this partition (SWF field 16, sacct Partition); --live: submit probes there")
    p.add_argument("--user", help="sacct: only this user's jobs (default: all users)")
    p.add_argument("--whole-nodes", action="store_true",
                   help="only jobs whose processors are whole nodes, as an islands worker's (default: all jobs, "
                        "comparable with the lo-fi paper)")
    p.add_argument("--requested-time", type=duration_range, metavar="LO..HI",
                   help="only jobs whose requested time limit is in [LO, HI), e.g. 4h..24h, 12h.., ..1h")
    p.add_argument("--gpus", action="store_true", help="sacct: only jobs that asked for GPUs (ReqTRES gres/gpu)")
    p.add_argument("--bootstrap", type=int, default=400,
                   help="resamples of days for the KM median's 95%% interval (default 400; 0: none)")
    p.add_argument("--submit", action="store_true",
                   help="--live: submit `sleep 1` probe jobs of 1 minute instead of asking for an estimate (they "
                        "backfill into gaps a long job cannot use: their waits understate a real worker's)")
    p.add_argument("--probe-gpus", type=int, default=0, help="--live: GPUs per node of the estimated job (default 0)")
    p.add_argument("--probe-nodes", type=_int_list, default=[1, 2, 4],
                   help="--live: job sizes to estimate or probe (default 1,2,4)")
    p.add_argument("--probes-per-size", type=int, default=2, help="--live --submit: probes of each size (default 2)")
    p.add_argument("--max-seconds", type=duration_s, default=300.0,
                   help="--live --submit: stop waiting after this (default 300)")
    p.add_argument("--buckets", help="node-count buckets, e.g. 1,2-4,5-8,9+ (the default; "
                                      "with --live one bucket per probe size)")
    _projection_args(p)
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--plot", metavar="FILE.png", help="write a figure of the distributions (and projection)")
    p.set_defaults(bench_handler=run)
    return p


def _projection_args(p: argparse.ArgumentParser) -> None:
    """The end-to-end projection's arguments (--project)."""
    p.add_argument("--project", action="store_true", help="project end-to-end time of T rounds (needs the next 3)")
    p.add_argument("--rounds", type=int, help="T: rounds")
    p.add_argument("--round-seconds", type=duration_s, help="S: compute time of one round")
    p.add_argument("--workers", type=int, help="K: workers (= nodes of the data-parallel job)")
    p.add_argument("--job-time-limit", type=duration_s, default=24 * 3600.0,
                   help="a job's time limit; persistent workers requeue after floor(limit / S) rounds (default 24h)")
    p.add_argument("--min-workers", type=int,
                   help="projection (d): workers that must run before training starts (default: half of K)")
    p.add_argument("--samples", type=int, default=2000, help="Monte-Carlo samples (default 2000)")
    p.add_argument("--seed", type=int, default=0, help="random seed of the simulation (default 0)")


def _load(args: argparse.Namespace) -> Any:
    from orchestrator.queuewait import io as qio

    if args.swf:
        return qio.read_swf(args.swf, args.cores_per_node)
    if args.sacct == _LIVE_SACCT:
        return qio.read_sacct_live(args.since, args.partition, args.user)
    if args.sacct:
        return qio.read_sacct_file(args.sacct, args.partition, args.user)
    return qio.run_probes(args.probe_nodes, args.probes_per_size, args.partition, args.max_seconds)


def _projection_spec(args: argparse.Namespace) -> Any:
    from orchestrator.queuewait import projection as qp
    from orchestrator.queuewait.waits import QueueWaitError

    missing = [f for f, v in (("--rounds", args.rounds), ("--round-seconds", args.round_seconds),
                              ("--workers", args.workers)) if v is None]
    if missing:
        raise QueueWaitError(f"--project needs {', '.join(missing)}, e.g. --rounds 128 --round-seconds 600 --workers 8")
    spec = qp.ProjectionSpec(args.rounds, args.round_seconds, args.workers, args.job_time_limit, args.samples,
                             args.seed, args.min_workers)
    if spec.problems():
        raise QueueWaitError("cannot project: " + "; ".join(spec.problems()))
    return spec


def build_report(args: argparse.Namespace) -> tuple[Any, Any, dict[str, Any]]:
    """(data, buckets, report) for parsed arguments; raises QueueWaitError on bad input."""
    from dataclasses import replace

    from orchestrator.queuewait import projection as qp
    from orchestrator.queuewait import stats as qs
    from orchestrator.queuewait import waits as qw

    live_default = ",".join(str(n) for n in sorted(set(args.probe_nodes))) if args.live else None
    buckets = qs.parse_buckets(args.buckets or live_default or qs.DEFAULT_BUCKETS)
    spec = _projection_spec(args) if args.project else None
    if args.gpus and not args.sacct:
        raise qw.QueueWaitError("--gpus reads sacct's ReqTRES: only --sacct records which jobs asked for GPUs")
    if args.live and not args.submit:
        if spec is not None:
            raise qw.QueueWaitError("the projection needs a wait distribution; --live gives one estimate per size: "
                                    "use --swf, --sacct or --live --submit")
        from orchestrator.queuewait import io as qio
        return None, buckets, {"source": "sbatch --test-only", "estimates": qio.estimate_starts(
            args.probe_nodes, args.job_time_limit, args.partition, args.probe_gpus)}
    data = _load(args)
    if args.cores_per_node and not data.cores_per_node:
        data = replace(data, cores_per_node=args.cores_per_node)
    flt = qw.JobFilter(args.whole_nodes, args.requested_time, args.partition if args.swf else None, args.gpus)
    data = qw.select(data, flt)
    if not data.jobs:
        raise qw.QueueWaitError(f"{data.source}: no job with a known wait (skipped: {data.skipped or 'none'}; "
                                f"filtered out: {data.filtered or 'none'}); check the file, the --since window "
                                "or the filters")
    report = qs.summary(data, buckets, args.bootstrap, args.seed, flt.describe())
    if args.live:
        report["warnings"].append("the probes are 1-minute `sleep 1` jobs: they backfill into gaps a long job cannot "
                                  "use, so their waits understate a real worker's; --live without --submit asks the "
                                  "scheduler about the real shape")
    if spec is not None:
        report["projection"] = qp.project(data, buckets, spec)
    return data, buckets, report


def run(args: argparse.Namespace) -> int:
    try:
        data, buckets, report = build_report(args)
    except KeyboardInterrupt:
        console.print("interrupted; any probe jobs submitted were cancelled")
        return 130
    if "estimates" in report:
        _print_estimates(report, args.json)
        return 0
    if args.plot:
        from orchestrator.queuewait.plot import write_plot

        report["plot"] = str(write_plot(args.plot, data, buckets, report))
    if args.json:
        print(json.dumps(report, indent=1))
    elif console.is_terminal:
        _print_tables(report)
    else:
        _print_lines(report)
    return 0


def fmt_s(seconds: float | None) -> str:
    """Human duration: 42s, 12.5min, 3.2h, 2.1d."""
    if seconds is None:
        return "-"
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= 2 * size:
            return f"{seconds / size:.1f}{unit}"
    return f"{seconds:.0f}s"


def _headline(report: dict[str, Any]) -> str:
    reasons = ", ".join(f"{n} {why}" for why, n in report["skipped_reasons"].items())
    cpn = f"; cores per node: {report['cores_per_node']:g}" if report["cores_per_node"] else ""
    out = ", ".join(f"{n} {why}" for why, n in report["filtered_out"].items())
    sel = f"; {report['selection']}" + (f" ({out} left out)" if out else "")
    return (f"{report['source']}: {report['jobs']} jobs, {report['skipped']} skipped"
            f"{f' ({reasons})' if reasons else ''}{cpn}{sel}")


def _km(b: dict[str, Any]) -> str:
    """'5.6h [4.1h, 7.0h]': the Kaplan-Meier median and its interval ('not reached' where the data does not)."""
    lo, hi = b["median_ci_s"]
    ci = f" [{fmt_s(lo)}, {fmt_s(hi) if hi is not None else 'not reached'}]" if lo is not None else ""
    return _km_median(b, fmt_s) + ci


def _km_median(b: dict[str, Any], fmt: Callable[[float], str]) -> str:
    return fmt(b["km_median_wait_s"]) if b["km_median_wait_s"] is not None else "not reached"


def _p90(b: dict[str, Any], fmt: Callable[[float], str] = fmt_s) -> str:
    return fmt(b["km_p90_wait_s"]) if b["km_p90_wait_s"] is not None else ("not reached" if b["jobs"] else "-")


def _print_tables(report: dict[str, Any]) -> None:
    """A terminal's tables: jobs per size, then their waits, then the projection, each in one unit
    named in its title (a column of 60s, 98.0min and 3.1h reads wrong at a glance), narrow enough
    for 80 columns, no number ever cut."""
    console.print(_headline(report), soft_wrap=False)
    buckets = report["buckets"]
    table = narrow_table("nodes", "jobs", "users", "censored", "days", title="jobs by size (nodes)", fold=True)
    for b in buckets:
        table.add_row(b["nodes"], str(b["jobs"]), str(b["users"] if b["users"] is not None else "-"), str(b["censored"]),
                      str(b["days"]))
    console.print(table)
    keys = ("mean_wait_s", "median_wait_s", "p90_wait_s", "km_median_wait_s", "km_p90_wait_s", "per_day_median_wait_s")
    unit, size = _unit([b[k] for b in buckets for k in keys] + [x for b in buckets for x in b["median_ci_s"]])
    table = narrow_table("nodes", "mean", "median", "p90", "KM median", "95% CI", "KM p90", "per-day median",
                         title=f"queue wait ({unit})", fold=True)
    def at(seconds: float | None) -> str:
        return _in(seconds, size)
    for b in buckets:
        lo, hi = b["median_ci_s"]
        ci = "-" if lo is None else f"{at(lo)}-{at(hi) if hi is not None else 'not reached'}"
        table.add_row(b["nodes"], *(at(b[k]) for k in keys[:3]), _km_median(b, at), ci, _p90(b, at),
                      at(b["per_day_median_wait_s"]))
    console.print(table)
    for w in report["warnings"]:
        console.print(f"warning: {w}", soft_wrap=False)
    if proj := report.get("projection"):
        _print_projection(proj)
    if report.get("plot"):
        console.print(f"plot: {report['plot']}", soft_wrap=False)


def _print_projection(proj: dict[str, Any]) -> None:
    console.print(_projection_title(proj), soft_wrap=False)
    ms = proj["models"]
    unit, size = _unit([m[k] for m in ms for k in ("median_s", "p10_s", "p90_s", "queue_median_s")])
    table = narrow_table("model", "jobs", "median", "p10-p90", "queue", "idle node-h",
                         title=f"end to end and queue ({unit})", fold=True)
    for m in ms:
        table.add_row(m["label"], str(m["job_submissions"]), _in(m["median_s"], size),
                      f"{_in(m['p10_s'], size)}-{_in(m['p90_s'], size)}", _in(m["queue_median_s"], size),
                      f"{m['idle_node_hours_median']:.1f}")
    console.print(table)
    console.print(_pools(proj), soft_wrap=False)


def _unit(seconds: list[float | None]) -> tuple[str, float]:
    """The unit of a table of durations: the largest whose size its median value reaches."""
    values = sorted(x for x in seconds if x is not None)
    mid = values[len(values) // 2] if values else 0.0
    return next(((unit, size) for unit, size in (("days", 86400.0), ("hours", 3600.0), ("minutes", 60.0))
                 if mid >= size), ("seconds", 1.0))


def _in(seconds: float | None, size: float) -> str:
    """A duration in a table's unit, to a hundredth of it at most (a few characters wide)."""
    if seconds is None:
        return "-"
    x = seconds / size
    return f"{x:.0f}" if x >= 100 else f"{x:.1f}" if x >= 10 else f"{x:.2f}"


def _projection_title(proj: dict[str, Any]) -> str:
    return (f"projection: {proj['rounds']} rounds x {proj['round_seconds']:g}s on {proj['workers']} workers "
            f"(compute {fmt_s(proj['compute_s'])}); job time limit {fmt_s(proj['job_time_limit_s'])} = "
            f"{proj['lifetime_rounds']} rounds per job; {proj['samples']} samples, seed {proj['seed']}")


def _pools(proj: dict[str, Any]) -> str:
    return "waits drawn (Kaplan-Meier) from: " + "; ".join(
        f"{p['matched']}: {p['jobs']} jobs, {p['censored']} censored" for p in proj["pools"].values())


def _print_lines(report: dict[str, Any]) -> None:
    print(_headline(report))
    for b in report["buckets"]:
        print(f"nodes {b['nodes']}: {b['jobs']} jobs ({b['users'] if b['users'] is not None else '?'} users, "
              f"{b['censored']} censored), mean {fmt_s(b['mean_wait_s'])}, median {fmt_s(b['median_wait_s'])}, "
              f"p90 {fmt_s(b['p90_wait_s'])}, KM median {_km(b)}, KM p90 {_p90(b)}, per-day median "
              f"{fmt_s(b['per_day_median_wait_s'])} over {b['days']} days")
    for w in report["warnings"]:
        print(f"warning: {w}")
    proj = report.get("projection")
    if proj:
        print(_projection_title(proj))
        for m in proj["models"]:
            print(f"{m['label']}: median {fmt_s(m['median_s'])} (p10-p90 {fmt_s(m['p10_s'])}-{fmt_s(m['p90_s'])}), "
                  f"median queue {fmt_s(m['queue_median_s'])}, {m['job_submissions']} job submissions, "
                  f"idle {m['idle_node_hours_median']:.1f} node-h")
        print(_pools(proj))
    if report.get("plot"):
        print(f"plot: {report['plot']}")


def _print_estimates(report: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print(json.dumps(report, indent=1))
        return
    print("the scheduler's start estimates now (sbatch --test-only, nothing submitted; its plan changes as "
          "jobs end early or arrive):")
    for e in report["estimates"]:
        gpus = f", {e['gpus_per_node']} GPU(s) per node" if e["gpus_per_node"] else ""
        print(f"{e['nodes']} whole node(s) for {fmt_s(e['time_limit_s'])}{gpus}: start {e['start']} "
              f"(wait {fmt_s(e['wait_s'])}) on {e['on_nodes']} in partition {e['partition']}")
