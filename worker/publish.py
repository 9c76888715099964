"""What a worker writes to storage: its contribution and optimizer state at the end of a round,
and an in-flight checkpoint when its job is preempted mid-round.

What is written is the round in progress (worker/round.py) and the learner's model, optimizer and
error feedback (worker/learner.py): the round loop stays in worker/train.py, readable top to
bottom, and what crosses storage, with its order of writes, is read here. The order: the optimizer state
first, then the weights with their manifest, which is the commit (core/checkpoint.py); a
persistent worker writes the state after the contribution, from a snapshot, in the background, and
only every round.state_every rounds (Snapshots.flush writes the newest when its job ends early).

A sharded worker (worker/sharded.py) streams its contribution instead: the weights gathered tensor
by tensor, rank 0 coding and writing each as it comes; then every rank writes its own file of the
state snapshot (when one is due), and only then does rank 0 write the contribution's manifest.
"""
from __future__ import annotations

import contextlib
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from core import codec, iostat
from core.assignment import current_job_id
from core.checkpoint import DTYPES, ITEMSIZE, open_checkpoint
from core.checkpoint_writer import OutputFile, publish_manifest, write_checkpoint, write_data
from core.errors import CheckpointError, IslandsError
from core.layout import RunLayout
from core.shards import remove_checkpoint
from core.storage import Storage
from worker.learner import Learner
from worker.params import Params, feedback_tensors
from worker.ranks import Ranks
from worker.round import RoundInProgress
from worker.weights import HostBuffers

log = logging.getLogger(__name__)
L = RunLayout()


