"""`orchestrate`: the command line (output through orchestrator.console; off a terminal, plain lines)."""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import typing
from pathlib import Path
from typing import Any

from core.config import Algorithm, Config, load_config, replace
from core.errors import ConfigError, IslandsError
from orchestrator.console import HelpFormatter, console, say, setup_logging

WATCH_S = 2.0
SUBMIT_EXAMPLES = """examples:
  orchestrate submit --workers 4 --rounds 8
  orchestrate submit --algorithm lofi --workers 4 --rounds 1
  orchestrate submit --executor slurm --run-dir /shared/$USER/runs/r1 \\
      --set executor.partition=gpu --set executor.gpus_per_node=1
  orchestrate submit --set model=hf:/models/llama \\
      --set data.source=/shared/$USER/data/sft   # made with its tokenizer
  orchestrate submit --set task=digits --algorithm lte --workers 4 --rounds 8
every --set KEY=VALUE: docs/config.md"""
RUN_HELP = "the run directory (a path or any fsspec URL), as `submit` printed it"


def _config_args(p: argparse.ArgumentParser) -> None:
    d = Config()  # the defaults a flag left out falls back to (through the config file, if any)
    p.add_argument("--config", "-c", help="YAML config file (keys: docs/config.md)")
    p.add_argument("--workers", type=int, help=f"K: independent worker jobs per round (default {d.workers})")
    p.add_argument("--rounds", type=int, help=f"T: rounds (outer steps) (default {d.rounds})")
    p.add_argument("--inner-steps", type=int, help=f"H: inner steps per round (default {d.inner.steps})")
    p.add_argument("--algorithm", choices=list(typing.get_args(Algorithm)),
                   help=f"diloco: outer Nesterov on the workers' mean; fedavg: their plain average each round; lofi: "
                        f"one round, averaged once; lte: LoRA heads merged into the base each round (default {d.algorithm})")
    p.add_argument("--executor", choices=["auto", "local", "slurm", "inline"],
                   help="where workers run: local processes, Slurm jobs, auto: Slurm when its controller answers, "
                        f"or inline: threads of this process, for debugging (default {d.executor.kind})")
    p.add_argument("--run-dir", help="run directory (any fsspec URL); default ./runs/<algorithm>-<time>")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                   help="override any config key, e.g. --set inner.lr=1e-3 (repeatable)")


