"""A run's state in storage as the commands read it: its config, what arrived, its status.
Light on purpose (no torch): `status` and `cancel` use it; the models are orchestrator/run_models.py."""
from __future__ import annotations

import dataclasses
import datetime as dt
from pathlib import Path
from collections.abc import Mapping
from typing import Any


from core import trust
from core.config import Config
from core.errors import IslandsError, RunError
from core.layout import RunLayout, manifest_key
from core.storage import Storage
from orchestrator.lease import driven
from core.records import LIMIT, RUN_INFO, Failure, RoundJobs, RoundRecord, RunInfo, number, text, utilization

L = RunLayout()
HEARTBEAT_LIMIT = 4096


def default_run_dir(cfg: Config) -> str:
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    return str((Path("runs") / f"{cfg.algorithm}-{stamp}").resolve())


def load_run(storage: Storage) -> Config:
    return trust.read_run_config(storage)


def arrived_workers(storage: Storage, r: int) -> list[int]:
    """Workers with a published contribution to round r: data and manifest both listed.

    One listing per poll, whatever K is; manifests are published atomically, so a listed one is whole.
    """
    names = set(storage.list(L.contributions_dir(r)))
    found = (L.parse_contribution(n) for n in names)
    return sorted(w for w in found if w is not None
                  and manifest_key(L.contribution(r, w)).rsplit("/", 1)[-1] in names)


def _by_worker(v: Mapping[str, Any], value: Any = lambda x: x) -> dict[str, Any]:
    """A map keyed by worker (or metric), keys fit for a terminal; entries `value` makes None dropped."""
    return {str(text(k, 16)): got for k, x in v.items() if (got := value(x)) is not None}


def _job(v: Any) -> dict[str, Any] | None:
    if not isinstance(v, dict):
        return None
    out = {k: number(v.get(k)) for k in ("queue_wait_s", "run_s", "attempts") if number(v.get(k)) is not None}
    return {**out, **{k: text(v.get(k), 200) for k in ("job_id", "state") if text(v.get(k), 200) is not None}}


def round_line(r: int, rec: Mapping[str, Any]) -> dict[str, Any]:
    """A round record as status shows it. `rec` is one RoundRecord.load checked (every field of its
    type), or {} for a damaged one, whose fields then show as absent; no string in it reaches a
    terminal raw (the jobs' entries, free-form, are checked here)."""
    line: dict[str, Any] = {"round": r, **{k: list(rec.get(k, [])) for k in ("merged", "dropped", "rejected")}}
    line.update({k: rec.get(k) for k in ("eval_loss", "merge_seconds", "bytes_read", "outer_grad_norm", "fp32_bytes")})
    line.update({k: _by_worker(rec.get(k, {})) for k in ("contribution_bytes", "worker_read", "worker_written")})
    line["replayed"] = list(rec.get("replayed", []))
    line.update({k: _by_worker(rec.get(k, {}), text) for k in ("dropped_reasons", "rejected_reasons", "worker_state")})
    line.update({k: _by_worker(rec.get(k, {})) for k in ("worker_train_s", "worker_idle_s", "eval_metrics")})
    line["jobs"] = _by_worker(rec.get("jobs", {}), _job)
    line["utilization"] = utilization([{"worker_train_s": line["worker_train_s"], "worker_idle_s": line["worker_idle_s"]}])
    ends = (rec.get("submitted_at"), rec.get("committed_at"))
    line["wall_s"] = round(ends[1] - ends[0], 1) if None not in ends else None
    line["round_s"] = rec.get("round_s")
    return line


def _failure(storage: Storage) -> dict[str, Any] | None:
    """failed.json as status shows it: its reason fit for a terminal; a damaged one said to be so."""
    try:
        failed = Failure.load(storage)
    except RunError:
        return {"round": None, "reason": "failed.json is not a record islands wrote (damaged or planted)", "at": None}
    return None if failed is None else {**dataclasses.asdict(failed), "reason": text(failed.reason)}


