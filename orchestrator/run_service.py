"""Running the merge service on a run directory: what `orchestrate submit` and `resume` do in the
foreground, and what the service's own Slurm job (orchestrator.executor.ServiceJob) does, without
the command line.
"""
from __future__ import annotations

import hashlib
import logging
import os
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from core.errors import IslandsError, RunError
from core.layout import RunLayout
from core.storage import Storage, sweep_temporaries
from orchestrator.console import console, say, say_command, setup_logging

if TYPE_CHECKING:
    from core.config import Config
    from orchestrator.executor import Executor
    from orchestrator.lease import Lease

log = logging.getLogger(__name__)
L = RunLayout()
TMP_SWEEP_AGE_S = 3600.0
"""Temporaries older than this are a killed writer's leftovers (a live writer's mtime keeps moving):
deleted when a service starts."""


@dataclass(frozen=True)
class ServiceOptions:
    force: bool = False
    """Take the run from a live merge service (it stops before its next commit)."""
    wait_lease: bool = False
    """Wait for the service holding the run to stop beating instead of refusing (a requeued service)."""
    allow_group_write: bool = False
    """Run in a folder the group can write (a shared project folder)."""


def service_main(run_url: str, opts: ServiceOptions) -> int:
    """`orchestrate resume RUN` as a job runs it: logging set up, an islands error printed, not raised."""
    setup_logging(False)
    try:
        return resume(run_url, opts)
    except IslandsError as exc:
        console.print(f"error: {exc}", markup=False)
        return 2


def requeued_service(run_url: str) -> int:
    """The service's Slurm job (orchestrator.executor.ServiceJob): never forcing, a requeued service
    waits for its earlier self's lease to lapse, and stops if a live service holds the run. A run
    cancelled while this job queued or was requeued stays cancelled (only `resume` takes it up again)."""
    if run_storage(run_url).exists(L.CANCEL):
        console.print(f"the run was cancelled (marker {run_storage(run_url).display(L.CANCEL)}): this service job "
                      "stops; `orchestrate resume` takes the run up again", markup=False)
        return 3
    return service_main(run_url, ServiceOptions(wait_lease=True))


def resume(run_url: str, opts: ServiceOptions) -> int:
    storage = run_storage(run_url)
    from orchestrator.runstate import run_status
    done = run_status(storage)["state"] == "done"  # the service still checks what it keeps (a lost outer state)
    say(f"resuming {storage.display()}" + (" (it is done: checking what it keeps)" if done else ""))
    return drive(storage, opts, already_done=done)


def _say_done(storage: Storage, status: dict, done: str) -> None:
    """The lines that end a run: its rounds, final loss and where its final model is."""
    final = status["rounds"][-1]["eval_loss"] if status["rounds"] else None
    say(f"{done}: {status['rounds_done']} rounds, final eval {status['loss']} "
        f"{'not evaluated' if final is None else format(final, '.4f')}; final model: {status['final_model']}"
        + (f"; as a Hugging Face folder: {status['final_hf']}" if status.get("final_hf") else ""))
    say_command("inspect it with:", f"orchestrate status {storage.display()}")


def _take_run(storage: Storage, opts: ServiceOptions) -> tuple[Config, Executor, Lease]:
    """The run's config, its executor and its lease, taken (its log file opened, what killed writers
    left cleared): what a service holds before it drives the run."""
    from orchestrator import lease as leases
    from orchestrator.console import log_to_file
    from orchestrator.executor import Executor
    from orchestrator.runstate import load_run
    leases.refuse_unsafe(storage, allow_group=opts.allow_group_write)  # before its config is read
    cfg = load_run(storage)
    folder = jobs_folder(storage)
    log_to_file(Path(storage.local_path(L.LOG) or Path(folder) / L.LOG))
    wait = leases.STALE_S + 2 * leases.HEARTBEAT_S if opts.wait_lease else 0.0
    lease = leases.acquire(storage, force=opts.force, wait_s=wait)
    # With the lease held we are the only service: clear what killed writers left (never a live one's).
    sweep_temporaries(storage, TMP_SWEEP_AGE_S, skip=(L.JOBS,))
    return cfg, Executor(cfg, folder), lease