def _group_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--allow-group-write", action="store_true",
                   help="accept a run directory your Unix group can write; every member of the group can then "
                        "change its config or job scripts and so run commands as you")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="orchestrate", description="Train on islands of compute that never talk "
                                     "while they train: DiLoCo, lo-fi, FedAvg, LoRA-the-Explorer.")
    parser.add_argument("-v", "--verbose", action="store_true", help="show debug log records")
    parser.add_argument("--version", action="version", version=f"orchestrate (islands) {_version()}")
    sub = parser.add_subparsers(dest="command")
    p = sub.add_parser("submit", help="start a run and drive it to the end", epilog=SUBMIT_EXAMPLES,
                       formatter_class=HelpFormatter)
    _config_args(p)
    p.add_argument("--oversubscribe", action="store_true",
                   help="on the local executor, start more worker processes than 4 per core (at least 16 are allowed without it)")
    p.add_argument("--replay", metavar="RUN",
                   help="run RUN again, its config and seed, its workers' steps and its merge order, so that every "
                        "global it publishes equals RUN's bit for bit (a finished run that merged every worker "
                        "each round; only --run-dir, --executor and --set executor.* may be given)")
    p.add_argument("--detach", action="store_true",
                   help="run the merge service in the background (a CPU-only job on Slurm) and return at once")
    p.add_argument("--dry-run", action="store_true",
                   help="print the resolved config, the jobs (and sbatch script) and the bytes a round moves and "
                        "the run keeps; submit nothing, write nothing")
    _group_arg(p)
    p = sub.add_parser("resume", help="continue a run from its run directory")
    p.add_argument("run", help=RUN_HELP)
    p.add_argument("--force", action="store_true",
                   help="take the run from a live merge service (it stops before its next commit)")
    p.add_argument("--wait-lease", action="store_true",
                   help="wait for the merge service holding the run to stop beating (up to ~80 s) instead of refusing")
    _group_arg(p)
    p = sub.add_parser("status", help="show a run's progress")
    p.add_argument("run", help=RUN_HELP)
    p.add_argument("--json", action="store_true", help="print the status as one JSON object (for scripts)")
    p.add_argument("--watch", type=float, nargs="?", const=WATCH_S, default=0.0, metavar="SECONDS",
                   help=f"refresh until the run ends (every {WATCH_S:g} s by default)")
    p = sub.add_parser("cancel", help="cancel a run's jobs and stop its orchestrator")
    p.add_argument("run", help=RUN_HELP)
    bench = sub.add_parser("bench", help="benchmarks (queue-wait: docs/scheduling.md)")
    from orchestrator.queuewait import cli as queuewait_cli
    queuewait_cli.add_parser(bench.add_subparsers(dest="bench", required=True))
    from orchestrator.observe import cli as observe_cli
    observe_cli.add_parsers(sub)  # report, eval
    from orchestrator import merge_cli
    merge_cli.add_parser(sub)  # merge: orchestrator/merge_cli.py
    from orchestrator import data_cli
    data_cli.add_parser(sub)  # data prepare | check: orchestrator/data_cli.py
    return parser


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    pairs = {"workers": args.workers, "rounds": args.rounds, "inner.steps": args.inner_steps,
             "algorithm": args.algorithm, "executor.kind": args.executor, "run_dir": args.run_dir}
    return {k: v for k, v in pairs.items() if v is not None}


def cmd_submit(args: argparse.Namespace) -> int:
    from orchestrator.runstate import default_run_dir
    from orchestrator.run_models import create_run

    schedule = None
    if args.replay:
        cfg, schedule = _replay_config(args)
    else:
        cfg = load_config(args.config, _overrides(args), args.sets)
    from orchestrator.slurm import rank_problems
    if problems := rank_problems(cfg):  # before the run directory exists: nothing half-made is left
        raise ConfigError(problems, source="the worker jobs' ranks")
    from orchestrator.observe.trackers import tracker_problems
    if problems := tracker_problems(cfg):
        raise ConfigError(problems, source="log")
    cfg = _with_executor(cfg)
    local_most = max(16, 4 * (os.cpu_count() or 1))
    if cfg.executor.kind == "local" and cfg.workers > local_most and not args.oversubscribe:  # one process each, here
        raise ConfigError([f"workers: {cfg.workers} local workers would start {cfg.workers} processes on this machine "
                           f"of {os.cpu_count()} cores (at most {local_most} without --oversubscribe); use --executor "
                           "slurm, fewer workers, or --oversubscribe if this machine can take them"], source="--workers")
    if cfg.run_dir is None:
        cfg = replace(cfg, run_dir=default_run_dir(cfg))
    from orchestrator.run_service import drive, jobs_folder, requeued_service, run_storage
    storage = run_storage(cfg.run_dir)
    if cfg.task_path is not None:  # the jobs import from it wherever they start
        cfg = replace(cfg, task_path=str(Path(cfg.task_path).expanduser().resolve()))
    if args.dry_run:  # before anything is made: no data prepared, no folder, no job
        from orchestrator.dry_run import plan
        for line in plan(cfg, jobs_folder(storage, create=False)):
            print(line)
        return 0
    from worker.tasks import task_for
    task = task_for(cfg)
    task.check()  # built once on the CPU and tried (lm: its data prepared), before anything is made
    from orchestrator.lease import refuse_unsafe
    refuse_unsafe(storage, allow_group=args.allow_group_write)  # a folder made beforehand, open to others
    create_run(storage, cfg, schedule)
    say(f"run directory: {storage.display()}")
    say(task.describe_data())
    if args.detach:
        from orchestrator.executor import Executor
        executor = Executor(cfg, jobs_folder(storage))
        job = executor.submit_service(storage.url, requeued_service)
        say(f"merge service started as {'Slurm job' if executor.kind == 'slurm' else 'process'} {job}; "
            f"follow it with: orchestrate status {storage.display()} --watch")
        return 0
    return drive(storage, _options(args))


