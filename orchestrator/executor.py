"""The one module that talks to submitit (and, for cheap polling, to sacct).

Workers are submitted as plain data (a Assignment); a round's K workers go out as one batch,
which on Slurm is one job array (one sbatch per round). Job state for all of a run's jobs comes
from one call per poll. The worker callable is Checkpointable: on preemption or time limit it
saves an in-flight checkpoint to storage and asks to be requeued with the same task.
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import io
import logging
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import submitit

from core.config import Config
from core.errors import RunError
from core.assignment import Assignment
from orchestrator import inline
from orchestrator.jobstatus import JobStatus
from orchestrator.slurm import (FIX_REQUEST, SlurmPoller, describe_request, local_gpus, sbatch_said,
                               service_parameters, slurm_parameters, unreachable, worker_tasks)

log = logging.getLogger(__name__)
STOP_WAIT_S = 120.0
"""How long a stopped or cancelled run's jobs get to save where they are and end before they are killed."""
CANCELLED_MARK = "cancelled"
"""Left in a job's folder by cancel(): islands cancelled it (a local job's state is CANCELLED, not FAILED)."""
_JOB_ID = re.compile(r"\d{1,12}(_\d{1,9})?")  # a Slurm job (array task) id or a local pid
FAILED_LINE = "Submitted job triggered an exception"
"""What submitit's job logs when the function raised (submitit/core/submission.py)."""

class WorkerJob(submitit.helpers.Checkpointable):
    """The callable submitit runs on the node. Plain data in, a small summary out."""

    def __call__(self, task: Assignment) -> dict[str, Any]:
        # worker/ (torch) is imported on the node only: `status` and `cancel` use this module without it
        from core import iostat
        from worker.persistent import run_persistent
        from worker.train import run_worker
        iostat.report_at_exit("worker")  # benchmarks only (ISLANDS_IO_REPORT): bytes read and written
        return run_persistent(task) if task.persistent else run_worker(task)

    def checkpoint(self, task: Assignment) -> submitit.helpers.DelayedSubmission:
        # Called in the job when Slurm signals a time limit or preemption: save where we are so
        # the requeued job resumes mid-round instead of starting the round over. A persistent
        # worker comes back at the round it was serving, not the one it started with.
        from worker.persistent import current_round
        from worker.train import checkpoint_active
        checkpoint_active()
        if task.persistent and current_round() is not None:
            task = dataclasses.replace(task, round=current_round())
        return submitit.helpers.DelayedSubmission(WorkerJob(), task)


class ServiceJob(submitit.helpers.Checkpointable):
    """The merge service as a small CPU-only job, requeued at its limit: `main(run_url)` runs it
    (orchestrator.run_service.requeued_service, handed in by the caller: the service's own modules
    use this one, so it imports none of them)."""

    def __init__(self, main: Callable[[str], int]) -> None:
        self.main = main

    def __call__(self, run_url: str) -> int:
        return self.main(run_url)

    def checkpoint(self, run_url: str) -> submitit.helpers.DelayedSubmission:
        # Nothing to save: the service's whole state is in the run directory.
        return submitit.helpers.DelayedSubmission(ServiceJob(self.main), run_url)


def resolve_kind(kind: str) -> str:
    """A run made since `submit` records a definite kind; `auto` (an older run, or a config used
    directly) takes the rule submit applies: Slurm when it takes jobs from here (slurm.unreachable)."""
    if kind == "auto":
        return "slurm" if unreachable() is None else "local"
    return kind


HERE = ("local", "inline")
"""The kinds whose jobs run on this machine and end with the service that started them."""


