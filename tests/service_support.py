"""The real merge service against a scripted scheduler: its "jobs" are threads that write hand-made
contributions (global + a constant delta per worker), so every expected global is worked out by
hand. Shared by the tests of stragglers (test_late), dubious contributions (test_contributions),
planted and forged files (test_hostile, test_forged_values) and the streamed merge (test_stream_merge).
The scheduler is the one part faked: the service, its merge engine and storage run for real."""
from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from core.checkpoint import load_checkpoint, read_manifest
from core.checkpoint_writer import write_checkpoint
from core.config import load_config
from core.layout import RunLayout
from core.storage import Storage
from orchestrator.jobstatus import JobStatus
from orchestrator.lease import acquire
from orchestrator.loop import Service

L = RunLayout()
G0 = {"w": torch.tensor([1.0, 2.0, 3.0]), "b": torch.tensor([0.5])}
DELTA = {0: -0.25, 1: -0.5, 2: -1.0}  # worker 2 is the straggler
DELAY = {0: 0.3, 1: 0.3, 2: 3.0}  # 10x slower
WORK = {"steps": 25, "tokens": 25 * 16 * 128}
"""What a worker of the default config reports: inner.steps x inner.batch_size x model.block_size
tokens (the service derives a contribution's weight from the same figures: orchestrator.plan)."""


class ThreadExecutor:
    """Jobs are threads that sleep, then publish base + DELTA[worker]; cancel stops one before it writes."""

    kind, folder, here = "fake", "(threads)", False

    def __init__(self) -> None:
        self.jobs: dict[str, threading.Thread] = {}
        self.cancelled: set[str] = set()
        self.submitted: list[tuple[int, int, str]] = []  # (round, worker, base)

    def submit(self, tasks) -> list[str]:
        ids = []
        for t in tasks:
            job_id = str(len(self.jobs))
            self.submitted.append((t.round, t.worker, t.base_key))
            th = threading.Thread(target=self._work, args=(job_id, t), daemon=True)
            self.jobs[job_id] = th
            th.start()
            ids.append(job_id)
        return ids

    def _work(self, job_id: str, t) -> None:
        deadline = time.monotonic() + DELAY[t.worker]
        while time.monotonic() < deadline:
            if job_id in self.cancelled:
                return
            time.sleep(0.02)
        s = Storage(t.run_url)
        base, _, _ = load_checkpoint(s, t.base_key)
        write_checkpoint(s, L.contribution(t.round, t.worker), {k: v + DELTA[t.worker] for k, v in base.items()},
                         manifest={"round": t.round, "worker": t.worker, "steps": 25, "tokens": 25 * 16 * 128,
                                   "base_digest": read_manifest(s, t.base_key)["digest"]})

    def status(self, ids):
        return {j: JobStatus(j, "RUNNING" if self.jobs[j].is_alive() else "COMPLETED") for j in ids}

    def watch(self, ids, news):
        return self.status(ids)

    def cancel(self, ids) -> None:
        self.cancelled.update(ids)

    def stderr_tail(self, job_id: str) -> str:
        return ""

    def cancelled_here(self, job_id: str) -> bool:
        return job_id in self.cancelled


class Scripted(ThreadExecutor):
    """Worker `w`'s jobs run `behaviour[w](storage, task)` instead of publishing base + delta."""

    def __init__(self, behaviour: Mapping[int, Callable[[Storage, Any], None]]) -> None:
        super().__init__()
        self.behaviour = behaviour

    def _work(self, job_id, t) -> None:
        time.sleep(0.2)
        s = Storage(t.run_url)
        if t.worker in self.behaviour:
            self.behaviour[t.worker](s, t)
        else:
            publish(s, t.round, t.worker, t.base_key, -0.5)


def publish(s: Storage, r: int, w: int, base_key: str, delta: float, **manifest) -> None:
    base = load_checkpoint(s, base_key)[0]
    write_checkpoint(s, L.contribution(r, w), {k: v + delta for k, v in base.items()},
                     manifest={"round": r, "worker": w, **WORK,
                               "base_digest": read_manifest(s, base_key)["digest"], **manifest})


def run_service(s: Storage, cfg, ex) -> Service:
    """The real merge service on `s` (holding its lease) with `ex` for a scheduler, run to the end;
    evaluation is skipped: the tests' models are hand-made tensors."""
    lease = acquire(s)
    try:
        service = Service(lease, cfg, ex)
        service.evaluator.metrics = lambda storage, key: {"loss": 0.0}
        service.run()
    finally:
        lease.release()
    return service


def scripted_run(tmp_path: Path, ex: ThreadExecutor, sets: list[str], workers: int = 2, rounds: int = 1,
                 g0: Mapping[str, torch.Tensor] = G0) -> Storage:
    """A run at tmp_path/run of `workers` x `rounds` (local executor, `--set` items `sets`) from the
    global `g0`, driven to its end by the real service with `ex` for a scheduler; every job's
    thread joined."""
    s = Storage(str(tmp_path / "run"))
    cfg = load_config(None, {"workers": workers, "rounds": rounds, "executor.kind": "local", "run_dir": s.url}, sets)
    write_checkpoint(s, L.global_weights(0), dict(g0), manifest={"round": 0})
    run_service(s, cfg, ex)
    for th in ex.jobs.values():
        th.join(timeout=10)
    return s
