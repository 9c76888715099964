"""`orchestrate bench queue-wait`: arguments, and the report as a table, plain lines or JSON.

The only place of the queue-wait tool that prints; analysis in orchestrator/queuewait/waits.py, I/O in
orchestrator/queuewait/io.py, the figure in orchestrator/queuewait/plot.py.
"""
from __future__ import annotations

import argparse
import json
import re
from typing import Any

from rich.console import Console
from rich.table import Table

console = Console(highlight=False, soft_wrap=True)
_LIVE_SACCT = "<live sacct>"
_UNITS = {"s": 1, "m": 60, "min": 60, "h": 3600, "d": 86400}


def duration_s(text: str) -> float:
    """"24h", "90m", "3600", "3600s", "2d" or Slurm's "[D-]HH:MM:SS" as seconds."""
    t = text.strip().lower()
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*(s|m|min|h|d)?", t)
    if m:
        return float(m.group(1)) * _UNITS[m.group(2) or "s"]
    m = re.fullmatch(r"(?:(\d+)-)?(\d+):(\d\d)(?::(\d\d))?", t)
    if m:
        days, a, b, c = (int(g) if g else 0 for g in m.groups())
        return days * 86400 + (a * 3600 + b * 60 + c if m.group(4) else a * 60 + b)
    raise argparse.ArgumentTypeError(f"{text!r} is not a duration; use e.g. 24h, 90m, 3600 or 1-00:00:00")


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
    src.add_argument("--live", action="store_true", help="submit short probe jobs and time their start")
    p.add_argument("--cores-per-node", type=float, help="SWF: processors per node (default: header MaxProcs/MaxNodes)")
    p.add_argument("--since", help="live sacct: start of the window (sacct -S), default now-7days")
    p.add_argument("--partition", help="sacct: only this partition; --live: submit probes there")
    p.add_argument("--user", help="sacct: only this user's jobs (default: all users)")
    p.add_argument("--probe-nodes", type=_int_list, default=[1, 2, 4], help="--live: probe sizes (default 1,2,4)")
    p.add_argument("--probes-per-size", type=int, default=2, help="--live: probes of each size (default 2)")
    p.add_argument("--max-seconds", type=duration_s, default=300.0, help="--live: stop waiting after this (default 300)")
    p.add_argument("--buckets", help="node-count buckets, e.g. 1,2-4,5-8,9+ (the default; "
                                      "with --live one bucket per probe size)")
    p.add_argument("--project", action="store_true", help="project end-to-end time of T rounds (needs the next 3)")
    p.add_argument("--rounds", type=int, help="T: rounds")
    p.add_argument("--round-seconds", type=duration_s, help="S: compute time of one round")
    p.add_argument("--workers", type=int, help="K: workers (= nodes of the data-parallel job)")
    p.add_argument("--job-time-limit", type=duration_s, default=24 * 3600.0,
                   help="a job's time limit; persistent workers requeue after floor(limit / S) rounds (default 24h)")
    p.add_argument("--samples", type=int, default=2000, help="Monte-Carlo samples (default 2000)")
    p.add_argument("--seed", type=int, default=0, help="random seed of the simulation (default 0)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--plot", metavar="FILE.png", help="write a figure of the distributions (and projection)")
    p.set_defaults(bench_handler=run)
    return p


def _load(args: argparse.Namespace) -> Any:
    from orchestrator.queuewait import io as qio

    if args.swf:
        return qio.read_swf(args.swf, args.cores_per_node)
    if args.sacct == _LIVE_SACCT:
        return qio.read_sacct_live(args.since, args.partition, args.user)
    if args.sacct:
        return qio.read_sacct_file(args.sacct, args.partition, args.user)
    return qio.run_probes(args.probe_nodes, args.probes_per_size, args.partition, args.max_seconds)


