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
What is trained, loaded and published is asked of `self.params` (worker/params.py): the whole
model, or with `algorithm: lte` this worker's LoRA heads over a frozen base. A job of several ranks
(worker/ranks.py) trains one model with DDP, each rank on its slice of the batch; rank 0 writes.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import math
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from core import codec, replay, trust
from core.checkpoint import read_manifest
from core.config import Config
from core.errors import CheckpointError, IslandsError
from core.failpoints import failpoint, slowpoint
from core.layout import RunLayout
from core.storage import Storage
from core.task import WorkerTask
from worker.params import SEP, take_feedback
from worker.sharded import params_for
from worker.state import inflight_tensors, usable_state
from worker.publish import Publisher
from worker.ranks import data_parallel, join, preemption
from worker.tasks import map_tensors, task_for
from worker import overlap
from worker.weights import HostBuffers, load_weights, weights_of

log = logging.getLogger(__name__)
L = RunLayout()
HEARTBEAT_S = 5.0

# The trainer of the round running in this process, for the preemption handler (see checkpoint()),
# and a persistent worker's trainer kept between rounds (its state may still be being written).
_ACTIVE: "InnerTrainer | None" = None
_RESIDENT: "InnerTrainer | None" = None


def load_run_config(storage: Storage) -> Config:
    """The run's config, through the one checked loader (core.trust: the run and its config.yaml
    writable by no other user), as the service reads it."""
    return trust.load_run_config(storage)


def lr_at(step: int, cfg: Config) -> float:
    """Linear warm-up, then cosine decay to lr * min_lr_ratio at the worker's last step (T x H)."""
    inner = cfg.inner
    if step < inner.warmup_steps:
        return inner.lr * (step + 1) / inner.warmup_steps
    span = max(1, cfg.total_inner_steps - inner.warmup_steps)
    progress = min(1.0, (step - inner.warmup_steps) / span)
    floor = inner.lr * inner.min_lr_ratio
    return floor + 0.5 * (1.0 + math.cos(math.pi * progress)) * (inner.lr - floor)


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