class Executor:
    """Submits worker tasks and reports job states for the whole run in one call."""

    def __init__(self, cfg: Config, folder: str | Path) -> None:
        self.cfg = cfg
        self.kind = resolve_kind(cfg.executor.kind)
        self.folder = Path(folder)
        self._jobs: dict[str, submitit.Job] = {}
        self._gpus: int | None = None  # the machine's GPUs, for local jobs: counted at the first submission
        self._ex = self._make(self.folder / "%j")
        self._poller = SlurmPoller()

    @property
    def here(self) -> bool:
        """Whether the jobs run on this machine (local processes, inline threads) and stop with the service."""
        return self.kind in HERE

    def _make(self, folder: Path) -> submitit.Executor | None:
        e = self.cfg.executor
        if self.kind == "inline":  # threads of this process (orchestrator/inline.py): no submitit
            return None
        if self.kind == "local":
            ex = submitit.LocalExecutor(folder=folder)
            # submitit hides every GPU from a local job unless it is given some (CUDA_VISIBLE_DEVICES="")
            ex.update_parameters(timeout_min=e.timeout_min, setup=list(e.setup), tasks_per_node=worker_tasks(self.cfg),
                                 gpus_per_node=e.gpus_per_node)
            return ex
        # A persistent worker meets its time limit once per lifetime, by design: let it requeue.
        persistent = self.cfg.round.worker_mode == "persistent"
        ex = submitit.SlurmExecutor(folder=folder, max_num_timeout=1000 if persistent else 3)
        ex.update_parameters(**slurm_parameters(self.cfg))
        return ex

    def _local_gpu_count(self) -> int:
        """This machine's GPUs, checked against what the config asks of a local worker job."""
        import torch
        count, e = torch.cuda.device_count(), self.cfg.executor
        if e.gpus_per_node > count:
            raise RunError(f"executor.gpus_per_node={e.gpus_per_node} but this machine has {count} GPU(s) for the "
                           f"local executor; set executor.gpus_per_node to at most {count}")
        if count and not e.gpus_per_node and self.cfg.inner.device != "cpu":
            log.warning("this machine has %d GPU(s) but executor.gpus_per_node=0: local workers see none and train "
                        "on the CPU; set executor.gpus_per_node=1 to give each worker a GPU", count)
        return count

    def _submit_one(self, task: Assignment) -> submitit.Job:
        if self.kind == "inline":
            return _InlineJob(inline.submit(WorkerJob(), task))
        if self.kind == "local" and self._gpus is None:  # not before: status and cancel never import torch
            self._gpus = self._local_gpu_count()
        if self.kind == "local" and self.cfg.executor.gpus_per_node:  # each local worker its own GPUs, if there are enough
            self._ex.update_parameters(visible_gpus=local_gpus(task.worker, self.cfg.executor.gpus_per_node, self._gpus))
        return self._ex.submit(WorkerJob(), task)

    def submit(self, tasks: list[Assignment]) -> list[str]:
        """Submit a round's tasks together (one job array on Slurm); return their job ids."""
        batch = self._ex.batch() if self.kind == "slurm" else contextlib.nullcontext()
        with _sbatch_refusal(slurm_parameters(self.cfg), "worker"), _sigint_ignored(self.kind == "local"), batch:
            jobs = [self._submit_one(t) for t in tasks]
        for job in jobs:
            self._jobs[job.job_id] = job
        return [j.job_id for j in jobs]

    def submit_service(self, run_url: str, main: Callable[[str], int]) -> str:
        """Run the merge service detached: a CPU-only Slurm job running `main(run_url)`, or a local
        background process running `orchestrate resume RUN`."""
        if self.kind in HERE:
            log_path = self.folder / "service.log"
            self.folder.mkdir(parents=True, exist_ok=True)
            with open(log_path, "ab") as out:
                proc = subprocess.Popen([sys.executable, "-m", "orchestrator.cli", "resume", run_url], stdout=out,
                                        stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
            return str(proc.pid)
        ex = submitit.SlurmExecutor(folder=self.folder / "service" / "%j", max_num_timeout=1000)
        params = service_parameters(self.cfg)
        ex.update_parameters(**params)
        with _sbatch_refusal(params, "merge service"):
            return ex.submit(ServiceJob(main), run_url).job_id

    def status(self, job_ids: list[str]) -> dict[str, JobStatus]:
        if not job_ids:
            return {}
        if self.kind == "slurm":
            return self._poller.poll(job_ids)
        if self.kind == "inline":
            return {j: inline.status(j) for j in job_ids}
        self._reap()
        return {j: self._local_status(j) for j in job_ids}

    def watch(self, job_ids: list[str], news: bool) -> dict[str, JobStatus]:
        """status() as the service's poll loop asks for it: with back-off on Slurm (SlurmPoller.watch);
        `news`: something changed in storage, ask now."""
        if self.kind != "slurm":
            return self.status(job_ids)
        return self._poller.watch(job_ids, news, self.cfg.round.poll_s)

    def tidy(self) -> None:
        """Once the run's jobs are over: submitit's local jobs each make the folder named by its
        pattern (`jobs/%j`, literally) and leave it empty."""
        if self.kind == "local":
            with contextlib.suppress(OSError):  # absent, or not empty: then it is not ours to remove
                (self.folder / "%j").rmdir()

    def settle(self, timeout_s: float = 30.0) -> None:
        """Wait, at most `timeout_s`, for this process's local jobs to end once the run is done (a
        persistent worker exits when it sees the finish): `status` right after the done line then
        shows none of them running. Slurm's jobs end on their own clock."""
        deadline = time.monotonic() + timeout_s
        while self.kind in HERE and self.own_jobs() and time.monotonic() < deadline:
            time.sleep(0.1)

    def end_gracefully(self, job_ids: list[str], wait_s: float) -> list[str]:
        """Jobs told to stop (the run's STOP or CANCEL marker, which a worker looks for between its
        steps and while it waits, saving where it is first) get `wait_s` to end on their own; those
        not started yet are cancelled at once, the rest once the time is up (a second Ctrl-C ends
        the wait). Each is marked islands' own stop, however it ends: a resume resubmits it as
        expected, not as lost work. Returns the jobs cancelled while still running."""
        if self.kind != "inline":
            for j in job_ids:
                self._mark_cancelled(j)
        pending = [j for j, s in self.status(job_ids).items() if s.state.split()[0] in ("PENDING", "REQUEUED")]
        self.cancel(pending)
        running = [j for j in job_ids if j not in pending]
        deadline = time.monotonic() + wait_s
        try:
            while running and time.monotonic() < deadline:
                time.sleep(0.2 if self.kind in HERE else 2.0)  # sacct: not a tight loop on the controller
                running = [j for j, s in self.status(running).items() if s.alive]
        except KeyboardInterrupt:
            log.warning("interrupted again: the jobs are stopped where they are")
        self.cancel(running)
        return running

    def own_jobs(self) -> list[str]:
        """The local jobs this process started that still run."""
        if self.kind == "inline":
            return [j for j in inline.running() if j in self._jobs]
        self._reap()
        return list(self._jobs)

    def _reap(self) -> None:
        """Collect this process's local jobs that have ended (asking a submitit job its state waits
        for its process): no <defunct> controllers pile up while the run goes on."""
        for job_id, job in list(self._jobs.items()):
            if job.state != "RUNNING":
                del self._jobs[job_id]

    def _local_status(self, job_id: str) -> JobStatus:
        # A job this process started and has not reaped runs; else (ended, or started by an earlier
        # orchestrator: resume) the local job id is the pid of submitit's controller, alive while it runs.
        alive = job_id in self._jobs or self._is_ours(job_id)
        return local_job_status(self.folder, job_id, alive)

    def cancel(self, job_ids: list[str]) -> None:
        if not job_ids:
            return
        if self.kind == "slurm":
            subprocess.run(["scancel", *job_ids], check=False, capture_output=True)
            for j in job_ids:
                self._mark_cancelled(j)
            return
        if self.kind == "inline":
            for j in job_ids:
                inline.cancel(j)
            return
        for j in job_ids:
            if self._is_ours(j):
                self._mark_cancelled(j)
                kill_local_job(j)
        self._reap()

    def _mark_cancelled(self, job_id: str) -> None:
        """What status and a later resume read: islands cancelled this job (it did not fail)."""
        if _JOB_ID.fullmatch(job_id):  # ids are read from the run directory: never a path
            with contextlib.suppress(OSError):
                (self.folder / job_id).mkdir(mode=0o700, exist_ok=True)
                (self.folder / job_id / CANCELLED_MARK).touch()

    def cancelled_here(self, job_id: str) -> bool:
        """Whether islands itself cancelled the job (Ctrl-C on the service, `orchestrate cancel`, a
        straggler's cancel): its resubmission is expected, not news for the user."""
        if self.kind == "inline":
            return inline.status(job_id).state == "CANCELLED"
        return bool(_JOB_ID.fullmatch(job_id)) and (self.folder / job_id / CANCELLED_MARK).exists()

    def _is_ours(self, job_id: str) -> bool:
        """Whether the local job id (a pid, read from the run directory, which others may write) is a
        submitit controller of this run's jobs: a process of this user whose command line ends with
        this run's job folder. Nothing else is ever adopted or signalled: not another run's job, not a
        reused pid, not a process someone named in jobs.json."""
        return _controller_folder(job_id) == str((self.folder / "%j").expanduser().absolute())  # as submitit writes it

    def stderr_tail(self, job_id: str, lines: int = 15) -> str:
        """The end of a job's stderr: why it ended without a contribution."""
        if self.kind == "inline":
            return inline.error_tail(job_id, lines)
        text = _tail(submitit.core.utils.JobPaths(self.folder / "%j", job_id).stderr, 256 * lines)
        return "\n".join(text.strip().splitlines()[-lines:])


@dataclasses.dataclass(frozen=True)
class _InlineJob:
    """What Executor.submit keeps of an inline job (a submitit.Job's job_id)."""

    job_id: str


def sbatch_text(cfg: Config, folder: str | Path, array_size: int) -> str:
    """The sbatch script submitit writes for one round's job array (pinned by a golden-file test)."""
    from submitit.slurm.slurm import _make_sbatch_string

    return _make_sbatch_string(command="python -u -m submitit.core._submit " + str(folder), folder=str(folder),
                               map_count=array_size, **slurm_parameters(cfg))


def kill_local_job(job_id: str) -> None:
    """End a local job as Slurm ends a cancelled one, for certain: SIGKILL to its tasks, then to
    submitit's controller (whose id the job's is). SIGINT, submitit's own way, is ignored by a
    process started in the background of a non-interactive shell (or under nohup), and the tasks
    ignore SIGTERM (submitit bypasses it, expecting Slurm's SIGKILL)."""
    pid = int(job_id)
    for child in _children(pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


@contextlib.contextmanager
def _sbatch_refusal(params: dict[str, Any], what: str) -> Iterator[None]:
    """sbatch's refusal as one IslandsError that says what was asked and what to change, instead of
    submitit's traceback around sbatch's stderr (which submitit also prints: that copy is dropped)."""
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            yield
    except submitit.core.utils.FailedJobError as exc:
        raise RunError(f"sbatch refused the {what} job(s): {sbatch_said(str(exc))}. They asked for "
                       f"{describe_request(params)}. {FIX_REQUEST} and submit again with a "
                       "new --run-dir; if the scheduler was only briefly unavailable, `orchestrate resume RUN` "
                       "continues this run") from None


@contextlib.contextmanager
def _sigint_ignored(local: bool) -> Iterator[None]:
    """Start local jobs with SIGINT ignored (a disposition a child keeps): Ctrl-C at the terminal
    reaches the whole foreground process group, and a worker's KeyboardInterrupt is a traceback
    in the middle of the screen. The orchestrator stops its local jobs itself (kill_local_job)."""
    if not local or threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def local_job_status(folder: Path, job_id: str, alive: bool) -> JobStatus:
    """A local job's state and times from submitit's files (a local job has no accounting): it was
    submitted, and started at once, when its pickle was written; it ended when its result was (or,
    killed, when its log was last written). Its result is never unpickled: submitit's own log line
    tells a failure from a success."""
    paths = submitit.core.utils.JobPaths(folder / "%j", job_id)
    started = _stamp(paths.submitted_pickle)
    if alive:
        return JobStatus(job_id, "RUNNING", started, started)
    if (folder / job_id / CANCELLED_MARK).exists():
        state = "CANCELLED"
    elif paths.result_pickle.exists():
        state = "FAILED" if FAILED_LINE in _tail(paths.stderr) else "COMPLETED"
    else:
        state = "FAILED"  # killed before it could say anything
    ended = _stamp(paths.result_pickle) or _stamp(paths.stderr) or started
    return JobStatus(job_id, state, started, started, ended)


def _stamp(path: Path) -> str | None:
    try:
        return dt.datetime.fromtimestamp(path.stat().st_mtime).isoformat(timespec="seconds")
    except OSError:
        return None


def _tail(path: Path, size: int = 4096) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - size))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def _children(pid: int) -> list[int]:
    """Every descendant of `pid`, deepest last (from /proc)."""
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError, ValueError):
            for child in (task / "children").read_text().split():
                found += [int(child), *_children(int(child))]
    return found


def _controller_folder(job_id: str) -> str | None:
    """The job folder a local submitit controller of this user runs for, from its command line
    (`python -m submitit.local._local FOLDER`, or that at the end of `sh -c "SETUP && ..."`)."""
    if not job_id.isdigit():
        return None
    proc = Path(f"/proc/{int(job_id)}")
    try:
        if proc.stat().st_uid != os.getuid():
            return None
        argv = proc.joinpath("cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return None
    argv = [a for a in argv if a]
    if len(argv) == 3 and argv[1] == "-c":  # executor.setup: a shell runs the setup, then the controller
        with contextlib.suppress(ValueError):
            argv = shlex.split(argv[2])
    if len(argv) < 4 or argv[-3:-1] != ["-m", "submitit.local._local"]:
        return None
    return argv[-1]