class Publisher:
    """A worker's writes (see the module docstring), and the optimizer state it still has to write."""

    def __init__(self, storage: Storage, learner: Learner, tokens_per_batch: int) -> None:
        self.storage, self.learner, self.tokens_per_batch = storage, learner, tokens_per_batch
        self.cfg, self.ranks, self.params = learner.cfg, learner.ranks, learner.params
        device = learner.device
        # Reused every round (pinned on a GPU): weights and optimizer state out. A contribution of
        # plain weights reuses the base's buffers, read back into the model before training; a delta
        # needs the base until it is coded. Host memory on a GPU: 3-4x the fp32 weights.
        # On a CPU the model's own tensors are host memory: the coded delta is made from them (nothing
        # trains while it is coded), and so is the state snapshot unless the worker trains ahead while
        # it is written (round.overlap); before its next step the snapshot is settled (before_training).
        cpu = on_cpu(device) and not learner.params.collective
        self.state_live = cpu and self.cfg.round.overlap == "off"
        self.host_state = HostBuffers(device, live=self.state_live)
        self.host_out = learner.host_base if self.cfg.round.contribution == "weights" else HostBuffers(device, live=cpu)
        self.snapshots = Snapshots(storage, learner.params, learner.ranks)
        self.coding = False  # the error feedback is being replaced by the new one (_contribution)
        self.io = iostat.counters()  # at the last manifest: a round's bytes read and written are the difference

    def publish(self, rnd: RoundInProgress, seconds: float, state_later: bool = False) -> dict[str, Any] | None:
        """Optimizer state first, then the weights and their manifest: the manifest is the commit.
        Rank 0 writes; the others return None (sharded: after writing their own state file and
        helping gather the weights).

        `state_later` (a persistent worker, which keeps its state in memory): the contribution
        first, then the state is written from a snapshot in a background thread, off the merge's
        critical path and overlapping the wait for the next round (`settle` waits for it). A
        sharded worker's ranks write theirs together, before the commit (a collective)."""
        a, params, learner = rnd.assignment, self.params, self.learner
        if not (self.ranks.lead or params.collective):
            return None
        self.snapshots.settle()
        # snapshots (training may go on); sharded: each rank's own rows
        state = params.optimizer_state(learner.model, learner.opt, learner.names, self.host_state)
        state.update(params.state_extra(learner.model))  # lte: its own heads travel in its state file
        manifest = self._manifest(rnd, seconds) if self.ranks.lead else {}
        key = L.contribution(a.round, a.worker)
        if params.collective:  # the weights gathered and written tensor by tensor; committed below
            written, feedback = self._stream_contribution(rnd, key, manifest)
        else:
            tensors, metadata, feedback = self._contribution(rnd, manifest, self._weights())
        state.update(feedback_tensors(feedback))  # the buffer after this contribution: the next round's
        snapshot = not state_later or not params.carries_over or (a.round + 1) % self.cfg.round.state_every == 0
        if not state_later or (snapshot and params.collective):
            self.snapshots.write(state, a.round, a.worker, background=state_later)
        self.snapshots.unsaved = None if snapshot else (state, a.round, a.worker)
        if not self.ranks.lead:
            learner.feedback = feedback
            return None
        if params.collective:
            entry = publish_manifest(self.storage, key, written.entry)
        else:
            entry = write_checkpoint(self.storage, key, tensors, metadata=metadata, manifest=manifest)
            if learner.replica.off is None:  # replaying the round needs it: kept, not read back
                learner.replica.mine = (entry["digest"], tensors, metadata or {})
        # only now: an in-flight checkpoint saved before this (a signal during the write) resumes the
        # round, so it must hold the buffer the round started with
        learner.feedback, self.coding = feedback, False
        remove_checkpoint(self.storage, L.worker_inflight(a.worker, a.round))
        if state_later and snapshot and not params.collective:
            self.snapshots.write_later(state, a.round, a.worker)
        return entry

    def before_training(self) -> None:
        """The model's optimizer state is about to change: a snapshot made of its own tensors is
        written first, or (round.state_every) dropped; a stop from here on saves an in-flight
        checkpoint, which holds it."""
        if self.state_live:
            self.snapshots.settle()
            self.snapshots.unsaved = None

    def _manifest(self, rnd: RoundInProgress, seconds: float) -> dict[str, Any]:
        """What a contribution's manifest says of its round (rank 0)."""
        a, b = rnd.assignment, rnd.base
        manifest = {
            "round": a.round, "worker": a.worker, "steps": rnd.done, "attempt": a.attempt,
            "tokens": rnd.done * self.tokens_per_batch, "base": a.base_key, "base_digest": rnd.base_digest,
            "loss_first": rnd.losses[0], "loss_last": rnd.losses[-1], "losses": [round(v, 5) for v in rnd.losses],
            "seconds": round(seconds, 3), "job_id": current_job_id(),
            "host": os.uname().nodename, "device": self.learner.device.type, "resumed_at_step": rnd.resumed_at,
            "waited_s": rnd.waited_s, "ranks": self.ranks.world, "trained_s": round(rnd.trained_s, 3),
            "threads": torch.get_num_threads(),  # per rank: a replay needs the same (core/replay.py)
            "replica": bool(b and b.replayed), "base_s": b.seconds if b else None, "base_at": b.at if b else None,
        }
        io, self.io = self.io, iostat.counters()
        if io and self.io:  # since the previous contribution (its write, the state snapshot, this round's base)
            manifest["io_read"], manifest["io_written"] = self.io["rchar"] - io["rchar"], self.io["wchar"] - io["wchar"]
        if (overlapped := rnd.overlap_record(self.cfg)) is not None:
            manifest["overlap"] = overlapped
        self.params.describe(manifest)
        if rnd.state_from is not None:
            manifest["state_from_round"] = rnd.state_from  # a job's first round, from a snapshot on storage
        if rnd.state_refused:  # snapshots set aside (worker/state.py): from an older one, or fresh AdamW state
            manifest["state_refused_rounds"] = rnd.state_refused
        if rnd.state_fresh:
            manifest["state_fresh"] = True
        return manifest

    def checkpoint(self, rnd: RoundInProgress) -> None:
        """Save an in-flight checkpoint of `rnd` (submitit calls it on rank 0 only, from its
        preemption handler). Signalled while training, the ranks saved it already, after the step
        (InnerTrainer._stop_here): a handler runs between any two lines, and one in the
        middle of a step would save weights that step had half updated. Signalled between
        training and publishing, rank 0 saves it here; a sharded worker, whose gathers need every
        rank, keeps none (the requeued job starts the round over)."""
        if not self.ranks.lead or rnd.inflight_at == rnd.done:
            return
        if self.params.collective or self.coding:
            log.warning("worker %d round %d: preempted outside its training steps%s; the requeued job starts "
                        "the round over from its base", rnd.worker, rnd.number,
                        " (while its error feedback was being replaced)" if self.coding else "")
            return
        self.snapshots.settle()
        self.save_inflight(rnd)

    def save_inflight(self, rnd: RoundInProgress) -> None:
        """Weights, AdamW state and position of `rnd`, for a requeued job to resume from. Rank 0
        writes; sharded, every rank writes its own file of it (a collective)."""
        a, learner = rnd.assignment, self.learner
        # fresh copies, not the reused buffers: this may run from a signal handler in the middle of publish
        tensors = {**self._weights(reuse=False), **self.params.optimizer_state(learner.model, learner.opt, learner.names),
                   **feedback_tensors(learner.feedback)}
        rnd.inflight_at = rnd.done
        self.params.save(self.storage, L.worker_inflight(a.worker, a.round), tensors,
                         {"round": a.round, "worker": a.worker, "steps_done": rnd.done, "base_digest": rnd.base_digest,
                          "losses": rnd.losses, "trained_s": round(rnd.training_s(), 3),
                          "adopted_at_step": rnd.adopted_at, "ahead_s": rnd.ahead_s})
        if self.ranks.lead:
            log.info("worker %d round %d: in-flight checkpoint at step %d", a.worker, a.round, rnd.done)

    def _contribution(self, rnd: RoundInProgress, manifest: dict[str, Any], weights: dict[str, torch.Tensor]
                      ) -> tuple[dict[str, torch.Tensor], dict[str, str] | None, codec.Feedback | None]:
        """What is published (with its safetensors metadata, and the error feedback it leaves):
        `weights`, or the delta base - weights coded as round.codec (core/codec.py; the codec goes
        into the manifest too, with the bytes the weights would take in fp32)."""
        rc = self.cfg.round
        manifest["fp32_bytes"] = sum(4 * w.numel() if w.is_floating_point() else w.nbytes for w in weights.values())
        if rc.contribution == "weights":  # always so for lte (config refuses lte with delta)
            return weights, None, None
        held = rnd.base.weights if rnd.base is not None else None
        base = held if held is not None else codec.load_weights(self.storage, rnd.assignment.base_key)
        t0, enc = time.perf_counter(), codec.encoding_for(rc, rnd.base_digest, rnd.number)
        # state_live: the feedback buffer becomes the new one as it is coded (one buffer held, not two);
        # until the commit a preemption keeps no in-flight checkpoint, which would need the round's first
        self.coding = self.state_live and self.learner.feedback is not None
        tensors, metadata, feedback = codec.encode(base, weights, enc, self.learner.feedback, rc.error_feedback,
                                                   in_place=self.coding)
        manifest["contribution"] = _coding(rc, enc, time.perf_counter() - t0)
        return tensors, metadata, feedback

    def _weights(self, reuse: bool = True) -> dict[str, torch.Tensor]:
        """What this worker publishes: all weights, or (lte) its heads and non-LoRA parameters.
        `reuse`: in the buffers kept for it (valid until the next call)."""
        return self.params.published(self.learner.model, self.host_out if reuse else None)

    def _stream_contribution(self, rnd: RoundInProgress, key: str, manifest: dict[str, Any]
                             ) -> tuple[OutputFile | None, codec.Feedback | None]:
        """A sharded worker's contribution, tensor by tensor as its ranks gather the weights, each
        coded (round.codec) and written by rank 0 as it comes: no rank holds the whole weights. The
        data is written, not committed (publish_manifest, after the state). Every rank takes part in
        every gather, also when rank 0's write fails (it goes on gathering, then raises)."""
        gathered = self.params.gathered(self.learner.model)
        try:
            if not self.ranks.lead:
                return None, None
            return self._write_streamed(rnd, key, manifest, gathered)
        finally:
            for _ in gathered:
                pass

    def _write_streamed(self, rnd: RoundInProgress, key: str, manifest: dict[str, Any],
                        gathered: Iterator[tuple[str, torch.Tensor]]) -> tuple[OutputFile, codec.Feedback | None]:
        rc, shapes = self.cfg.round, self.params.shapes(self.learner.model)
        manifest["fp32_bytes"] = sum(math.prod(s) * (4 if d.is_floating_point else d.itemsize) for d, s in shapes.values())
        if rc.contribution == "weights":
            specs = [(n, DTYPES[d], s, math.prod(s) * d.itemsize) for n, (d, s) in shapes.items()]
            return write_data(OutputFile(self.storage, key, specs, None, manifest), lambda: gathered), None
        enc = codec.encoding_for(rc, rnd.base_digest, rnd.number)
        stored = {n: codec.stored_specs({n: (DTYPES[d], s)}, enc) for n, (d, s) in shapes.items()}
        specs = [(k, d, s, math.prod(s) * ITEMSIZE[d]) for n in shapes for k, (d, s) in stored[n].items()]
        feedback, left, spent = self.learner.feedback, {}, 0.0

        def coded() -> Iterator[tuple[str, torch.Tensor]]:
            nonlocal spent
            with _base_tensors(self.storage, rnd.assignment.base_key, rnd.base_digest) as base:
                for n, w in gathered:
                    t0 = time.perf_counter()
                    fb = None if feedback is None else {n: feedback[n]} if n in feedback else {}
                    out, _, rest = codec.encode({n: base(n)}, {n: w}, enc, fb, rc.error_feedback)
                    left.update(rest or {})
                    spent += time.perf_counter() - t0
                    yield from ((k, out[k]) for k in stored[n])
        written = write_data(OutputFile(self.storage, key, specs, enc.metadata(), manifest), coded)
        written.entry.update(contribution=_coding(rc, enc, spent))
        return written, (left if feedback is not None else None)