def _replay_config(args: argparse.Namespace) -> tuple[Config, Any]:
    """`submit --replay RUN`: RUN's config made a replay of RUN (core/replay.py), and its schedule.
    Only where it runs, and how its workers get their base (round.replica: the same bytes either
    way), may change: anything else would change what is replayed."""
    from core import replay
    from core.config_parse import load_yaml
    from orchestrator.runstate import load_run
    changed = [flag for flag, value in (("--config", args.config), ("--workers", args.workers), ("--rounds", args.rounds),
                                         ("--inner-steps", args.inner_steps), ("--algorithm", args.algorithm)) if value]
    changed += [f"--set {item}" for item in args.sets if not item.strip().startswith(("executor.", "round.replica="))]
    if changed:
        raise ConfigError([f"{flag}: a replay takes its source run's config; only --run-dir, --executor, "
                           "--set executor.KEY=VALUE and --set round.replica=... may be given" for flag in changed],
                          source="--replay")
    from orchestrator.run_service import run_storage
    source = run_storage(args.replay)
    src = load_run(source)
    schedule = replay.from_run(source, src.workers, src.rounds, src.inner.steps)
    sets = {key.strip(): load_yaml(value, f"--set {key.strip()}") for key, _, value in (item.partition("=") for item in args.sets)}
    cfg = replace(src, run_dir=args.run_dir, executor__kind=args.executor or src.executor.kind, round__replay=source.display(),
                  round__stream_merge=False, round__min_workers=0, round__deadline_s=0.0,
                  inner__threads=schedule.threads or src.inner.threads, **sets)
    return cfg, schedule


def _with_executor(cfg: Config) -> Config:
    """`auto` made definite (and recorded in the run's config). Where Slurm answers, workers go to
    Slurm, never to this machine (a login node, on a cluster): as the config asks for them, or with
    a default request Slurm refuses brought down to what the partition's nodes have (said); a
    request Slurm still refuses is one error, before anything is made. This machine only where
    Slurm is not installed or its controller does not answer, or with --executor local."""
    from orchestrator.executor import HERE
    kind = cfg.executor.kind
    if kind in HERE:
        return cfg
    from orchestrator.slurm import FIX_REQUEST, describe_request, fit_to_partition, request_refusal, slurm_parameters, \
        unreachable
    why = unreachable()
    if why is None and (refused := request_refusal(cfg)) is not None:
        if kind == "auto" and (fit := fit_to_partition(cfg)) is not None:
            sized, where = fit
            say(f"Slurm refuses the worker jobs as configured ({refused}); asking for "
                f"{describe_request(slurm_parameters(sized))} instead, what {where} (set executor.* to choose)")
            return replace(sized, executor__kind="slurm")
        raise IslandsError(f"--executor {kind}: Slurm refuses the worker jobs: {refused}. {FIX_REQUEST}"
                           + (". While Slurm answers, workers never run on this machine (a login node); "
                              "--executor local runs them here if it is meant for training" if kind == "auto"
                              else ", or run here with --executor local"))
    if why is None:
        return replace(cfg, executor__kind="slurm")
    if kind == "slurm":
        raise IslandsError(f"--executor slurm: {why}. Start it (docs/slurm.md: `bash slurm_templates/local-cluster.sh "
                           "up` for a one-machine cluster) or run here with --executor local")
    if shutil.which("sbatch"):  # installed but down: say why the run is not on Slurm
        say(f"not using Slurm: {why}; running on this machine (--executor local)")
    return replace(cfg, executor__kind="local")


