"""`orchestrate status` and `orchestrate cancel`: a run as it is now, read from storage and the scheduler.

Light on purpose: neither imports torch (tests/test_cli.py checks). Job states are asked of the
scheduler when it answers (sacct/squeue; for local jobs, submitit's files and /proc), for every
round, so a finished run shows how its jobs ended, not how they looked when their round was
merged; when it does not answer, the states recorded at each round's commit are shown and
`scheduler` says why. The JSON schema is in docs/observability.md.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from typing import Any

from core.layout import RunLayout
from core.progress import bytes_moved, bytes_sent
from core.storage import Storage
from orchestrator.console import console, narrow_table
from orchestrator.run_view import duration, worker_state
from orchestrator.runstate import load_run, run_status

L = RunLayout()


def status_with_jobs(storage: Storage, jobs_folder: str) -> dict[str, Any]:
    """run_status plus every job's state and times as the scheduler tells them now (one call)."""
    from orchestrator.executor import Executor
    from orchestrator.slurm import unreachable

    cfg = load_run(storage)
    status = run_status(storage, cfg)
    entries = [v for r in status["rounds"] for v in (r["jobs"] or {}).values() if isinstance(v, dict) and "job_id" in v]
    current = status["current_round"]
    if current:
        entries += list(current["workers"].values())
    executor = Executor(cfg, jobs_folder)
    why = unreachable() if executor.kind == "slurm" else None
    status["scheduler"] = ("reachable: job states as it reports them now" if why is None else
                           f"unreachable ({why}): job states as recorded at each commit")
    if why is None and entries:
        states = executor.status(sorted({str(v["job_id"]) for v in entries}))
        for v in entries:
            v.update(states[str(v["job_id"])].as_dict())
    return status


def status_table(status: dict[str, Any]) -> Any:
    from rich.table import Column

    # no column rules: nine columns fit an 80-column terminal
    extra = list(dict.fromkeys(k for r in status["rounds"] for k in r.get("eval_metrics", {})))  # the task's: accuracy
    table = narrow_table("round", "eval loss", *(Column(k, min_width=len(k)) for k in extra), "merged", "dropped",
                         "rejected", "merge s", "round s", "busy", "MB read",
                         title=f"{status['run_dir']}: {status['state']}, {status['algorithm']}, "
                               f"{status['rounds_done']}/{status['rounds_total']} rounds done, "
                               f"initial eval {status.get('loss', 'loss')} {_num(status['initial_eval_loss'], '{:.4f}')}")
    for r in status["rounds"]:
        unscored = "evaluating" if status["state"] in ("running", "finishing") else "pending"  # resume evaluates it
        loss = "damaged" if r.get("damaged") else unscored if r["eval_loss"] is None else f"{r['eval_loss']:.4f}"
        wall = _num(r["round_s"] if r.get("round_s") is not None else r["wall_s"], "{:.1f}")  # older records: submit to commit
        table.add_row(str(r["round"]), loss, *(_num(r.get("eval_metrics", {}).get(k), "{:.4f}") for k in extra),
                      f"{len(r['merged'])}/{status['workers']}", _ids(r["dropped"]),
                      _ids(r["rejected"]), _num(r["merge_seconds"], "{:.2f}"), wall, _busy(r.get("utilization")),
                      _num(None if r["bytes_read"] is None else r["bytes_read"] / 1e6, "{:.1f}"))
    return table


def current_table(status: dict[str, Any]) -> Any | None:
    """The round in progress, a row per worker: its job, how the scheduler sees it, and its step."""
    current = status["current_round"]
    if not current or status["state"] not in ("running", "stopped"):  # stopped: Slurm jobs may still run
        return None
    r = current["round"]
    table = narrow_table("worker", "job", "state", "queued", "ran", "progress",
                         title=f"round {r} ({r + 1}/{status['rounds_total']}) in progress")
    for w, v in sorted(current["workers"].items(), key=lambda kv: int(kv[0])):
        table.add_row(w, str(v["job_id"]), v.get("state") or "-", _time(v.get("queue_wait_s")), _time(v.get("run_s")),
                      worker_state(int(w), r, set(current["arrived"]), v.get("progress")))
    return table


def jobs_line(rounds: list[dict[str, Any]], most: int = 4) -> str | None:
    """How the merged rounds' jobs ended, in the scheduler's words: a count per state (a persistent
    job that served several rounds once), and the jobs that ended otherwise than COMPLETED by name
    (their first round, worker, job id), `most` of them."""
    from orchestrator.jobstatus import ACTIVE

    seen: dict[str, str] = {}
    odd = []
    for r in rounds:
        for w, v in sorted((r.get("jobs") or {}).items(), key=lambda kv: int(kv[0])):
            job, state = str(v.get("job_id")), str(v.get("state") or "UNKNOWN")
            if job in seen:
                continue
            seen[job] = state
            if state != "COMPLETED" and state.split()[0] not in ACTIVE:
                odd.append(f"worker {w} job {job} {state} (submitted in round {r['round']})")
    if not seen:
        return None
    line = "jobs: " + ", ".join(f"{n} {state}" for state, n in Counter(seen.values()).most_common())
    if odd:
        line += "; " + "; ".join(odd[:most]) + (f"; and {len(odd) - most} more (--json)" if len(odd) > most else "")
    return line


