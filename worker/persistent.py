"""A persistent worker: one job that serves round after round, paying the queue wait once.

After publishing its contribution to round r, the job waits on storage until the merge service
assigns it round r+1 (an entry for this worker in rounds/r+1/jobs.json naming this job), then trains
from the base it is given. Its model and AdamW state stay in memory (on the GPU) between rounds:
a round reads only its base weights and writes its contribution on the critical path; every
round.state_every rounds the state file is written from a snapshot in the background after the
contribution, while the merge runs (worker.train.serve_round), and when the job ends before the run
does or is preempted between rounds (flush_state). A job restarted after a hard loss takes the
newest snapshot on storage, and says which round it came from. It stops when the
run is over, cancelled or failed, or when the service has handed the worker to another job. At its time limit Slurm signals it; the job saves an
in-flight checkpoint if it is training and is requeued to carry on at the round it was serving.

With round.overlap it does not idle after publishing: it trains round r+1's steps from its own
weights meanwhile (train_ahead) and adopts the round's base when it is assigned
(worker/overlap.py). A preemption while it trains ahead loses those steps (a round without its
base has no in-flight checkpoint): the requeued job starts round r+1 from its base.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

from core.errors import RunError, StorageError
from core.layout import RunLayout
from core.records import JobEntry, RoundJobs
from core.storage import Storage
from core.assignment import Assignment, current_job_id
from worker.ranks import join
from worker.train import InnerTrainer, Stopped, load_run_config, pick_device, serve_round

log = logging.getLogger(__name__)
L = RunLayout()
WAIT_POLL_S = 0.2
_CURRENT_ROUND: int | None = None  # the round this process serves or waits for (for requeue)


def current_round() -> int | None:
    return _CURRENT_ROUND


def wait_for_assignment(storage: Storage, r: int, worker: int, job_id: str | None) -> JobEntry | None:
    """This worker's entry in round r's jobs.json once it names this job; None when we should stop."""
    last_log, refused = time.monotonic(), None
    while True:
        if storage.exists(L.CANCEL) or storage.exists(L.FAILED) or storage.exists(L.STOP):
            log.info("worker %d: the run was stopped, cancelled or failed; stopping (its newest state is written)",
                     worker)
            return None
        entry, why = _entry(storage, r, worker)
        if why is not None and why != refused:  # said once per damage: the service rewrites the file it owns
            log.warning("worker %d: %s; waiting on as if round %d were not assigned yet", worker, why, r)
        refused = why
        if entry is not None:
            if job_id is not None and entry.latest != job_id:
                log.info("worker %d: round %d went to job %s, not this job (%s); stopping", worker, r, entry.latest, job_id)
                return None
            return entry
        if time.monotonic() - last_log > 60:
            log.info("worker %d: waiting for round %d to be assigned", worker, r)
            last_log = time.monotonic()
        time.sleep(WAIT_POLL_S)


def _entry(storage: Storage, r: int, worker: int) -> tuple[JobEntry | None, str | None]:
    """(this worker's entry in round r's jobs file, None) through its checked loader; (None, why)
    when the file is damaged or planted."""
    try:
        return RoundJobs.load(storage, r).workers.get(worker), None
    except (RunError, StorageError) as exc:
        return None, str(exc)


def train_ahead(trainer: InnerTrainer, storage: Storage, r: int, worker: int) -> None:
    """round.overlap: round r's steps from the worker's own weights until round r is assigned to
    this worker (or the run ends); the rest of the round, once its base is adopted, is serve_round's."""
    next_poll = 0.0
    trainer.start_ahead()
    replay_at = trainer.stop.adoption(trainer.round)  # a replay adopts at the source run's step, whenever the base comes

    def assigned() -> bool:  # polled between steps, at most every WAIT_POLL_S
        nonlocal next_poll
        if replay_at is not None:
            return trainer.round.done >= replay_at
        if time.monotonic() < next_poll:
            return False
        next_poll = time.monotonic() + WAIT_POLL_S
        return any(storage.exists(k) for k in (L.CANCEL, L.FAILED, L.STOP)) or _entry(storage, r, worker)[0] is not None

    trainer.train(until=assigned)
    log.info("worker %d: %d step(s) of round %d taken before its base was assigned", worker, trainer.round.done, r)


def run_persistent(assignment: Assignment) -> dict[str, Any]:
    """Serve rounds assignment.round, assignment.round+1, ... until the run ends. Returns a summary."""
    global _CURRENT_ROUND
    storage = Storage(assignment.run_url)
    cfg = load_run_config(storage)
    job_id = current_job_id()
    ranks = join(pick_device(cfg).type)  # a multi-rank job: every rank waits, then takes rank 0's word
    served = []
    trainer: InnerTrainer | None = None  # kept between rounds: model and AdamW state stay on the device
    r = assignment.round
    try:
        while r < cfg.rounds:
            _CURRENT_ROUND = r
            t_wait = time.monotonic()
            entry = wait_for_assignment(storage, r, assignment.worker, job_id)
            # closed: round r was merged while this job was requeued
            entry, closed = ranks.lead_says((entry, entry is not None and storage.exists(L.round_record(r))))
            if entry is None:
                break
            if closed:
                r += 1
                continue
            sub = dataclasses.replace(assignment, round=r, base_key=entry.base, attempt=entry.attempts - 1)
            try:
                summary, trainer = serve_round(sub, round(time.monotonic() - t_wait, 3), trainer, persistent=True)
            except Stopped as exc:  # the round's in-flight checkpoint is saved; the state snapshot below
                log.info("%s", exc)
                break
            served.append(summary)
            r += 1
            if r < cfg.rounds and trainer.can_go_ahead():
                _CURRENT_ROUND = r  # a requeue now goes on at round r, not the round just published
                try:
                    train_ahead(trainer, storage, r, assignment.worker)
                except Stopped as exc:  # its steps ahead of the base are dropped; the snapshot below
                    log.info("%s", exc)
                    break
    finally:
        if trainer is not None:  # the newest optimizer state reaches storage before the job ends
            trainer.flush_state() if r < cfg.rounds else trainer.settle()
    _CURRENT_ROUND = None
    return {"worker": assignment.worker, "rounds": [s["round"] for s in served]}