def build_report(args: argparse.Namespace) -> tuple[Any, Any, dict[str, Any]]:
    """(data, buckets, report) for parsed arguments; raises QueueWaitError on bad input."""
    from orchestrator.queuewait import waits as qw

    live_default = ",".join(str(n) for n in sorted(set(args.probe_nodes))) if args.live else None
    buckets = qw.parse_buckets(args.buckets or live_default or qw.DEFAULT_BUCKETS)
    spec = None
    if args.project:
        missing = [f for f, v in (("--rounds", args.rounds), ("--round-seconds", args.round_seconds),
                                  ("--workers", args.workers)) if v is None]
        if missing:
            raise qw.QueueWaitError(f"--project needs {', '.join(missing)}, e.g. --rounds 128 --round-seconds 600 --workers 8")
        spec = qw.ProjectionSpec(args.rounds, args.round_seconds, args.workers, args.job_time_limit, args.samples, args.seed)
        if spec.problems():
            raise qw.QueueWaitError("cannot project: " + "; ".join(spec.problems()))
    data = _load(args)
    if not data.jobs:
        raise qw.QueueWaitError(f"{data.source}: no job with a known wait (skipped: {data.skipped or 'none'}); "
                                "check the file, the --since window or the filters")
    report = qw.summary(data, buckets)
    if spec is not None:
        report["projection"] = qw.project(data, buckets, spec)
    return data, buckets, report


def run(args: argparse.Namespace) -> int:
    try:
        data, buckets, report = build_report(args)
    except KeyboardInterrupt:
        console.print("interrupted; any probe jobs submitted were cancelled")
        return 130
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
    return f"{report['source']}: {report['jobs']} jobs, {report['skipped']} skipped{f' ({reasons})' if reasons else ''}{cpn}"


def _print_tables(report: dict[str, Any]) -> None:
    console.print(_headline(report))
    table = Table("nodes", "jobs", "mean wait", "median wait", "p90 wait", "per-day median (days)")
    for b in report["buckets"]:
        table.add_row(b["nodes"], str(b["jobs"]), fmt_s(b["mean_wait_s"]), fmt_s(b["median_wait_s"]),
                      fmt_s(b["p90_wait_s"]), f"{fmt_s(b['per_day_median_wait_s'])} ({b['days']})")
    console.print(table)
    proj = report.get("projection")
    if proj:
        console.print(_projection_title(proj))
        table = Table("model", "job submissions", "median end-to-end", "p90 end-to-end", "median queue", "idle node-h")
        for m in proj["models"]:
            table.add_row(m["label"], str(m["job_submissions"]), fmt_s(m["median_s"]), fmt_s(m["p90_s"]),
                          fmt_s(m["queue_median_s"]), f"{m['idle_node_hours_median']:.1f}")
        console.print(table)
    if report.get("plot"):
        console.print(f"plot: {report['plot']}")


def _projection_title(proj: dict[str, Any]) -> str:
    return (f"projection: {proj['rounds']} rounds x {proj['round_seconds']:g}s on {proj['workers']} workers "
            f"(compute {fmt_s(proj['compute_s'])}); job time limit {fmt_s(proj['job_time_limit_s'])} = "
            f"{proj['lifetime_rounds']} rounds per job; {proj['samples']} samples, seed {proj['seed']}")


def _print_lines(report: dict[str, Any]) -> None:
    print(_headline(report))
    for b in report["buckets"]:
        print(f"nodes {b['nodes']}: {b['jobs']} jobs, mean {fmt_s(b['mean_wait_s'])}, median "
              f"{fmt_s(b['median_wait_s'])}, p90 {fmt_s(b['p90_wait_s'])}, per-day median "
              f"{fmt_s(b['per_day_median_wait_s'])} over {b['days']} days")
    proj = report.get("projection")
    if proj:
        print(_projection_title(proj))
        for m in proj["models"]:
            print(f"{m['label']}: median {fmt_s(m['median_s'])}, p90 {fmt_s(m['p90_s'])}, median queue "
                  f"{fmt_s(m['queue_median_s'])}, {m['job_submissions']} job submissions, "
                  f"idle {m['idle_node_hours_median']:.1f} node-h")
    if report.get("plot"):
        print(f"plot: {report['plot']}")
