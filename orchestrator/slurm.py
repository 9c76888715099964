"""Slurm specifics as pure functions (sbatch parameters, presets) plus one cheap sacct poll.

`slurm_parameters` turns the config into submitit SlurmExecutor parameters; the sbatch text they
produce is pinned by a golden-file test. `sacct_status` asks about every job of a run in one call
(never one call per job: that is what makes per-job polling loops melt a controller at scale).
"""
from __future__ import annotations

import logging
import subprocess
from pathlib import Path
from typing import Any

import yaml

from core.config import Config, ExecutorConfig
from core.errors import ConfigError

log = logging.getLogger(__name__)
PRESET_DIR = Path(__file__).resolve().parent.parent / "slurm_templates"
PRESET_KEYS = ("timeout_min", "cpus_per_task", "mem_gb", "gpus_per_node", "partition", "account", "qos",
               "constraint", "extra_sbatch", "setup")


def load_preset(name: str, directory: Path = PRESET_DIR) -> dict[str, Any]:
    path = directory / f"{name}.yaml"
    if not path.exists():
        known = sorted(p.stem for p in directory.glob("*.yaml"))
        raise ConfigError([f"executor.preset {name!r} does not exist; known presets: {', '.join(known) or 'none'} "
                           f"(files in {directory})"])
    data = yaml.safe_load(path.read_text()) or {}
    unknown = sorted(set(data) - set(PRESET_KEYS))
    if unknown:
        raise ConfigError([f"preset {path}: unknown key(s) {unknown}; valid keys: {', '.join(PRESET_KEYS)}"])
    return data


def effective_executor(e: ExecutorConfig) -> dict[str, Any]:
    """Executor settings with the preset filling every field the config left at its default."""
    values = {k: getattr(e, k) for k in PRESET_KEYS}
    if e.preset:
        defaults = ExecutorConfig()
        for k, v in load_preset(e.preset).items():
            if values[k] == getattr(defaults, k):
                values[k] = v
    return values


def slurm_parameters(cfg: Config) -> dict[str, Any]:
    """submitit SlurmExecutor.update_parameters() arguments for one worker job."""
    e = effective_executor(cfg.executor)
    params: dict[str, Any] = {
        "job_name": "islands-worker",
        "time": int(e["timeout_min"]),
        "nodes": 1,  # islands never span nodes: that is the point
        "ntasks_per_node": 1,
        "cpus_per_task": int(e["cpus_per_task"]),
        "mem": f"{int(round(float(e['mem_gb']) * 1024))}MB",
        "signal_delay_s": 120 if int(e["timeout_min"]) > 10 else 30,
        "array_parallelism": max(cfg.workers, 1),
    }
    if e["gpus_per_node"]:
        params["gpus_per_node"] = int(e["gpus_per_node"])
    for key in ("partition", "account", "qos", "constraint"):
        if e[key]:
            params[key] = e[key]
    if e["setup"]:
        params["setup"] = list(e["setup"])
    if e["extra_sbatch"]:
        params["additional_parameters"] = dict(e["extra_sbatch"])
    return params


SACCT_FIELDS = "JobID,State,Submit,Start,End,NodeList"


def parse_sacct(text: str) -> dict[str, dict[str, str]]:
    """Rows of `sacct -P -n -X -o SACCT_FIELDS`, keyed by job id (array tasks as 12_3)."""
    rows = {}
    names = SACCT_FIELDS.split(",")
    for line in text.splitlines():
        parts = line.split("|")
        if len(parts) != len(names) or "." in parts[0]:
            continue
        rows[parts[0]] = dict(zip(names, parts))
    return rows


def sacct_status(job_ids: list[str]):
    """Status of many jobs from one sacct call; jobs sacct does not list yet count as PENDING."""
    from orchestrator.executor import JobStatus

    bases = sorted({j.split("_")[0] for j in job_ids})
    cmd = ["sacct", "-P", "-n", "-X", "-o", SACCT_FIELDS, "-j", ",".join(bases)]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=True).stdout
    except (subprocess.SubprocessError, OSError) as exc:
        log.warning("sacct failed (%s); treating the jobs as still pending", exc)
        return {j: JobStatus(j, "UNKNOWN") for j in job_ids}
    rows = parse_sacct(out)
    result = {}
    for j in job_ids:
        row = rows.get(j)
        if row is None:  # sacct lags sbatch by up to a second
            result[j] = JobStatus(j, "PENDING")
        else:
            none = lambda v: None if v in ("", "Unknown", "None") else v  # noqa: E731
            result[j] = JobStatus(j, row["State"], none(row["Submit"]), none(row["Start"]), none(row["End"]))
    return result