class Snapshots:
    """A worker's optimizer-state snapshots: written before its contribution, or (a persistent
    worker) after it in the background and only every round.state_every rounds."""

    def __init__(self, storage: Storage, params: Params, ranks: Ranks) -> None:
        self.storage, self.params, self.ranks = storage, params, ranks
        self.writing: threading.Thread | None = None  # last round's optimizer state, being written
        # (state, round, worker) of the newest snapshot, when it is in memory only (round.state_every)
        self.unsaved: tuple[dict[str, torch.Tensor], int, int] | None = None

    def write_later(self, state: dict[str, torch.Tensor], r: int, worker: int) -> None:
        """Write round r's snapshot in a background thread (settle waits for it)."""
        self.writing = threading.Thread(target=self.write, args=(state, r, worker, True),
                                        name=f"state-{worker}-{r}", daemon=True)
        self.writing.start()

    def write(self, state: dict[str, torch.Tensor], r: int, worker: int, background: bool = False) -> None:
        try:
            self.params.save(self.storage, L.worker_state(worker, r), state, {"round": r, "worker": worker})
        except IslandsError as exc:
            if not background:
                raise
            # the state stays in memory for the next round; only a job restarted from storage misses it
            log.warning("worker %d round %d: optimizer state not saved (%s); a job restarted from storage "
                        "would take an older one", worker, r, exc)
            return
        # a persistent worker keeps one snapshot, the newest once it is whole; a per-round job also the
        # one before, which a requeue of this round reads if it was preempted before its contribution
        if self.ranks.lead:
            self._prune(worker, keep_from=r if background else r - 1)

    def flush(self, handler: bool = False) -> None:
        """Write the newest optimizer-state snapshot if it is in memory only (round.state_every): the
        job ends or is preempted between rounds, and the job after it should not start from an older one.
        `handler`: called from submitit's preemption handler, on rank 0 alone, where a sharded worker's
        ranks cannot write theirs together (the requeued job takes the snapshot before)."""
        self.settle()
        if self.unsaved is not None and handler and self.params.collective:
            _, r, worker = self.unsaved
            log.warning("worker %d: preempted between rounds; its newest optimizer state (round %d) is in memory only "
                        "and the requeued job takes the snapshot before it", worker, r)
            return
        if self.unsaved is not None:
            state, r, worker = self.unsaved
            self.unsaved = None
            self.write(state, r, worker, background=True)  # a failure is a warning, as in the background

    def settle(self) -> None:
        """Wait for the optimizer state being written in the background, if any."""
        if self.writing is not None:
            self.writing.join()
            self.writing = None

    def _prune(self, worker: int, keep_from: int) -> None:
        folder = L.worker_dir(worker)
        rounds = {r for n in self.storage.list(folder) if (r := L.parse_state(n, committed=False)) is not None}
        for r in sorted(r for r in rounds if r < keep_from):
            remove_checkpoint(self.storage, L.worker_state(worker, r))  # manifest first