def contribution_line(rounds: list[dict[str, Any]]) -> str | None:
    """Bytes a worker wrote per round (the last round that says), against its weights in fp32."""
    for r in reversed(rounds):
        sizes = list(r.get("contribution_bytes", {}).values())
        if sizes:
            return bytes_sent(sum(sizes) / len(sizes), r.get("fp32_bytes"), f" (round {r['round']})")
    return None


def io_line(rounds: list[dict[str, Any]]) -> str | None:
    """Bytes a worker read and wrote per round and how many replayed their base (the last round that says)."""
    for r in reversed(rounds):
        read, written = list(r.get("worker_read", {}).values()), list(r.get("worker_written", {}).values())
        if read and written:
            return bytes_moved(sum(read) / len(read), sum(written) / len(written), r.get("fp32_bytes"),
                               len(r.get("replayed", [])), len(r.get("merged", [])), f" (round {r['round']})")
    return None


def state_line(rounds: list[dict[str, Any]], most: int = 4) -> str | None:
    """Where workers' AdamW state came from when that is news (a restart, fresh state, a refused
    snapshot): the last `most` such starts."""
    said = [f"round {r['round']} worker {w}: {how}" for r in rounds for w, how in sorted((r.get("worker_state") or {}).items())]
    if not said:
        return None
    return "optimizer state: " + "; ".join(said[-most:]) + (f" (and {len(said) - most} earlier: --json)" if len(said) > most else "")


def _num(v: float | None, fmt: str) -> str:
    return "-" if v is None else fmt.format(v)


def _busy(u: float | None) -> str:
    """A round's worker utilization: the share of their held time persistent workers trained."""
    return "-" if u is None else f"{100 * u:.0f}%"


def _ids(workers: list[int]) -> str:
    return ", ".join(map(str, workers)) or "-"


def _time(seconds: float | None) -> str:
    return "-" if seconds is None else duration(seconds)


def stored_line(status: dict[str, Any]) -> str | None:
    """How much the run directory holds (round.keep_last keeps it flat in rounds)."""
    n = status.get("stored_bytes")
    return None if n is None else f"run directory: {n / 1e6:.1f} MB stored (job logs aside)"


def status_view(status: dict[str, Any]) -> Any:
    """What `status` prints: the rounds' table, the round in progress, then a line each for the bytes
    sent, how the jobs ended, a failure and a scheduler that did not answer."""
    from rich.console import Group
    from rich.text import Text

    lines = [contribution_line(status["rounds"]), io_line(status["rounds"]), stored_line(status), jobs_line(status["rounds"]),
             state_line(status["rounds"])]
    if status["failure"]:
        lines.append(f"failed in round {status['failure'].get('round')}: {status['failure']['reason']}")
    if status["state"] == "stopped":
        lines.append(f"no merge service drives the run (it was interrupted or killed): `orchestrate resume "
                     f"{status['run_dir']}` continues it")
    if not status["scheduler"].startswith("reachable"):
        lines.append(f"scheduler {status['scheduler']}")
    current = current_table(status)
    return Group(status_table(status), *([current] if current is not None else []), *(Text(x) for x in lines if x))


def cmd_status(args: argparse.Namespace, jobs_folder: str) -> int:
    from orchestrator.lease import unsafe_paths

    storage = Storage(args.run)
    for warning in unsafe_paths(storage):
        print(f"warning: others can steer this run: {warning}", file=sys.stderr)
    if args.json:
        print(json.dumps(status_with_jobs(storage, jobs_folder), indent=1))
        return 0
    if not args.watch:
        console.print(status_view(status_with_jobs(storage, jobs_folder)), soft_wrap=False)  # wrapped at words
        return 0
    from rich.live import Live
    wrap, console.soft_wrap = console.soft_wrap, False  # Live has no switch of its own: lines wrapped at words
    try:
        with Live(status_view(status_with_jobs(storage, jobs_folder)), console=console, auto_refresh=False) as live:
            while True:
                status = status_with_jobs(storage, jobs_folder)
                live.update(status_view(status), refresh=True)
                if status["state"] not in ("starting", "running", "finishing"):
                    return 0
                time.sleep(args.watch)
    finally:
        console.soft_wrap = wrap


def cmd_cancel(args: argparse.Namespace, jobs_folder: str) -> int:
    from orchestrator.executor import STOP_WAIT_S, Executor
    from core.records import RoundJobs

    storage = Storage(args.run)
    cfg = load_run(storage)
    status = run_status(storage, cfg)
    if status["state"] not in ("starting", "running", "stopped"):  # stopped: its Slurm jobs may still run
        console.print(f"nothing to cancel: the run is {status['state']}", markup=False)
        return 0
    storage.write_bytes(L.CANCEL, str(time.time()).encode())
    r = status["rounds_done"]
    # the round in progress; the next one, whose workers may already queue (orchestrator.loop); and the
    # last one, whose persistent workers wait to be handed this round
    ids = [j for k in (r - 1, r, r + 1) if 0 <= k < cfg.rounds for j in RoundJobs.load(storage, k).latest().values()]
    ids = list(dict.fromkeys(ids))  # a persistent job serves several rounds: cancel it once
    executor = Executor(cfg, jobs_folder)
    if any(s.alive for s in executor.status(ids).values()):
        console.print(f"cancelling the run during round {r}: its workers save their state first (at most "
                      f"{STOP_WAIT_S:.0f}s; Ctrl-C stops them at once)", markup=False)
    executor.end_gracefully(ids, STOP_WAIT_S)
    console.print(f"cancelled the run during round {r}: jobs {ids}; the merge service stops at its next poll", markup=False)
    return 0