def run_status(storage: Storage, cfg: Config | None = None) -> dict[str, Any]:
    """What `orchestrate status --json` prints; read from storage alone (`cfg`: the run's, if read already)."""
    cfg = cfg or load_run(storage)
    rounds = []
    r = 0
    while True:
        try:
            rec = RoundRecord.load(storage, r)
        except RunError as exc:  # committed (the file is there) but not as the service wrote it
            rounds.append({**round_line(r, {}), "damaged": text(str(exc))})
            r += 1
            continue
        if rec is None:
            break
        rounds.append(round_line(r, rec.to_json()))
        r += 1
    failed = _failure(storage)
    try:
        info = dataclasses.asdict(RunInfo.load(storage))
    except RunError:  # damaged: its figures shown as absent, as a damaged round's
        info = dataclasses.asdict(RunInfo())
    # every round committed is not the end: the last one is evaluated and the final model exported after;
    # a run no merge service holds (Ctrl-C, a killed service) is stopped, whatever it was doing, unless
    # its service never started yet (`submit --detach`: its Slurm job may queue)
    live = driven(storage)
    if r >= cfg.rounds:
        state = "done" if _finished(storage, info) else "finishing" if live else "stopped"
    elif failed or storage.exists(L.CANCEL):
        state = "failed" if failed else "cancelled"
    else:
        state = "running" if live else "starting" if r == 0 and not storage.exists(L.round_jobs(0)) else "stopped"
    current = RoundJobs.load(storage, r) if r < cfg.rounds else None
    return {
        "run_dir": storage.display(), "state": state, "algorithm": cfg.algorithm, "workers": cfg.workers,
        "rounds_total": cfg.rounds, "rounds_done": r, "initial_eval_loss": info.get("initial_eval_loss"),
        "loss": cfg.loss_label,
        "rounds": rounds, "failure": failed, "utilization": utilization(rounds),
        "current_round": None if current is None else {
            "round": r, "workers": {str(w): {"job_id": text(str(e.latest), 64), "attempts": e.attempts,
                                             "progress": read_heartbeat(storage, w)}
                                    for w, e in current.workers.items()},
            "arrived": arrived_workers(storage, r)},
        "stored_bytes": stored_bytes(storage),
        "final_model": storage.display(L.FINAL) if storage.exists(L.FINAL) else None,
        "final_hf": storage.display(L.FINAL_HF) if storage.exists(L.final_hf_file("config.json")) else None,
    }


def stored_bytes(storage: Storage) -> int | None:
    """The run directory's size (its jobs/ folder of scripts and logs left out), from one listing;
    None when the storage cannot say."""
    try:
        found = storage.find("")
    except OSError:
        return None
    return sum(int(v.get("size") or 0) for k, v in found.items() if v.get("type") == "file" and not k.startswith(L.JOBS + "/"))


def _finished(storage: Storage, info: dict[str, Any]) -> bool:
    """Whether the service finished the run (run.json's finished_at); a run finished by an islands
    that did not record it (no such field at all) is finished once it has its final model."""
    if info["finished_at"] is not None:
        return True
    try:
        recorded = "finished_at" in (storage.read_json(RUN_INFO, limit=LIMIT) or {})
    except (IslandsError, OSError, ValueError):  # damaged: RunInfo.load said so already
        recorded = True
    return not recorded and storage.exists(L.FINAL)


def read_heartbeat(storage: Storage, worker: int) -> dict[str, Any] | None:
    """A worker's heartbeat (round, step, steps, loss), or None when absent or not one: workers
    write it, so it is read as untrusted (a planted or torn file shows as no heartbeat)."""
    try:
        raw = storage.read_json(L.worker_progress(worker), limit=HEARTBEAT_LIMIT)
    except (IslandsError, OSError):  # absent, not JSON, over the limit, unreadable
        return None
    ints = ("round", "step", "steps")
    if not isinstance(raw, dict) or not all(type(raw.get(k)) is int for k in ints):
        return None
    loss = raw.get("loss")
    loss = float(loss) if isinstance(loss, (int, float)) and not isinstance(loss, bool) else None
    return {**{k: raw[k] for k in ints}, "loss": loss}
