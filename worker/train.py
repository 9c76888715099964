"""One worker, one round: H inner AdamW steps from a base checkpoint, then publish the result.

Read top to bottom, a round is:
  1. read the run's config and build its task (worker/tasks/): the model, this worker's share of the
     data and its batches (token data prepared once and read in place), the loss;
  2. load the base weights (the global model, or the worker's own last weights if its previous
     contribution missed the merge) and the worker's own AdamW state from its last round;
  3. train H steps. The learning-rate schedule and the batches are functions of the global step
     r*H + i, so the schedule continues across rounds and a restarted worker sees exactly the
     batches it would have seen: that is its data position;
  4. publish its optimizer state, then its weights with a manifest (the commit: worker/publish.py).
A worker that is preempted or hits its time limit saves an in-flight checkpoint (weights,
optimizer, step) and resumes from it when requeued.
What is trained and read is the learner's (worker/learner.py): the whole model, or with
`algorithm: lte` this worker's LoRA heads over a frozen base. A job of several ranks
(worker/ranks.py) trains one model with DDP, each rank on its slice of the batch; rank 0 writes.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import math
import os
import time
from collections.abc import Callable
from typing import Any

import torch

from core import replay, trust
from core.assignment import Assignment, current_job_id
from core.checkpoint import read_manifest
from core.config import Config
from core.errors import IslandsError
from core.failpoints import failpoint, slowpoint
from core.layout import RunLayout
from core.storage import Storage
from worker.learner import Learner
from worker.publish import Publisher
from worker.ranks import join, preemption
from worker.round import RoundInProgress, StopRule, lr_at
from worker.sharded import params_for
from worker.tasks import map_tensors, task_for
from worker.weights import weights_of

log = logging.getLogger(__name__)
L = RunLayout()
HEARTBEAT_S = 5.0
STOP_POLL_S = 0.5  # how often a training worker looks for the run's STOP marker


class Stopped(Exception):
    """The run was stopped (its service interrupted: the STOP marker): this worker saved where it is
    (the round's in-flight checkpoint, or its newest state snapshot) and its job ends."""

# The trainer of the round running in this process, for the preemption handler (see checkpoint()),
# and a persistent worker's trainer kept between rounds (its state may still be being written).
_ACTIVE: "InnerTrainer | None" = None
_RESIDENT: "InnerTrainer | None" = None


def load_run_config(storage: Storage) -> Config:
    """The run's config, through the one checked loader (core.trust: the run and its config.yaml
    writable by no other user), as the service reads it."""
    return trust.load_run_config(storage)


def pick_device(cfg: Config) -> torch.device:
    want = cfg.inner.device
    if want == "cuda" or (want == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise IslandsError("inner.device is cuda but no CUDA device is visible to this job; "
                               "request a GPU (executor.gpus_per_node) or set inner.device: auto")
        return torch.device("cuda")
    return torch.device("cpu")


def _seed(*parts: int) -> int:
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:8], "little") & (2**63 - 1)