def cmd_resume(args: argparse.Namespace) -> int:
    from orchestrator.run_service import resume
    return resume(args.run, _options(args))


def _options(args: argparse.Namespace) -> Any:
    from orchestrator.run_service import ServiceOptions
    return ServiceOptions(force=getattr(args, "force", False), wait_lease=getattr(args, "wait_lease", False),
                          allow_group_write=args.allow_group_write)


def cmd_status(args: argparse.Namespace) -> int:
    from orchestrator.run_service import jobs_folder, run_storage
    from orchestrator.status_cli import cmd_status as status
    return status(args, jobs_folder(run_storage(args.run), create=False))


def cmd_cancel(args: argparse.Namespace) -> int:
    from orchestrator.run_service import jobs_folder, run_storage
    from orchestrator.status_cli import cmd_cancel as cancel
    return cancel(args, jobs_folder(run_storage(args.run), create=False))


COMMANDS = {"submit": cmd_submit, "resume": cmd_resume, "status": cmd_status, "cancel": cmd_cancel}
COMMANDS["bench"] = lambda args: args.bench_handler(args)  # each bench subcommand sets its handler
COMMANDS["report"] = COMMANDS["eval"] = lambda args: args.observe_handler(args)  # orchestrator/observe/cli.py
COMMANDS["merge"] = lambda args: args.merge_handler(args)  # orchestrator/merge_cli.py
COMMANDS["data"] = lambda args: args.data_handler(args)  # orchestrator/data_cli.py


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("islands")
    except PackageNotFoundError:  # run from a checkout that was not installed
        return "unknown (not installed)"


def _watch_before_run(argv: list[str]) -> list[str]:
    """`status --watch RUN`: argparse would take RUN for --watch's optional SECONDS; a value that is
    not a number is the run, and --watch keeps its default."""
    out = list(argv)
    for i, arg in enumerate(out[:-1]):
        if arg == "--watch" and not out[i + 1].startswith("-"):
            try:
                float(out[i + 1])
            except ValueError:
                out[i] = f"--watch={WATCH_S}"
            break
    return out


def _suggestion(parser: argparse.ArgumentParser, command: str | None, extra: list[str]) -> str:
    """' (did you mean --algorithm?)' for a misspelt flag, as a misspelt config key is answered."""
    import difflib
    sub = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
    known = list((sub.choices[command] if sub and command in sub.choices else parser)._option_string_actions)
    close = [m for x in extra if x.startswith("--") for m in difflib.get_close_matches(x.split("=")[0], known, n=1)]
    return f" (did you mean {' or '.join(close)}?)" if close else ""


def main(argv: list[str] | None = None, parser: argparse.ArgumentParser | None = None) -> int:
    parser = parser or build_parser()
    args, extra = parser.parse_known_args(_watch_before_run(sys.argv[1:] if argv is None else argv))
    if extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}{_suggestion(parser, args.command, extra)}")
    if args.command is None:  # bare `orchestrate`: what it can do, as pip and git print
        parser.print_help()
        return 0
    setup_logging(args.verbose)
    try:
        code = COMMANDS[args.command](args)
        sys.stdout.flush()  # a reader that has gone shows here, inside this try, not at exit
        return code
    except IslandsError as exc:
        console.print(f"error: {exc}", markup=False)
        return 2
    except KeyboardInterrupt:  # before the service ran, or in a command of its own: nothing of a run is lost
        console.print("interrupted" + ("; if the run directory was made, `orchestrate resume RUN` continues the run"
                                       if args.command in ("submit", "resume") else ""), markup=False)
        return 130
    except BrokenPipeError:  # `orchestrate status RUN --json | head`: the reader has gone, nothing to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nor at exit, when stdout is flushed
        return 1


if __name__ == "__main__":
    sys.exit(main())
