"""`orchestrate`: the command line. rich lives here and only here; off a terminal it prints plain lines."""
from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from core.config import load_config, replace
from core.errors import IslandsError
from core.layout import RunLayout
from core.storage import Storage

L = RunLayout()
console = Console(highlight=False, soft_wrap=True)


def _setup_logging(verbose: bool) -> None:
    level = logging.DEBUG if verbose else logging.INFO
    if sys.stderr.isatty():
        from rich.logging import RichHandler
        handler: logging.Handler = RichHandler(console=Console(stderr=True), show_path=False)
    else:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=level, handlers=[handler], force=True)
    logging.getLogger("submitit").setLevel(logging.WARNING)


def _config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", "-c", help="YAML config file (keys: docs/config.md)")
    p.add_argument("--workers", type=int, help="K: independent worker jobs per round")
    p.add_argument("--rounds", type=int, help="T: rounds (outer steps)")
    p.add_argument("--inner-steps", type=int, help="H: inner steps per round")
    p.add_argument("--algorithm", choices=["diloco", "lofi", "fedavg"])
    p.add_argument("--executor", choices=["auto", "local", "slurm"])
    p.add_argument("--run-dir", help="run directory (any fsspec URL); default ./runs/<algorithm>-<time>")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                   help="override any config key, e.g. --set inner.lr=1e-3 (repeatable)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="orchestrate", description="Train on islands of compute: DiLoCo, lo-fi, FedAvg.")
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("submit", help="start a run and drive it to the end")
    _config_args(p)
    p = sub.add_parser("resume", help="continue a run from its run directory")
    p.add_argument("run")
    p.add_argument("--force", action="store_true", help="take the run lock even if another orchestrator seems alive")
    p = sub.add_parser("status", help="show a run's progress")
    p.add_argument("run")
    p.add_argument("--json", action="store_true")
    p = sub.add_parser("cancel", help="cancel a run's jobs and stop its orchestrator")
    p.add_argument("run")
    return parser


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    pairs = {"workers": args.workers, "rounds": args.rounds, "inner.steps": args.inner_steps,
             "algorithm": args.algorithm, "executor.kind": args.executor, "run_dir": args.run_dir}
    return {k: v for k, v in pairs.items() if v is not None}


def cmd_submit(args: argparse.Namespace) -> int:
    from orchestrator.runstate import create_run, default_run_dir

    cfg = load_config(args.config, _overrides(args), args.sets)
    if cfg.run_dir is None:
        cfg = replace(cfg, run_dir=default_run_dir(cfg))
    storage = Storage(cfg.run_dir)
    create_run(storage, cfg)
    console.print(f"run directory: {storage.display()}")
    return _drive(storage, force=False)


def cmd_resume(args: argparse.Namespace) -> int:
    storage = Storage(args.run)
    console.print(f"resuming {storage.display()}")
    return _drive(storage, force=args.force)


def _drive(storage: Storage, force: bool) -> int:
    from orchestrator.executor import Executor
    from orchestrator.runstate import acquire_lock, initial_eval, load_run, release_lock, run_status
    from orchestrator.service import Cancelled, RoundService

    cfg = load_run(storage)
    folder = storage.local_path(L.JOBS) or str(Path.home() / ".cache" / "islands" / "jobs" / Path(storage.root).name)
    executor = Executor(cfg, folder)
    acquire_lock(storage, force=force)
    try:
        service = RoundService(storage, cfg, executor, on_round=lambda rec: _print_round(rec, cfg.rounds))
        console.print(f"{cfg.algorithm}: {cfg.workers} workers x {cfg.rounds} rounds x {cfg.inner.steps} inner steps, "
                      f"{executor.kind} executor; initial eval loss {initial_eval(storage, service.evaluator):.4f}")
        t0 = time.time()
        service.run()
    except Cancelled as exc:
        console.print(str(exc))
        return 3
    finally:
        release_lock(storage)
    status = run_status(storage)
    console.print(f"done in {time.time() - t0:.0f}s: {status['rounds_done']} rounds, final eval loss "
                  f"{status['rounds'][-1]['eval_loss']:.4f}; final model: {status['final_model']}")
    console.print(f"inspect it with: orchestrate status {storage.display()}")
    return 0


def _print_round(rec: dict[str, Any], total: int) -> None:
    extra = ""
    if rec["dropped"]:
        extra += f", dropped {rec['dropped']}"
    if rec["rejected"]:
        extra += f", rejected {rec['rejected']}"
    console.print(f"round {rec['round'] + 1}/{total}: eval loss {rec['eval_loss']:.4f} "
                  f"(merged {rec['merged']}{extra}; merge {rec['merge_seconds']:.2f}s)")


def cmd_status(args: argparse.Namespace) -> int:
    from orchestrator.runstate import run_status

    status = run_status(Storage(args.run))
    if args.json:
        print(json.dumps(status, indent=1))
        return 0
    console.print(f"{status['run_dir']}: {status['state']}, {status['algorithm']}, "
                  f"{status['rounds_done']}/{status['rounds_total']} rounds; initial eval loss {status['initial_eval_loss']}")
    table = Table("round", "eval loss", "merged", "dropped", "rejected", "merge s", "MB read")
    for r in status["rounds"]:
        table.add_row(str(r["round"] + 1), f"{r['eval_loss']:.4f}", str(r["merged"]), str(r["dropped"]),
                      str(r["rejected"]), f"{r['merge_seconds']:.2f}", f"{r['bytes_read'] / 1e6:.1f}")
    console.print(table)
    if status["current_round"]:
        console.print(f"round {status['current_round']['round'] + 1} in progress: {status['current_round']}")
    if status["failure"]:
        console.print(f"failed: {status['failure']['reason']}")
    return 0


def cmd_cancel(args: argparse.Namespace) -> int:
    from orchestrator.executor import Executor
    from orchestrator.runstate import jobs_of_round, load_run, run_status

    storage = Storage(args.run)
    cfg = load_run(storage)
    storage.write_bytes(L.CANCEL, str(time.time()).encode())
    r = run_status(storage)["rounds_done"]
    jobs = jobs_of_round(storage, r)
    ids = [e["job_ids"][-1] for e in jobs["workers"].values()]
    folder = storage.local_path(L.JOBS) or str(Path.home() / ".cache" / "islands" / "jobs" / Path(storage.root).name)
    Executor(cfg, folder).cancel(ids)
    console.print(f"cancelled round {r + 1}'s jobs {ids}; the orchestrator stops at its next poll")
    return 0


COMMANDS = {"submit": cmd_submit, "resume": cmd_resume, "status": cmd_status, "cancel": cmd_cancel}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _setup_logging(args.verbose)
    try:
        return COMMANDS[args.command](args)
    except IslandsError as exc:
        console.print(f"error: {exc}", markup=False)
        return 2
    except KeyboardInterrupt:
        console.print("interrupted; the run directory is intact: `orchestrate resume RUN` continues it")
        return 130


if __name__ == "__main__":
    sys.exit(main())
