"""Slurm specifics as pure functions (sbatch parameters, presets) plus one cheap sacct poll.

`slurm_parameters` turns the config into submitit SlurmExecutor parameters; the sbatch text they
produce is pinned by a golden-file test. `sacct_status` asks about every job of a run in one call
(never one call per job: that is what makes per-job polling loops melt a controller at scale).
"""
from __future__ import annotations

import logging
import shutil
import subprocess
import time
from typing import Any

from core.config import Config, ExecutorConfig, replace
from orchestrator import commands
from orchestrator.jobstatus import JobStatus

log = logging.getLogger(__name__)


def unreachable() -> str | None:
    """Why Slurm cannot take jobs from here, or None: sbatch is installed and the controller answers
    (`scontrol ping`, what an admin would try first)."""
    if not shutil.which("sbatch"):
        return "sbatch is not on PATH: Slurm is not installed here"
    try:
        ping = commands.run(["scontrol", "ping"], timeout=15)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"`scontrol ping` did not run ({exc})"
    said = next(iter((ping.stdout or ping.stderr).strip().splitlines()), "")[:160]  # not its banner
    if ping.returncode != 0 or " UP" not in ping.stdout:
        return f"the Slurm controller does not answer (`scontrol ping`: {said or f'exit {ping.returncode}'})"
    return None


def worker_tasks(cfg: Config) -> int:
    """Ranks per worker job: executor.tasks_per_node, else one per GPU, else one."""
    return cfg.executor.tasks_per_node or cfg.executor.gpus_per_node or 1


