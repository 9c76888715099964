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
from typing import Any

from core.layout import RunLayout
from core.progress import bytes_sent
from core.storage import Storage
from orchestrator.console import console
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
    status["scheduler"] = "answered" if why is None else f"unreachable ({why}): job states as recorded at each commit"
    if why is None and entries:
        states = executor.status(sorted({str(v["job_id"]) for v in entries}))
        for v in entries:
            v.update(states[str(v["job_id"])].as_dict())
    return status


def status_table(status: dict[str, Any]) -> Any:
    from rich import box
    from rich.table import Column, Table

    # no column rules: nine columns fit an 80-column terminal
    extra = list(dict.fromkeys(k for r in status["rounds"] for k in r.get("eval_metrics", {})))  # the task's: accuracy
    table = Table("round", "eval loss", *(Column(k, min_width=len(k)) for k in extra), "merged", "dropped", "rejected", "merge s",
                  "round s", "busy", "MB read",
                  box=box.SIMPLE_HEAD, collapse_padding=True, pad_edge=False, title=f"{status['run_dir']}: {status['state']}, {status['algorithm']}, "
                        f"{status['rounds_done']}/{status['rounds_total']} rounds done, "
                        f"initial eval loss {_num(status['initial_eval_loss'], '{:.4f}')}")
    for r in status["rounds"]:
        loss = "damaged" if r.get("damaged") else "evaluating" if r["eval_loss"] is None else f"{r['eval_loss']:.4f}"
        wall = "" if r["wall_s"] is None else f"{r['wall_s']:.1f}"
        table.add_row(str(r["round"]), loss, *(_num(r.get("eval_metrics", {}).get(k), "{:.4f}") for k in extra),
                      f"{len(r['merged'])}/{status['workers']}", _ids(r["dropped"]),
                      _ids(r["rejected"]), _num(r["merge_seconds"], "{:.2f}"), wall, _busy(r.get("utilization")),
                      _num(None if r["bytes_read"] is None else r["bytes_read"] / 1e6, "{:.1f}"))
    current = status["current_round"]
    if current and status["state"] == "running":
        table.add_section()
        for w, v in sorted(current["workers"].items(), key=lambda kv: int(kv[0])):
            table.add_row(f"{current['round']} (w{w})", "", *([""] * len(extra)), f"job {v['job_id']} {v.get('state', '')}",
                          _times(v), "", worker_state(int(w), current["round"], set(current["arrived"]), v.get("progress")),
                          "", "", "")
    return table


def contribution_line(rounds: list[dict[str, Any]]) -> str | None:
    """Bytes a worker wrote per round (the last round that says), against its weights in fp32."""
    for r in reversed(rounds):
        sizes = list(r.get("contribution_bytes", {}).values())
        if sizes:
            return bytes_sent(sum(sizes) / len(sizes), r.get("fp32_bytes"), f" (round {r['round']})")
    return None


def _num(v: float | None, fmt: str) -> str:
    return "-" if v is None else fmt.format(v)


def _busy(u: float | None) -> str:
    """A round's worker utilization: the share of their held time persistent workers trained."""
    return "-" if u is None else f"{100 * u:.0f}%"


def _ids(workers: list[int]) -> str:
    return ", ".join(map(str, workers)) or "-"


def _times(job: dict[str, Any]) -> str:
    parts = [f"{label} {duration(job[k])}" for label, k in (("queued", "queue_wait_s"), ("ran", "run_s"))
             if job.get(k) is not None]
    return ", ".join(parts)


def cmd_status(args: argparse.Namespace, jobs_folder: str) -> int:
    from orchestrator.lease import unsafe_paths

    storage = Storage(args.run)
    for warning in unsafe_paths(storage):
        print(f"warning: others can steer this run: {warning}", file=sys.stderr)
    if args.json:
        print(json.dumps(status_with_jobs(storage, jobs_folder), indent=1))
        return 0
    if not args.watch:
        status = status_with_jobs(storage, jobs_folder)
        console.print(status_table(status))
        sent = contribution_line(status["rounds"])
        if sent:
            console.print(sent, markup=False)
        if status["failure"]:
            console.print(f"failed in round {status['failure'].get('round')}: {status['failure']['reason']}", markup=False)
        if status["scheduler"] != "answered":
            console.print(f"scheduler {status['scheduler']}", markup=False)
        return 0
    from rich.live import Live
    with Live(status_table(status_with_jobs(storage, jobs_folder)), console=console, auto_refresh=False) as live:
        while True:
            status = status_with_jobs(storage, jobs_folder)
            live.update(status_table(status), refresh=True)
            if status["state"] not in ("running", "finishing"):
                return 0
            time.sleep(args.watch)


def cmd_cancel(args: argparse.Namespace, jobs_folder: str) -> int:
    from orchestrator.executor import Executor
    from core.records import RoundJobs

    storage = Storage(args.run)
    cfg = load_run(storage)
    status = run_status(storage, cfg)
    if status["state"] != "running":
        console.print(f"nothing to cancel: the run is {status['state']}", markup=False)
        return 0
    storage.write_bytes(L.CANCEL, str(time.time()).encode())
    r = status["rounds_done"]
    # the round in progress; the next one, whose workers may already queue (orchestrator.loop); and the
    # last one, whose persistent workers wait to be handed this round
    ids = [j for k in (r - 1, r, r + 1) if 0 <= k < cfg.rounds for j in RoundJobs.load(storage, k).latest().values()]
    ids = list(dict.fromkeys(ids))  # a persistent job serves several rounds: cancel it once
    Executor(cfg, jobs_folder).cancel(ids)
    console.print(f"cancelled the run during round {r}: jobs {ids}; the merge service stops at its next poll", markup=False)
    return 0