def on_cpu(device: torch.device) -> bool:
    """Are the model's tensors host memory, to be written without a copy? (Tests say no to take a
    GPU's copying path on a CPU.)"""
    return device.type == "cpu"


def _coding(rc: Any, enc: codec.Encoding, encode_s: float) -> dict[str, Any]:
    """A delta contribution's record of its coding, in its manifest."""
    return {"format": "delta", "codec": enc.codec, "prune_keep": enc.keep, "encode_s": round(encode_s, 4),
            **({"topk": rc.topk, "bits": rc.bits, "error_feedback": rc.error_feedback} if enc.codec == "topk" else {})}


@contextlib.contextmanager
def _base_tensors(storage: Storage, key: str, digest: str) -> Iterator[Callable[[str], torch.Tensor]]:
    """The base's tensors by name, one at a time, its digest checked once all are read; a coded base
    (this worker's own contribution under late_policy continue) decoded whole. `digest`: the base
    the round trained from, which the delta is coded against."""
    with open_checkpoint(storage, key, storage.display(key)) as ck:
        if ck.manifest and ck.manifest["digest"] != digest:
            raise CheckpointError(f"{ck.label}: the base was replaced while the round trained (digest "
                                  f"{ck.manifest['digest'][:12]}, trained from {digest[:12]}); the round is run again")
        if codec.encoding_of(ck.metadata, ck.label) is not None:
            whole = codec.load_weights(storage, key)
            yield whole.__getitem__
            return
        yield ck.get
        ck.verify()