def local_gpus(worker: int, per_job: int, count: int) -> tuple[int, ...]:
    """The GPUs a worker job on the local executor sees: worker w takes the w-th group of `per_job`
    of the machine's `count` GPUs; more workers than groups share them, round robin."""
    start = worker % max(1, count // per_job) * per_job
    return tuple(range(start, start + per_job))


def rank_problems(cfg: Config) -> list[str]:
    """What makes a multi-rank worker impossible, all at once (checked before anything is submitted)."""
    e = cfg.executor
    tasks, gpus, p = worker_tasks(cfg), e.gpus_per_node, []
    if gpus and cfg.inner.device == "cpu":
        p.append(f"executor.gpus_per_node={gpus} with inner.device=cpu would hold GPUs nobody uses: "
                 "set inner.device auto (or cuda), or gpus_per_node 0")
    if gpus and tasks > gpus:
        p.append(f"executor.tasks_per_node={tasks} is more than the job's {gpus} GPU(s): one rank per GPU at most")
    if cfg.worker_batch_size % tasks:
        p.append(f"a worker's batch ({cfg.worker_batch_size} sequences) does not split across its {tasks} ranks: "
                 f"make inner.batch_size a multiple of {tasks}" + (" x workers (lofi)" if cfg.algorithm == "lofi" else ""))
    if tasks > 1 and cfg.inner.parallel == "fsdp" and cfg.algorithm == "lte":
        p.append("inner.parallel=fsdp shards whole models, not LoRA heads over a frozen base (lte): use ddp")
    if e.kind == "inline" and (tasks > 1 or gpus):
        p.append("executor.kind=inline runs each worker as one thread of this process, on the devices this process "
                 "sees: set executor.tasks_per_node and gpus_per_node to 0, or use --executor local for ranks and GPUs")
    if tasks > e.cpus_per_task:
        p.append(f"executor.cpus_per_task={e.cpus_per_task} is shared by the job's ranks: it needs one per rank "
                 f"({tasks}) at least")
    return p


def slurm_parameters(cfg: Config) -> dict[str, Any]:
    """submitit SlurmExecutor.update_parameters() arguments for one worker job."""
    e = cfg.executor
    tasks = worker_tasks(cfg)
    params: dict[str, Any] = {
        "job_name": "islands-worker",
        "time": e.timeout_min,
        "nodes": 1,  # islands never span nodes: that is the point
        "ntasks_per_node": tasks,  # one rank per GPU (worker/ranks.py)
        "cpus_per_task": e.cpus_per_task // tasks,  # the config's count is the whole job's
        "mem": f"{int(round(e.mem_gb * 1024))}MB",
        "signal_delay_s": 120 if e.timeout_min > 10 else 30,
        "array_parallelism": max(cfg.workers, 1),
    }
    if e.gpus_per_node:
        params["gpus_per_node"] = e.gpus_per_node
    if tasks > 1:  # a rank that dies ends the job's other ranks at once (they would wait on a collective)
        params["srun_args"] = ["--kill-on-bad-exit=1"]
    for key in ("partition", "account", "qos", "constraint"):
        if getattr(e, key):
            params[key] = getattr(e, key)
    if e.setup:
        params["setup"] = list(e.setup)
    if e.extra_sbatch:
        params["additional_parameters"] = dict(e.extra_sbatch)
    return params


def service_parameters(cfg: Config) -> dict[str, Any]:
    """The merge service's own job: where the workers go (partition, account...), but one task on
    one CPU, no GPU."""
    params = slurm_parameters(cfg)
    params.update(job_name="islands-service", ntasks_per_node=1, cpus_per_task=1, mem="2048MB",
                  array_parallelism=1, time=cfg.executor.service_timeout_min)
    params.pop("gpus_per_node", None)
    params.pop("srun_args", None)
    return params


PLACEMENT = ("gpus_per_node", "partition", "account", "qos", "constraint")
"""sbatch parameters a config may set or leave out (slurm_parameters)."""
FIX_REQUEST = ("Set executor.* to what the cluster has (executor.mem_gb, executor.cpus_per_task, executor.partition, "
               "or a preset: executor.preset=local on the local test cluster; docs/slurm.md)")


def describe_request(params: dict[str, Any]) -> str:
    """What a job of these sbatch parameters asks for, in words."""
    return (f"1 node, {params['ntasks_per_node']} task(s) x {params['cpus_per_task']} CPU(s), {params['mem']} of memory, "
            f"{params['time']} min" + "".join(f", {k} {params[k]}" for k in PLACEMENT if params.get(k)))


def sbatch_said(stderr: str) -> str:
    """sbatch's complaint, its lines joined, without its `sbatch: error:` prefixes."""
    return "; ".join(line.removeprefix("sbatch: error: ").strip() for line in stderr.splitlines() if line.strip())


def test_only_command(params: dict[str, Any]) -> list[str]:
    """`sbatch --test-only` for a job of these parameters: the scheduler says whether it could ever
    run it (a request no node can satisfy is refused) without submitting anything."""
    cmd = ["sbatch", "--test-only", "--nodes=1", f"--ntasks-per-node={params['ntasks_per_node']}",
           f"--cpus-per-task={params['cpus_per_task']}", f"--mem={params['mem']}", f"--time={params['time']}"]
    cmd += [f"--{k.replace('_', '-')}={params[k]}" for k in PLACEMENT if params.get(k)]
    cmd += [f"--{k.replace('_', '-')}={v}" for k, v in params.get("additional_parameters", {}).items()]
    return [*cmd, "--wrap=true"]


def request_refusal(cfg: Config) -> str | None:
    """Why Slurm refuses the run's worker jobs as the config asks for them (its own words), or None."""
    params = slurm_parameters(cfg)
    try:
        done = commands.run(test_only_command(params), timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"`sbatch --test-only` did not run ({exc})"
    if done.returncode == 0:
        return None
    said = sbatch_said(done.stderr)
    return f"{said or f'sbatch --test-only exited {done.returncode}'} (the worker jobs ask for {describe_request(params)})"


def largest_node(partition: str | None) -> tuple[str, int, int, int | None] | None:
    """(partition, CPUs, memory in MB, its time limit in minutes or None) of the node of `partition`
    (the cluster's default partition when None) with the most memory, as `sinfo` reports them;
    None when sinfo does not run or names no such node."""
    try:
        done = commands.run(["sinfo", "--noheader", "--Node", "--format=%P|%c|%m|%l"], timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    nodes = []
    for line in done.stdout.splitlines():
        name, cpus, mem, limit = (line.split("|") + ["", "", ""])[:4]
        if (name.rstrip("*") == partition) if partition else name.endswith("*"):
            try:
                nodes.append((int(mem.rstrip("+")), int(cpus.rstrip("+")), name.rstrip("*"), minutes(limit)))
            except ValueError:
                continue
    if not nodes:
        return None
    mem, cpus, name, limit = max(nodes, key=lambda n: n[:2])
    return name, cpus, mem, limit


def minutes(limit: str) -> int | None:
    """A Slurm time limit (`infinite`, `30`, `1:00:00`, `2-00:00:00`) in whole minutes; None: no limit."""
    limit = limit.strip()
    if not limit or limit in ("infinite", "UNLIMITED"):
        return None
    days, _, clock = limit.rpartition("-")
    parts = [int(x) for x in clock.split(":")]
    if days:  # days-hours[:minutes[:seconds]]
        h, m = parts[0], parts[1] if len(parts) > 1 else 0
    else:  # minutes[:seconds], or hours:minutes:seconds
        h, m = (parts[0], parts[1]) if len(parts) == 3 else (0, parts[0])
    return int(days or 0) * 1440 + h * 60 + m  # seconds dropped: a job must fit under the limit


def sized_request(cfg: Config, cpus: int, mem_mb: int, limit_min: int | None) -> dict[str, Any]:
    """The executor keys (dotted) that bring a worker job's request down to a node of `cpus` CPUs and
    `mem_mb` MB and a partition of `limit_min` minutes: only keys still at their defaults (a value
    the user wrote stays, and is what Slurm refuses); {} when none would change. Pure."""
    e, default, out = cfg.executor, ExecutorConfig(), {}
    if e.mem_gb == default.mem_gb and round(e.mem_gb * 1024) > mem_mb:
        out["executor.mem_gb"] = mem_mb / 1024
    if e.cpus_per_task == default.cpus_per_task and e.cpus_per_task > cpus >= worker_tasks(cfg):
        out["executor.cpus_per_task"] = cpus
    if e.timeout_min == default.timeout_min and limit_min is not None and e.timeout_min > limit_min:
        out["executor.timeout_min"] = limit_min
    return out


def fit_to_partition(cfg: Config) -> tuple[Config, str] | None:
    """The config with its default worker request brought down to what its partition's largest node
    has, and where that came from, when Slurm then takes the jobs (`sbatch --test-only`); else None."""
    node = largest_node(cfg.executor.partition)
    if node is None:
        return None
    name, cpus, mem, limit = node
    changes = sized_request(cfg, cpus, mem, limit)
    if not changes:
        return None
    sized = replace(cfg, **changes)
    if request_refusal(sized) is not None:
        return None
    return sized, f"partition {name}'s largest node: {cpus} CPUs, {mem} MB" + (f", {limit} min" if limit else "")


SACCT_FIELDS = "JobID,State,Submit,Start,End,NodeList"


def parse_sacct(text: str) -> dict[str, dict[str, str]]:
    """Rows of `sacct -P -n -X -o SACCT_FIELDS`, keyed by job id (array tasks as 12_3)."""
    rows = {}
    names = SACCT_FIELDS.split(",")
    for line in text.splitlines():
        parts = line.split("|")
        if len(parts) != len(names) or "." in parts[0]:
            continue
        row = dict(zip(names, parts))
        row["State"] = _by_whom(row["State"])
        rows[parts[0]] = row
    return rows


def _by_whom(state: str) -> str:
    """sacct's `CANCELLED by 1000` with the user's name (`CANCELLED by alice`), as a person reads it."""
    head, sep, uid = state.partition(" by ")
    if sep and uid.isdigit():
        import pwd
        try:
            return f"{head} by {pwd.getpwuid(int(uid)).pw_name}"
        except KeyError:
            return f"{head} by uid {uid}"
    return state


SQUEUE_FORMAT = "%i|%T|%V|%S"
"""Job id, state, submit time, start time (expected, for a pending job: not used)."""


def parse_squeue(text: str) -> dict[str, tuple[str, str, str]]:
    """Lines of `squeue -h -r -o SQUEUE_FORMAT` (arrays expanded), as {job id: (state, submit, start)}."""
    out = {}
    for line in text.splitlines():
        parts = line.strip().split("|")
        if len(parts) == 4:
            out[parts[0]] = (parts[1], parts[2], parts[3])
    return out


MAX_INTERVAL_S = 30.0
"""The longest the service goes without asking Slurm about the jobs it waits for."""


class SlurmPoller:
    """States of many jobs from one sacct and one squeue call per poll, whatever their number.

    sacct is the record of ended jobs (submitit needs accounting for the same reason), squeue
    of queued ones; squeue's submit and start times stand in while the accounting database has
    no row for a job yet (it lags the controller by seconds). An array task cancelled while
    pending shows in neither (sacct keeps only the pending array's row), so a job missing from
    both for `grace_s` counts as gone.
    """

    def __init__(self, grace_s: float = 10.0) -> None:
        self.grace_s = grace_s
        self._missing_since: dict[str, float] = {}
        self._seen: dict[str, JobStatus] = {}
        self._polled_at = 0.0
        self._interval = 0.0

    def watch(self, job_ids: list[str], news: bool, min_interval_s: float) -> dict[str, JobStatus]:
        """poll(), with back-off, as submitit's watcher does: the states seen last, asked again once
        `_interval` has passed, which doubles (up to MAX_INTERVAL_S) while nothing new happens. The
        caller knows arrivals from storage at once (`news`: back to the shortest interval); the
        scheduler is only needed to notice dead jobs, and one sacct per interval is the most a
        run ever sends."""
        now = time.monotonic()
        if news or set(job_ids) - set(self._seen):
            self._interval = min_interval_s
        if news or set(job_ids) - set(self._seen) or now - self._polled_at >= self._interval:
            self._seen.update(self.poll(job_ids))
            self._polled_at = now
            self._interval = min(MAX_INTERVAL_S, max(min_interval_s, self._interval * 2))
        return {j: self._seen[j] for j in job_ids}

    def poll(self, job_ids: list[str]) -> dict[str, JobStatus]:
        bases = ",".join(sorted({j.split("_")[0] for j in job_ids}))
        acct = parse_sacct(_run(["sacct", "-P", "-n", "-X", "-o", SACCT_FIELDS, "-j", bases]))
        queue = parse_squeue(_run(["squeue", "-h", "-r", "-o", SQUEUE_FORMAT, "-j", bases]))
        now = time.monotonic()
        return {j: self._status(j, acct.get(j), queue.get(j), now) for j in job_ids}

    def _status(self, job: str, row: dict[str, str] | None, queued: tuple[str, str, str] | None,
                now: float) -> JobStatus:
        none = lambda v: None if v in ("", "Unknown", "None", "N/A") else v  # noqa: E731
        if row is not None and (queued is None or row["State"] not in ("PENDING",)):
            self._missing_since.pop(job, None)
            return JobStatus(job, row["State"], none(row["Submit"]), none(row["Start"]), none(row["End"]))
        if queued is not None:
            self._missing_since.pop(job, None)
            state, submit, start = queued
            return JobStatus(job, state, none(submit), None if state == "PENDING" else none(start))
        first = self._missing_since.setdefault(job, now)
        return JobStatus(job, "PENDING" if now - first < self.grace_s else "GONE (not in squeue or sacct)")


def _run(cmd: list[str]) -> str:
    try:
        return commands.run(cmd, timeout=60).stdout
    except (subprocess.SubprocessError, OSError) as exc:
        log.warning("%s failed (%s); job states may lag", cmd[0], exc)
        return ""