class InnerTrainer(Publisher):
    """Everything one (round, worker) needs, built from the task and the run directory."""

    def __init__(self, task: WorkerTask) -> None:
        self.task = task
        self.storage = Storage(task.run_url)
        self.cfg = cfg = load_run_config(self.storage)
        self.device = pick_device(cfg)
        self.ranks = join(self.device.type)  # the job's other ranks (worker/ranks.py), if it has any
        if task.threads > 0:  # the job's CPUs, shared by its ranks
            torch.set_num_threads(max(1, task.threads // self.ranks.world))
        # what is trained and on what (worker/tasks/): the model, this worker's batches, the loss
        self.runner = runner = task_for(cfg)
        self.sampler = runner.sampler(task.worker, cfg.workers, cfg.worker_batch_size)
        # Every weight is overwritten by the round's base (_load_base), so the model is built straight
        # on its device and a Hugging Face model's own weights are not read: at 1B parameters a CPU
        # init alone costs seconds per round.
        self.params = params = params_for(cfg, task.worker, self.ranks, self.device, runner)  # whole, LTE's heads, or shards
        self.model = params.build(self.device)
        self.opt, self.names = params.optimizer(self.model)
        # what a training step calls: the model, or DDP over it (a sharded model syncs itself)
        self.step_model = self.model if params.collective else data_parallel(self.model, self.ranks)
        # a preemption signal is acted on between steps, every rank at the same one (worker/ranks.py)
        self.preemption = preemption(self.ranks)
        self._state_write: threading.Thread | None = None  # last round's optimizer state, being written
        # (state, round, worker) of the newest snapshot, when it is in memory only (round.state_every)
        self._unsaved: tuple[dict[str, torch.Tensor], int, int] | None = None
        # Reused every round (pinned on a GPU): base weights in, weights and optimizer state out. A
        # contribution of plain weights reuses the base's buffers, read back into the model before
        # training; a delta needs the base until it is coded. Host memory: 3-4x the fp32 weights.
        self._host_base, self._host_state = HostBuffers(self.device), HostBuffers(self.device)
        self._host_out = self._host_base if cfg.round.contribution == "weights" else HostBuffers(self.device)
        # a replay (round.replay): the steps and adoption steps its source run recorded
        self.schedule = replay.of_run(self.storage, cfg)
        # round.codec topk: what this worker's contributions left out, sent with its next ones
        self.feedback: codec.Feedback | None = None
        self.uses_feedback = codec.uses_feedback(cfg.round)
        self._begin(task, own_state=False)

    def _begin(self, task: WorkerTask, own_state: bool) -> None:
        """Set up round task.round: base weights in the model, and the optimizer state from storage,
        or (`own_state`) the one in memory, which is this worker's state after its previous round."""
        self._reset(task)
        self.base_sha = self._load_base(own_state)

    def _reset(self, task: WorkerTask) -> None:
        """This trainer's round is now task.round, no step of it taken yet."""
        self.task = task
        torch.manual_seed(_seed(self.cfg.seed, task.worker, task.round))  # dropout, if any
        self.step0 = task.round * self.cfg.inner.steps  # the global step this round starts at
        self.done = 0  # inner steps done in this round
        self.finished = False  # its steps, or its time budget, are spent
        self.trained_s = 0.0  # seconds of training this round (round.budget: seconds spends them)
        self._t_start: float | None = None
        self.losses: list[float] = []
        self._next_beat = 0.0  # first heartbeat after the first step
        self.waited_s: float | None = None  # a persistent worker's idle wait before this round
        self.resumed_at: int | None = None  # step of the in-flight checkpoint this job resumed from
        self._base: dict[str, torch.Tensor] | None = None  # the base weights, kept to code a delta from
        self._published: dict[str, torch.Tensor] | None = None  # round.overlap: the last contribution's weights
        self.adopted_at: int | None = None  # round.overlap: the step at which this round's base was adopted
        self.ahead_s = 0.0  # round.overlap: seconds trained on this round before its base existed
        self.inflight_at: int | None = None  # the step of the in-flight checkpoint saved by this job
        self.state_from: int | None = None  # the round of the state snapshot this round started from (read)

    def next_round(self, task: WorkerTask) -> bool:
        """Carry this trainer into `task`, this worker's next round, keeping the model and its AdamW
        state where they are (a persistent worker: no state read, no rebuild). False when it cannot
        (LTE, a round skipped, an unfinished round, an in-flight checkpoint to resume): build a new one."""
        t = self.task
        # asked on every rank (a collective), before any condition could skip it on some
        inflight = self.ranks.lead_says(read_manifest(self.storage, L.worker_inflight(task.worker, task.round)) is not None)
        if self._published is not None:  # trained ahead (round.overlap): adopt the base, or start over
            if task.worker != t.worker or task.round != t.round or inflight:
                self._published = None
                return False
            self._adopt(task)
            return True
        if not self.params.carries_over or task.worker != t.worker or task.round != t.round + 1 \
                or not self.finished or inflight:
            return False
        self._begin(task, own_state=True)
        return True

    def can_go_ahead(self) -> bool:
        """round.overlap: may this trainer start its next round before the round's base exists?"""
        return (self.cfg.round.overlap != "off" and self.finished and self.params.carries_over
                and not self.params.collective and self.ranks.world == 1
                and (self.schedule is None or self.replay_adoption(ahead=1) is not None))

    def replay_adoption(self, ahead: int = 0) -> int | None:
        """A replay: the step at which the source run's worker adopted its base in round task.round +
        `ahead`; None when it trained that round from its base, or when this run is no replay."""
        return None if self.schedule is None else self.schedule.adopted_at.get((self.task.round + ahead, self.task.worker))

    def start_ahead(self) -> None:
        """round.overlap: begin this worker's next round from its own weights and AdamW state, keeping
        the weights it just published, which next_round needs to adopt the round's base."""
        published = weights_of(self.model)  # fresh copies: the contribution's buffers are reused
        self._reset(dataclasses.replace(self.task, round=self.task.round + 1))
        self._published = published

    def _adopt(self, task: WorkerTask) -> None:
        """The trainer ran ahead on task.round; take its base now (worker/overlap.py)."""
        rc = self.cfg.round
        base_manifest = read_manifest(self.storage, task.base_key)
        if base_manifest is None:
            raise CheckpointError(f"worker {task.worker} round {task.round}: base checkpoint "
                                  f"{self.storage.display(task.base_key)} is not published")
        label = f"base weights for worker {task.worker}"
        base = codec.load_weights(self.storage, task.base_key, label, alloc=self._host_base)
        assert self._published is not None
        load_weights(self.model, overlap.adopt(weights_of(self.model), self._published, base, rc.overlap, rc.overlap_mix),
                     f"{label}, adopted at step {self.done}")
        self.task, self.base_sha, self.adopted_at, self._published = task, base_manifest["digest"], self.done, None
        self.ahead_s = self.trained_s  # trained before the base existed: part of this round's busy time
        self._base = base if rc.contribution == "delta" else None
        log.info("worker %d round %d: adopted its base at step %d (%s)", task.worker, task.round, self.done, rc.overlap)
        self._heartbeat()  # no longer ahead

    def _load_base(self, own_state: bool = False) -> str:
        """Load base weights + own optimizer state, or the in-flight checkpoint of a requeued job."""
        t, params = self.task, self.params
        base_manifest = read_manifest(self.storage, t.base_key)
        if base_manifest is None:
            raise CheckpointError(f"worker {t.worker} round {t.round}: base checkpoint {self.storage.display(t.base_key)} "
                                  "is not published; the orchestrator submitted the round too early or it was deleted")
        inflight, bound = L.worker_inflight(t.worker, t.round), codec.max_update(self.cfg)
        label = f"worker {t.worker} in-flight checkpoint {self.storage.display(inflight)}"
        # every rank reads what it holds (sharded: its rows; else all of it), the ranks agreeing on one verdict
        reader = params.reader(self.ranks)
        tensors = inflight_tensors(self.storage, inflight, label, base_manifest["digest"], self.cfg.inner.steps, bound,
                                   reader)
        resuming = tensors is not None
        base = params.load_base(self.storage, t.base_key, self.model, resuming, alloc=self._host_base)
        self._base = base if self.cfg.round.contribution == "delta" else None
        if resuming:
            m = read_manifest(self.storage, inflight) or {}
            self._take_feedback(tensors)
            params.load_trained(self.model, {k: v for k, v in tensors.items() if SEP not in k}, "in-flight checkpoint")
            params.load_optimizer(self.model, self.opt, self.names, {k: v for k, v in tensors.items() if SEP in k},
                                  "in-flight checkpoint")
            self.done, self.losses = int(m["steps_done"]), list(m.get("losses", []))
            self.trained_s = float(m.get("trained_s") or 0.0)  # a time budget goes on where it was
            # round.overlap: the round began ahead of its base
            self.adopted_at, self.ahead_s = m.get("adopted_at_step"), float(m.get("ahead_s") or 0.0)
            self.resumed_at = self.done
            log.info("worker %d round %d: resuming in-flight at step %d/%d", t.worker, t.round, self.done, self.cfg.inner.steps)
            return base_manifest["digest"]
        # every rank reads and checks its part (a damaged snapshot is set aside by rank 0), as above
        found = None if own_state else usable_state(self.storage, t.worker, t.round, bound, reader)
        if not own_state:
            self.feedback = {} if self.uses_feedback else None
        if found is not None:
            state_key, state = found
            self.state_from = L.parse_round(state_key.rsplit("/", 1)[-1], "state")
            log.info("worker %d round %d: optimizer state from its snapshot of round %s", t.worker, t.round, self.state_from)
            self._take_feedback(state)
            label = self.storage.display(state_key)
            params.load_optimizer(self.model, self.opt, self.names, params.restore_state(self.model, state, label, t.round),
                                  label)
        return base_manifest["digest"]

    def _take_feedback(self, tensors: dict[str, torch.Tensor]) -> None:
        """The error-feedback buffer out of a state file's tensors (an older run's has none: {})."""
        feedback = take_feedback(tensors)
        self.feedback = feedback if self.uses_feedback else None

    def train(self, until: Callable[[], bool] | None = None) -> None:
        """Inner steps until the round's steps or time budget are spent, or (round.overlap, training
        ahead) until `until()` says the round's base has been assigned."""
        cfg, model, opt, ranks = self.cfg, self.step_model, self.opt, self.ranks
        autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if self.device.type == "cuda"
                    else contextlib.nullcontext())
        model.train()
        pending: list[torch.Tensor] = []
        failpoint_name, slow_name = f"rank_{ranks.rank}.step", f"worker_{self.task.worker:03d}.step"
        self._t_start = time.monotonic() - self.trained_s
        stopped = False
        if self.preemption is not None:
            self.preemption.deferred = True
        while not self._round_done():
            if until is not None and until():
                stopped = True
                break
            step = self.step0 + self.done
            for group in opt.param_groups:
                group["lr"] = lr_at(step, cfg) * group.get("lr_scale", 1.0)  # lte: heads peak at lte.lr
            # the worker's batch, this rank's rows of it: DDP's averaged gradient is the whole batch's
            batch = map_tensors(self.sampler.batch(step), lambda t: ranks.slice(t).to(self.device, non_blocking=True))
            with autocast:
                loss = self.runner.loss(model, batch)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if cfg.inner.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.inner.grad_clip)
            opt.step()
            failpoint(failpoint_name)  # fault injection only: a rank that dies mid-round
            slowpoint(slow_name)  # fault injection only: a slow node
            pending.append(loss.detach())  # no .item() per step: on a GPU that would sync every step
            self.done += 1
            beat = time.monotonic() >= self._next_beat
            # the losses are averaged over ranks at the same steps on every rank; one rank alone
            # also whenever a heartbeat is due, so that it shows the current loss
            if len(pending) >= 50 or self.done == 1 or (beat and ranks.world == 1):
                self._flush(pending)
            if beat:
                self._heartbeat()
            if self.preemption is not None and self.preemption.asked():
                self._flush(pending)
                self._stop_for_preemption()
        if self.preemption is not None:
            self.preemption.deferred = False
        self.trained_s, self._t_start, self.finished = time.monotonic() - self._t_start, None, not stopped
        self._flush(pending)
        self._heartbeat()
        if not all(math.isfinite(v) for v in self.losses[-5:]):
            job = os.environ.get("SLURM_JOB_ID") or os.environ.get("SUBMITIT_LOCAL_JOB_ID") or "?"
            raise IslandsError(f"task {cfg.task}, worker {self.task.worker} round {self.task.round} (job {job}): the loss "
                               f"became non-finite ({self.losses[-5:]}); lower inner.lr or raise inner.warmup_steps, "
                               "or check the task's loss")

    def _stop_for_preemption(self) -> None:
        """Between two steps, every rank here: save the in-flight checkpoint (rank 0 writes; sharded,
        every rank gathers), then hand the signal to submitit, which requeues the job. Training
        ahead of a round's base (round.overlap) saves none: those steps are lost, by design."""
        self.settle()  # the last round's state file, being written, reaches storage first
        if self._published is None and (self.ranks.lead or self.params.collective):
            self.save_inflight()
        assert self.preemption is not None
        self.preemption.hand_over()

    def _round_done(self) -> bool:
        """Are this round's steps, or its time budget, spent (round.budget; after one step at least;
        every rank takes rank 0's clock, so that all stop at the same step)? Training ahead
        (round.overlap): its share ahead, round.overlap_ahead of either. A replay: its recorded steps."""
        cfg, rc = self.cfg, self.cfg.round
        if self.schedule is not None:  # a replay: the steps the source run took, whatever its budget
            return self.done >= self.schedule.steps[self.task.round, self.task.worker]
        share = rc.overlap_ahead if self._published is not None else 1.0
        if self.done >= math.ceil(share * cfg.inner.steps):
            return True
        if rc.budget != "seconds" or self.done == 0:
            return False
        assert self._t_start is not None
        # round.overlap: the budget runs from the adoption of the round's global (the ahead_s before it
        # are extra), so every worker publishes S after its global and none drifts towards a round ahead
        spent = time.monotonic() - self._t_start - self.ahead_s >= share * rc.budget_seconds
        return bool(self.ranks.lead_says(spent)) if self.ranks.world > 1 else spent

    def _heartbeat(self) -> None:
        """Say how far this round is, every few seconds: cheap, and what `status` shows (rank 0)."""
        t = self.task
        self._next_beat = time.monotonic() + HEARTBEAT_S
        if not self.ranks.lead:
            return
        self.storage.write_json(L.worker_progress(t.worker), {
            "round": t.round, "step": self.done, "steps": self.cfg.inner.steps, "attempt": t.attempt,
            "loss": self.losses[-1] if self.losses else None, "at": time.time(),
            "ahead": self._published is not None})  # round.overlap: training before the round's base exists

    def _flush(self, pending: list[torch.Tensor]) -> None:
        if pending:
            self.losses.extend(self.ranks.mean(torch.stack(pending).float()).cpu().tolist())
            pending.clear()


