"""What a worker writes to storage: its contribution and optimizer state at the end of a round,
and an in-flight checkpoint when its job is preempted mid-round.

A mixin of worker.train.InnerTrainer (it uses the trainer's task, storage, config, model,
optimizer, params and ranks): the round loop stays in worker/train.py, readable top to bottom,
and what crosses storage, with its order of writes, is read here. The order: the optimizer state
first, then the weights with their manifest, which is the commit (core/checkpoint.py); a
persistent worker writes the state after the contribution, from a snapshot, in the background, and
only every round.state_every rounds (flush_state writes the newest when its job ends early).
"""
from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

import torch

from core import codec
from core.checkpoint_writer import write_checkpoint
from core.errors import IslandsError
from core.layout import RunLayout, manifest_key
from worker.params import feedback_tensors

log = logging.getLogger(__name__)
L = RunLayout()


class Publisher:
    """The writes of worker.train.InnerTrainer (see the module docstring)."""

    def publish(self, seconds: float, state_later: bool = False) -> dict[str, Any] | None:
        """Optimizer state first, then the weights and their manifest: the manifest is the commit.
        Rank 0 writes; the others return None (sharded: after helping gather weights and state).

        `state_later` (a persistent worker, which keeps its state in memory): the contribution
        first, then the state is written from a snapshot in a background thread, off the merge's
        critical path and overlapping the wait for the next round (`settle` waits for it)."""
        t, params = self.task, self.params
        if not (self.ranks.lead or params.collective):
            return None
        self.settle()
        # snapshots (training may go on); sharded: gathered onto rank 0, every rank taking part
        state = params.optimizer_state(self.model, self.opt, self.names, self._host_state)
        state.update(params.state_extra(self.model))  # lte: its own heads travel in its state file
        weights = self._weights()
        if not self.ranks.lead:
            return None
        manifest = {
            "round": t.round, "worker": t.worker, "steps": self.done, "attempt": t.attempt,
            "tokens": self.done * self.sampler.tokens_per_batch, "base": t.base_key, "base_digest": self.base_sha,
            "loss_first": self.losses[0], "loss_last": self.losses[-1], "losses": [round(v, 5) for v in self.losses],
            "seconds": round(seconds, 3), "job_id": os.environ.get("SLURM_JOB_ID") or os.environ.get("SUBMITIT_LOCAL_JOB_ID"),
            "host": os.uname().nodename, "device": self.device.type, "resumed_at_step": self.resumed_at,
            "waited_s": self.waited_s, "ranks": self.ranks.world, "trained_s": round(self.trained_s, 3),
            "threads": torch.get_num_threads(),  # per rank: a replay needs the same (core/replay.py)
        }
        if self.adopted_at is not None:
            rc = self.cfg.round
            manifest["overlap"] = {"mode": rc.overlap, "adopted_at_step": self.adopted_at, "ahead_s": round(self.ahead_s, 3),
                                   **({"mix": rc.overlap_mix} if rc.overlap == "mix" else {})}
        params.describe(manifest)
        tensors, metadata, feedback = self._contribution(manifest, weights)
        state.update(feedback_tensors(feedback))  # the buffer after this contribution: the next round's
        if self.state_from is not None:
            manifest["state_from_round"] = self.state_from  # a job's first round, from a snapshot on storage
        snapshot = not state_later or not self.params.carries_over or (t.round + 1) % self.cfg.round.state_every == 0
        if not state_later:
            self._write_state(state, t.round, t.worker)
        out = write_checkpoint(self.storage, L.contribution(t.round, t.worker), tensors, metadata=metadata,
                               manifest=manifest)
        # only now: an in-flight checkpoint saved before this (a signal during the write) resumes the
        # round, so it must hold the buffer the round started with
        self.feedback = feedback
        self.storage.remove(L.worker_inflight(t.worker, t.round))
        self._unsaved = None if snapshot else (state, t.round, t.worker)
        if state_later and snapshot:
            self._state_write = threading.Thread(target=self._write_state, args=(state, t.round, t.worker, True),
                                                 name=f"state-{t.worker}-{t.round}", daemon=True)
            self._state_write.start()
        return out

    def _write_state(self, state: dict[str, torch.Tensor], r: int, worker: int, background: bool = False) -> None:
        try:
            write_checkpoint(self.storage, L.worker_state(worker, r), state, manifest={"round": r, "worker": worker})
        except IslandsError as exc:
            if not background:
                raise
            # the state stays in memory for the next round; only a job restarted from storage misses it
            log.warning("worker %d round %d: optimizer state not saved (%s); a job restarted from storage "
                        "would take an older one", worker, r, exc)
            return
        # a persistent worker keeps one snapshot, the newest once it is whole; a per-round job also the
        # one before, which a requeue of this round reads if it was preempted before its contribution
        self._prune_states(keep_from=r if background else r - 1)

    def flush_state(self) -> None:
        """Write the newest optimizer-state snapshot if it is in memory only (round.state_every): the
        job ends or is preempted between rounds, and the job after it should not start from an older one."""
        self.settle()
        if self._unsaved is not None:
            state, r, worker = self._unsaved
            self._unsaved = None
            self._write_state(state, r, worker, background=True)  # a failure is a warning, as in the background

    def settle(self) -> None:
        """Wait for the optimizer state being written in the background, if any."""
        if self._state_write is not None:
            self._state_write.join()
            self._state_write = None

    def checkpoint(self) -> None:
        """Save an in-flight checkpoint of this round (submitit calls it on rank 0 only, from its
        preemption handler). Signalled while training, the ranks saved it already, after the step
        (InnerTrainer._stop_for_preemption): a handler runs between any two lines, and one in the
        middle of a step would save weights that step had half updated. Signalled between
        training and publishing, rank 0 saves it here; a sharded worker, whose gathers need every
        rank, keeps none (the requeued job starts the round over)."""
        if not self.ranks.lead or self.inflight_at == self.done:
            return
        if self.params.collective:
            log.warning("worker %d round %d: preempted outside its training steps; the requeued job starts "
                        "the round over from its base", self.task.worker, self.task.round)
            return
        self.settle()
        self.save_inflight()

    def save_inflight(self) -> None:
        """Weights, AdamW state and position of this round, for a requeued job to resume from. Rank 0
        writes; sharded, every rank calls it (the gathers are collectives)."""
        t = self.task
        # fresh copies, not the reused buffers: this may run from a signal handler in the middle of publish
        tensors = {**self._weights(reuse=False), **self.params.optimizer_state(self.model, self.opt, self.names),
                   **feedback_tensors(self.feedback)}
        self.inflight_at = self.done
        if not self.ranks.lead:
            return
        write_checkpoint(self.storage, L.worker_inflight(t.worker, t.round), tensors,
                         manifest={"round": t.round, "worker": t.worker, "steps_done": self.done,
                                   "base_digest": self.base_sha, "losses": self.losses,
                                   "trained_s": round(self._training_s(), 3), "adopted_at_step": self.adopted_at,
                                   "ahead_s": self.ahead_s})
        log.info("worker %d round %d: in-flight checkpoint at step %d", t.worker, t.round, self.done)

    def _training_s(self) -> float:
        """Seconds of training so far this round (also mid-round, from a preemption handler)."""
        return self.trained_s if self._t_start is None else time.monotonic() - self._t_start

    def _contribution(self, manifest: dict[str, Any], weights: dict[str, torch.Tensor]
                      ) -> tuple[dict[str, torch.Tensor], dict[str, str] | None, codec.Feedback | None]:
        """What is published (with its safetensors metadata, and the error feedback it leaves):
        `weights`, or the delta base - weights coded as round.codec (core/codec.py; the codec goes
        into the manifest too, with the bytes the weights would take in fp32)."""
        rc = self.cfg.round
        manifest["fp32_bytes"] = sum(4 * w.numel() if w.is_floating_point() else w.nbytes for w in weights.values())
        if rc.contribution == "weights":  # always so for lte (config refuses lte with delta)
            return weights, None, None
        base = self._base if self._base is not None else codec.load_weights(self.storage, self.task.base_key)
        t0 = time.perf_counter()
        tensors, metadata, feedback = codec.encode(base, weights, codec.encoding_for(rc, self.base_sha), self.feedback,
                                                   rc.error_feedback)
        manifest["contribution"] = {"format": "delta", "codec": rc.codec, "prune_keep": rc.prune_keep,
                                    "encode_s": round(time.perf_counter() - t0, 4),
                                    **({"topk": rc.topk, "bits": rc.bits, "error_feedback": rc.error_feedback}
                                       if rc.codec == "topk" else {})}
        return tensors, metadata, feedback

    def _weights(self, reuse: bool = True) -> dict[str, torch.Tensor]:
        """What this worker publishes: all weights, or (lte) its heads and non-LoRA parameters.
        `reuse`: in the buffers kept for it (valid until the next call)."""
        return self.params.published(self.model, self._host_out if reuse else None)

    def _prune_states(self, keep_from: int) -> None:
        for name in self.storage.list(L.worker_dir(self.task.worker)):
            r = L.parse_round(name, "state")
            if r is not None and r < keep_from:
                key = L.worker_state(self.task.worker, r)
                self.storage.remove(manifest_key(key))  # manifest first: a reader never sees it without data
                self.storage.remove(key)