def _interrupted(storage: Storage, executor: Executor) -> None:
    """Ctrl-C: local jobs stopped (they are this machine's processes: the CPUs go back), Slurm's
    kept. A local worker first saves where it is (the STOP marker: mid-round its in-flight
    checkpoint, between rounds its state snapshot), so that `resume` goes on to the same model;
    a second Ctrl-C, or STOP_WAIT_S, ends them at once."""
    where = storage.display()
    if executor.here:
        storage.write_bytes(L.STOP, str(time.time()).encode())
        say("interrupted: the local workers are saving their state (Ctrl-C again stops them at once)")
        from orchestrator.executor import STOP_WAIT_S
        executor.end_gracefully(executor.own_jobs(), STOP_WAIT_S)
        say_command("interrupted: this run's local jobs are stopped; to go on:", f"orchestrate resume {where}")
    else:
        say_command("interrupted: the round's Slurm jobs keep running; to go on:", f"orchestrate resume {where}")
        say_command("to stop them:", f"orchestrate cancel {where}")


def jobs_folder(storage: Storage, create: bool = True) -> str:
    """submitit's folder: inside a local run directory, else this machine's cache, one folder per run
    URL (it holds the job scripts and the pickles the jobs execute: private, and checked like jobs/)."""
    folder = storage.local_path(L.JOBS)
    if folder is None:
        from core.layout import local_cache_root
        digest = hashlib.sha256(storage.display().encode()).hexdigest()[:16]
        folder = str(local_cache_root() / "jobs" / f"{Path(storage.root).name}-{digest}")
        _refuse_loose_folder(folder)
    if create:
        run_storage(folder).files.makedirs(folder)  # private (0700): it holds the job scripts Slurm runs
    return folder


def _refuse_loose_folder(folder: str) -> None:
    """A job folder someone else made, or can write, would let them run commands as you."""
    try:
        st = os.lstat(folder)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022:
        raise RunError(f"the run's local job folder {folder} is not a private folder of yours (mode "
                       f"{oct(stat.S_IMODE(st.st_mode))}, uid {st.st_uid}): anyone who can write it runs commands as "
                       f"you; remove it (rm -r {folder}) and try again")


def run_storage(url: str) -> Storage:
    """The storage of a run at `url` (a path or any fsspec URL); refused when it is a file."""
    if "://" in url and ".." in url.split("://", 1)[1].split("/"):
        raise RunError(f"{url}: a run URL with a '..' component names another place than it seems; give the "
                       "run's own URL")
    storage = Storage(url)
    local = storage.local_path("")
    if local is not None and os.path.exists(local) and not os.path.isdir(local):
        raise RunError(f"{url} is a file, not a run directory: give the run directory itself "
                       f"(here perhaps {os.path.dirname(local.rstrip('/')) or '.'})")
    return storage


def drive(storage: Storage, opts: ServiceOptions, already_done: bool = False) -> int:
    """Run the merge service on the run at `storage` until the run ends; the exit code.
    `already_done`: the run was done before this (a resume), which its last line says."""
    from orchestrator import lease as leases
    from orchestrator.loop import Cancelled, Service
    from orchestrator.observe.trackers import Trackers
    from orchestrator.run_models import initial_eval
    from orchestrator.run_view import RunView, duration
    from orchestrator.runstate import run_status
    from core import iostat

    iostat.report_at_exit("service")  # benchmarks only (ISLANDS_IO_REPORT): bytes read and written
    cfg, executor, lease = _take_run(storage, opts)
    t0 = time.monotonic()
    trackers, ended = Trackers(), "FAILED"  # how the service ended, for the trackers' runs
    try:
        trackers = Trackers.open(storage, cfg)  # W&B, MLflow (log.*), continuing the run's own
        service = Service(lease, cfg, executor, on_round=lambda rec: view.round_done(rec.to_json()), trackers=trackers)
        view = RunView(console, storage, cfg, service.first_open_round(), phase=lambda: service.phase)
        say(f"{cfg.algorithm}: {cfg.workers} workers x {cfg.rounds} rounds x {cfg.inner.steps} inner steps, "
            f"{executor.kind} executor; initial eval {cfg.loss_label} {initial_eval(storage, service.evaluator):.4f}"
            + (f"; a replay of {cfg.round.replay}" if cfg.round.replay else ""))
        with view.live():
            service.run()
        executor.settle()
        executor.tidy()
        ended = "FINISHED"
    except Cancelled as exc:
        ended = "KILLED"
        say(str(exc))
        return 3
    except KeyboardInterrupt:
        ended = "KILLED"
        _interrupted(storage, executor)
        return 130
    except leases.LeaseLost:
        raise  # the service that took the run adopted the jobs: they are its to keep
    except BaseException:
        if executor.here:  # a service that stops takes its local jobs with it: none trains unmerged
            executor.cancel(executor.own_jobs())
            log.warning("the merge service stopped: this run's local jobs are stopped")
        raise
    finally:
        trackers.close(ended)
        lease.release()
    _say_done(storage, run_status(storage), "already done" if already_done else f"done in {duration(time.monotonic() - t0)}")
    return 0