class InnerTrainer:
    """One worker's round: its parts built from its assignment and the run directory, and the loop.

    The parts, each owning its fields: `task` the user's task (worker/tasks/: the model, the loss)
    and `sampler` this worker's batches; `learner` the model, its optimizer and what they read
    (worker/learner.py); `round` the round in progress (worker/round.py); `stop` when its training
    stops; `publisher` its writes (worker/publish.py); `preemption` the job's signal, if any."""

    def __init__(self, assignment: Assignment) -> None:
        self.storage = Storage(assignment.run_url)
        self.cfg = cfg = load_run_config(self.storage)
        device = pick_device(cfg)
        self.ranks = join(device.type)  # the job's other ranks (worker/ranks.py), if it has any
        if assignment.threads > 0:  # the job's CPUs, shared by its ranks
            torch.set_num_threads(max(1, assignment.threads // self.ranks.world))
        self.task = task = task_for(cfg)
        self.sampler = task.sampler(assignment.worker, cfg.workers, cfg.worker_batch_size)
        params = params_for(cfg, assignment.worker, self.ranks, device, task)  # whole, LTE's heads, or shards
        self.learner = Learner(cfg, params, device, self.ranks)
        self.publisher = Publisher(self.storage, self.learner, self.sampler.tokens_per_batch)
        self.stop = StopRule(cfg, replay.of_run(self.storage, cfg), self.ranks)
        # a preemption signal is acted on between steps, every rank at the same one (worker/ranks.py)
        self.preemption = preemption(self.ranks)
        self.next_beat = 0.0  # first heartbeat after the first step
        self.stopping, self.next_stop_poll = False, 0.0  # the run's STOP marker, seen by this rank
        self._begin(assignment, own_state=False)

    # the model and optimizer, by their names in a training loop
    model = property(lambda self: self.learner.model)
    opt = property(lambda self: self.learner.opt)
    names = property(lambda self: self.learner.names)
    step_model = property(lambda self: self.learner.step_model)  # or DDP over the model

    def _begin(self, assignment: Assignment, own_state: bool) -> None:
        """Start round assignment.round: base weights in the model, and the optimizer state from
        storage, or (`own_state`) the one in memory, this worker's after its previous round."""
        self._start(assignment)
        self.learner.load(self.storage, self.round, own_state)

    def _start(self, assignment: Assignment) -> None:
        """This trainer's round is now assignment.round, no step of it taken yet."""
        self.round = RoundInProgress.start(assignment, self.cfg)
        torch.manual_seed(_seed(self.cfg.seed, assignment.worker, assignment.round))  # dropout, if any
        self.next_beat = 0.0

    def next_round(self, assignment: Assignment) -> bool:
        """Carry this trainer into `assignment`, this worker's next round, keeping the model and its
        AdamW state where they are (a persistent worker: no state read, no rebuild). False when it cannot
        (LTE, a round skipped, an unfinished round, an in-flight checkpoint to resume): build a new one."""
        rnd, a = self.round, assignment
        # asked on every rank (a collective), before any condition could skip it on some
        inflight = self.ranks.lead_says(read_manifest(self.storage, L.worker_inflight(a.worker, a.round)) is not None)
        if rnd.ahead:  # trained ahead (round.overlap): adopt the base, or start over
            if a.worker != rnd.worker or a.round != rnd.number or inflight:
                rnd.published = None
                return False
            rnd.assignment = a
            self.learner.adopt(self.storage, rnd)
            self._heartbeat()  # no longer ahead
            return True
        if not self.learner.params.carries_over or a.worker != rnd.worker or a.round != rnd.number + 1 \
                or not rnd.finished or inflight:
            return False
        self._begin(a, own_state=True)
        return True

    def can_go_ahead(self) -> bool:
        """round.overlap: may this trainer start its next round before the round's base exists?"""
        params = self.learner.params
        return (self.cfg.round.overlap != "off" and self.round.finished and params.carries_over
                and not params.collective and self.ranks.world == 1
                and (self.stop.replay is None or self.stop.adoption(self.round, ahead=1) is not None))

    def start_ahead(self) -> None:
        """round.overlap: begin this worker's next round from its own weights and AdamW state, keeping
        the weights it just published, which next_round needs to adopt the round's base."""
        published = weights_of(self.model)  # fresh copies: the contribution's buffers are reused
        a = self.round.assignment
        self._start(dataclasses.replace(a, round=a.round + 1))
        self.round.published = published

    def train(self, until: Callable[[], bool] | None = None) -> None:
        """Inner steps until the round's steps or time budget are spent, or (round.overlap, training
        ahead) until `until()` says the round's base has been assigned."""
        rnd, ranks = self.round, self.ranks
        cuda = self.learner.device.type == "cuda"
        autocast = torch.autocast("cuda", dtype=torch.bfloat16) if cuda else contextlib.nullcontext()
        self.step_model.train()
        failpoint_name, slow_name = f"rank_{ranks.rank}.step", f"worker_{rnd.worker:03d}.step"
        self.publisher.before_training()  # before the clock: a snapshot still being written is not training
        rnd.started, pending, stopped = time.monotonic() - rnd.trained_s, [], False
        if self.preemption is not None:
            self.preemption.deferred = True
        while not self.stop.spent(rnd):
            if until is not None and until():
                stopped = True
                break
            pending.append(self._step(rnd.step0 + rnd.done, autocast))  # no .item() per step: on a GPU that would sync
            failpoint(failpoint_name)  # fault injection only: a rank that dies mid-round
            slowpoint(slow_name)  # fault injection only: a slow node
            rnd.done += 1
            beat = time.monotonic() >= self.next_beat
            # the losses are averaged over ranks at the same steps on every rank; one rank alone
            # also whenever a heartbeat is due, so that it shows the current loss
            if len(pending) >= 50 or rnd.done == 1 or (beat and ranks.world == 1):
                self._flush(pending)
            if beat:
                self._heartbeat()
            if self._asked_to_stop():
                self._flush(pending)
                self._stop_here()
        if self.preemption is not None:
            self.preemption.deferred = False
        rnd.trained_s, rnd.started, rnd.finished = rnd.training_s(), None, not stopped
        self._flush(pending)
        self._heartbeat()
        self._check_losses()

    def _step(self, step: int, autocast: contextlib.AbstractContextManager) -> torch.Tensor:
        """One inner AdamW step at global step `step`; its loss, not synced."""
        cfg, opt = self.cfg, self.opt
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg) * group.get("lr_scale", 1.0)  # lte: heads peak at lte.lr
        # the worker's batch, this rank's rows of it: DDP's averaged gradient is the whole batch's
        device = self.learner.device
        batch = map_tensors(self.sampler.batch(step), lambda t: self.ranks.slice(t).to(device, non_blocking=True))
        with autocast:
            loss = self.task.loss(self.step_model, batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if cfg.inner.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.step_model.parameters(), cfg.inner.grad_clip)
        opt.step()
        return loss.detach()

    def _check_losses(self) -> None:
        losses, a = self.round.losses, self.round.assignment
        if not all(math.isfinite(v) for v in losses[-5:]):
            job = current_job_id() or "?"
            raise IslandsError(f"task {self.cfg.task}, worker {a.worker} round {a.round} (job {job}): the loss "
                               f"became non-finite ({losses[-5:]}); lower inner.lr or raise inner.warmup_steps, "
                               "or check the task's loss")

    def publish(self, seconds: float, state_later: bool = False) -> dict[str, Any] | None:
        """The round's contribution, and its optimizer state (worker/publish.py)."""
        return self.publisher.publish(self.round, seconds, state_later)

    def checkpoint(self) -> None:
        """Preempted (submitit's handler, rank 0): the round's in-flight checkpoint (worker/publish.py)."""
        self.publisher.checkpoint(self.round)

    def settle(self) -> None:
        """Wait for the optimizer state being written in the background, if any."""
        self.publisher.snapshots.settle()

    def flush_state(self, handler: bool = False) -> None:
        """Write the newest optimizer-state snapshot if it is in memory only (worker/publish.py)."""
        self.publisher.snapshots.flush(handler)

    def _asked_to_stop(self) -> bool:
        """After a step, every rank: was the job preempted (Slurm's signal) or the run stopped (the
        STOP marker, looked for by rank 0 every STOP_POLL_S)? One small all-reduce when the job has
        ranks."""
        now = time.monotonic()
        if self.ranks.lead and now >= self.next_stop_poll:
            self.next_stop_poll = now + STOP_POLL_S
            self.stopping = self.stopping or self.storage.exists(L.STOP) or self.storage.exists(L.CANCEL)
        signalled = self.preemption is not None and self.preemption.signalled
        return self.ranks.any(signalled or self.stopping)

    def _stop_here(self) -> None:
        """Between two steps, every rank here: save the in-flight checkpoint (rank 0 writes; sharded,
        every rank gathers), then end: Stopped when the run was stopped (`resume` goes on from
        this step), else hand the signal to submitit, which requeues the job. Training ahead of a
        round's base (round.overlap) saves none: those steps are lost, by design."""
        self.settle()  # the last round's state file, being written, reaches storage first
        if not self.round.ahead and (self.ranks.lead or self.learner.params.collective):
            self.publisher.save_inflight(self.round)
        if self.ranks.any(self.stopping):
            rnd = self.round
            raise Stopped(f"worker {rnd.worker}: the run was stopped; " + (
                f"its {rnd.done} step(s) ahead of round {rnd.number}'s base are dropped" if rnd.ahead else
                f"round {rnd.number} is saved at step {rnd.done}"))
        assert self.preemption is not None
        self.preemption.hand_over()

    def _heartbeat(self) -> None:
        """Say how far this round is, every few seconds: cheap, and what `status` shows (rank 0)."""
        rnd = self.round
        self.next_beat = time.monotonic() + HEARTBEAT_S
        if not self.ranks.lead:
            return
        self.storage.write_json(L.worker_progress(rnd.worker), {
            "round": rnd.number, "step": rnd.done, "steps": self.cfg.inner.steps, "attempt": rnd.assignment.attempt,
            "loss": rnd.losses[-1] if rnd.losses else None, "at": time.time(),
            "ahead": rnd.ahead})  # round.overlap: training before the round's base exists

    def _flush(self, pending: list[torch.Tensor]) -> None:
        if pending:
            self.round.losses.extend(self.ranks.mean(torch.stack(pending).float()).cpu().tolist())
            pending.clear()


def _where(device: torch.device) -> str:
    """The device in a log line: a GPU by its name (CUDA_VISIBLE_DEVICES renumbers them)."""
    if device.type != "cuda":
        return device.type
    return f"{torch.cuda.get_device_name(device)} (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')})"


def run_worker(assignment: Assignment) -> dict[str, Any]:
    """Entry point of a per-round worker job. Returns a small summary (the real output is in storage)."""
    try:
        return serve_round(assignment)[0]
    except Stopped as exc:
        log.info("%s", exc)
        return {"round": assignment.round, "worker": assignment.worker, "stopped": True}


def serve_round(assignment: Assignment, waited_s: float | None = None, carry: InnerTrainer | None = None,
                persistent: bool = False) -> tuple[dict[str, Any], InnerTrainer]:
    """Train and publish one round; returns the summary and the trainer.

    A persistent worker passes `persistent` and, from its second round on, `carry`: the trainer of
    its previous round, whose model and AdamW state are reused when they can be
    (InnerTrainer.next_round); its state is written after its contribution, in the background.
    `waited_s`: how long it sat idle waiting for this round (recorded in the manifest)."""
    global _ACTIVE, _RESIDENT
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    t0 = time.perf_counter()
    if carry is not None and not carry.next_round(assignment):
        carry.flush_state()  # the new trainer reads the state from storage: the newest must be there first
        carry = _RESIDENT = None
    trainer = carry or InnerTrainer(assignment)
    rnd = trainer.round
    rnd.waited_s = waited_s
    _ACTIVE = trainer
    try:
        trainer.train()
        slowpoint(f"worker_{rnd.worker:03d}.publish")  # fault injection only (bench/chaos.py): a straggler
        manifest = trainer.publish(time.perf_counter() - t0 + rnd.ahead_s, state_later=persistent)
    finally:
        _ACTIVE = None
    _RESIDENT = trainer if persistent else None
    log.info("worker %d round %d on %s: %d steps, loss %.4f -> %.4f, %.1fs", rnd.worker, rnd.number,
             _where(trainer.learner.device), rnd.done, rnd.losses[0], rnd.losses[-1], time.perf_counter() - t0)
    summary = {"round": rnd.number, "worker": rnd.worker, "digest": manifest and manifest["digest"],
               "loss_last": rnd.losses[-1], "rank": trainer.ranks.rank}
    return summary, trainer


def checkpoint_active() -> bool:
    """Save the running round's in-flight checkpoint, if a round is running in this process; and
    let a persistent worker's background state write finish, if one is under way."""
    if _ACTIVE is None:
        if _RESIDENT is not None:
            _RESIDENT.flush_state(handler=True)  # preempted between rounds: the requeued job takes the newest state
        return False
    _ACTIVE.checkpoint()
    return True