def _where(device: torch.device) -> str:
    """The device in a log line: a GPU by its name (CUDA_VISIBLE_DEVICES renumbers them)."""
    if device.type != "cuda":
        return device.type
    return f"{torch.cuda.get_device_name(device)} (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')})"


def run_worker(task: WorkerTask) -> dict[str, Any]:
    """Entry point of a per-round worker job. Returns a small summary (the real output is in storage)."""
    return serve_round(task)[0]


def serve_round(task: WorkerTask, waited_s: float | None = None, carry: InnerTrainer | None = None,
                persistent: bool = False) -> tuple[dict[str, Any], InnerTrainer]:
    """Train and publish one round; returns the summary and the trainer.

    A persistent worker passes `persistent` and, from its second round on, `carry`: the trainer of
    its previous round, whose model and AdamW state are reused when they can be
    (InnerTrainer.next_round); its state is written after its contribution, in the background.
    `waited_s`: how long it sat idle waiting for this round (recorded in the manifest)."""
    global _ACTIVE, _RESIDENT
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    t0 = time.perf_counter()
    if carry is not None and not carry.next_round(task):
        carry.flush_state()  # the new trainer reads the state from storage: the newest must be there first
        carry = _RESIDENT = None
    trainer = carry or InnerTrainer(task)
    trainer.waited_s = waited_s
    _ACTIVE = trainer
    try:
        trainer.train()
        slowpoint(f"worker_{task.worker:03d}.publish")  # fault injection only (bench/chaos.py): a straggler
        manifest = trainer.publish(time.perf_counter() - t0 + trainer.ahead_s, state_later=persistent)
    finally:
        _ACTIVE = None
    _RESIDENT = trainer if persistent else None
    log.info("worker %d round %d on %s: %d steps, loss %.4f -> %.4f, %.1fs", task.worker, task.round,
             _where(trainer.device), trainer.done, trainer.losses[0], trainer.losses[-1], time.perf_counter() - t0)
    summary = {"round": task.round, "worker": task.worker, "digest": manifest and manifest["digest"],
               "loss_last": trainer.losses[-1], "rank": trainer.ranks.rank}
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
