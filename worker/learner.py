"""What a worker trains and what it reads to start a round: the model, its AdamW optimizer, the
error-feedback buffer of its coded contributions, and the reads of a round's base weights, its
optimizer-state snapshot or the in-flight checkpoint of a requeued job.

What is trained is asked of `params` (worker/params.py): the whole model, or with `algorithm: lte`
this worker's LoRA heads over a frozen base, or (worker/sharded.py) this rank's rows of it. Every
byte read goes through the checked readers of core/ (codec.load_weights, worker/state.py's checks).
"""
from __future__ import annotations

import logging
import time
from dataclasses import replace

import torch

from core import codec
from core.assignment import Assignment
from core.checkpoint import read_manifest
from core.config import Config
from core.errors import CheckpointError
from core.layout import RunLayout
from core.storage import Storage
from worker import overlap
from worker.params import SEP, Params, take_feedback
from worker.ranks import Ranks, data_parallel
from worker.replica import Replica
from worker.round import Base, RoundInProgress
from worker.state import expect_of, inflight_tensors, usable_state
from worker.weights import HostBuffers, load_weights, weights_of

log = logging.getLogger(__name__)
L = RunLayout()


class Learner:
    """The model and its optimizer, carried from round to round by a persistent worker."""

    def __init__(self, cfg: Config, params: Params, device: torch.device, ranks: Ranks) -> None:
        self.cfg, self.params, self.device, self.ranks = cfg, params, device, ranks
        # Every weight is overwritten by the round's base (load), so the model is built straight on
        # its device and a Hugging Face model's own weights are not read: at 1B parameters a CPU init
        # alone costs seconds per round.
        self.model = params.build(device)
        self.opt, self.names = params.optimizer(self.model)
        # what a training step calls: the model, or DDP over it (a sharded model syncs itself)
        self.step_model = self.model if params.collective else data_parallel(self.model, ranks)
        # Reused every round (pinned on a GPU): the base weights read in.
        self.host_base = HostBuffers(device)
        # round.codec topk: what this worker's contributions left out, sent with its next ones
        self.feedback: codec.Feedback | None = None
        self.uses_feedback = codec.uses_feedback(cfg.round)
        # global_r and the outer state kept to make global_r+1 from the round's contributions
        self.replica = Replica.of(cfg, ranks.world, params.collective)

    def load(self, storage: Storage, rnd: RoundInProgress, own_state: bool) -> None:
        """Start `rnd`: its base weights in the model and this worker's optimizer state from its
        snapshot on storage, or (`own_state`) the state in memory, which is this worker's after its
        previous round; or, for a requeued job, the round's in-flight checkpoint."""
        a, params = rnd.assignment, self.params
        digest = _published_base(storage, a)
        inflight, bound = L.worker_inflight(a.worker, a.round), codec.max_update(self.cfg)
        label = f"worker {a.worker} in-flight checkpoint {storage.display(inflight)}"
        # every rank reads what it holds (sharded: its rows; else all of it), the ranks agreeing on one verdict
        reader = replace(params.reader(self.ranks), expect=expect_of(a.worker, self.model, self.opt, self.names,
                                                                     self.cfg.inner.grad_clip))
        tensors = inflight_tensors(storage, inflight, label, digest, self.cfg.inner.steps, bound, reader)
        t0 = time.perf_counter()
        base = None if tensors is not None else self.replica.next_global(storage, a, digest)
        replayed = base is not None
        if replayed:
            params.load_trained(self.model, base, f"global weights {storage.display(a.base_key)}, replayed")
        else:
            base = params.load_base(storage, a.base_key, self.model, tensors is not None, alloc=self.host_base)
        self.replica.hold(a, base, digest)
        rnd.base = self._took(digest, base, replayed, t0)
        if tensors is not None:
            self._resume(rnd, tensors, read_manifest(storage, inflight) or {})
            return
        # every rank reads and checks its part (a damaged snapshot is set aside by rank 0), as above
        found = None if own_state else usable_state(storage, a.worker, a.round, bound, reader, rnd.state_refused)
        if not own_state:
            self.feedback = {} if self.uses_feedback else None
            rnd.state_fresh = found is None and a.round > 0  # said: no snapshot (a hard loss) or none usable
        if found is not None:
            state_key, state = found
            rnd.state_from = L.parse_round(state_key.rsplit("/", 1)[-1], "state")
            log.info("worker %d round %d: optimizer state from its snapshot of round %s", a.worker, a.round, rnd.state_from)
            self._take_feedback(state)
            label = storage.display(state_key)
            params.load_optimizer(self.model, self.opt, self.names, params.restore_state(self.model, state, label, a.round),
                                  label)

    def _resume(self, rnd: RoundInProgress, tensors: dict[str, torch.Tensor], manifest: dict) -> None:
        """Go on with a round from the in-flight checkpoint a preempted job saved."""
        self._take_feedback(tensors)
        self.params.load_trained(self.model, {k: v for k, v in tensors.items() if SEP not in k}, "in-flight checkpoint")
        self.params.load_optimizer(self.model, self.opt, self.names, {k: v for k, v in tensors.items() if SEP in k},
                                   "in-flight checkpoint")
        rnd.done, rnd.losses = int(manifest["steps_done"]), list(manifest.get("losses", []))
        rnd.trained_s = float(manifest.get("trained_s") or 0.0)  # a time budget goes on where it was
        # round.overlap: the round began ahead of its base
        rnd.adopted_at, rnd.ahead_s = manifest.get("adopted_at_step"), float(manifest.get("ahead_s") or 0.0)
        rnd.resumed_at = rnd.done
        log.info("worker %d round %d: resuming in-flight at step %d/%d", rnd.worker, rnd.number, rnd.done,
                 self.cfg.inner.steps)

    def adopt(self, storage: Storage, rnd: RoundInProgress) -> None:
        """round.overlap: `rnd` was trained ahead of its base, from the weights the previous round
        published (rnd.published); take the base now (worker/overlap.py)."""
        a, rc = rnd.assignment, self.cfg.round
        digest = _published_base(storage, a)
        label = f"base weights for worker {a.worker}"
        t0 = time.perf_counter()
        base = self.replica.next_global(storage, a, digest)
        replayed = base is not None
        if base is None:
            base = codec.load_weights(storage, a.base_key, label, alloc=self.host_base)
        self.replica.hold(a, base, digest)
        assert rnd.published is not None
        load_weights(self.model, overlap.adopt(weights_of(self.model), rnd.published, base, rc.overlap, rc.overlap_mix),
                     f"{label}, adopted at step {rnd.done}")
        rnd.base = self._took(digest, base, replayed, t0)
        rnd.adopted_at, rnd.published = rnd.done, None
        rnd.ahead_s = rnd.trained_s  # trained before the base existed: part of this round's busy time
        log.info("worker %d round %d: adopted its base at step %d (%s)", a.worker, a.round, rnd.done, rc.overlap)

    def _took(self, digest: str, base: dict[str, torch.Tensor], replayed: bool, t0: float) -> Base:
        """The base in the model since perf_counter `t0`: its weights kept for a delta contribution."""
        seconds = round(time.perf_counter() - t0, 4)
        self.replica.took(replayed, seconds)
        return Base(digest, base if self.cfg.round.contribution == "delta" else None, replayed, seconds, time.time())

    def _take_feedback(self, tensors: dict[str, torch.Tensor]) -> None:
        """The error-feedback buffer out of a state file's tensors (an older run's has none: {})."""
        feedback = take_feedback(tensors)
        self.feedback = feedback if self.uses_feedback else None


def _published_base(storage: Storage, a: Assignment) -> str:
    """The digest of the base `a` trains from, once its manifest (the commit) is there."""
    manifest = read_manifest(storage, a.base_key)
    if manifest is None:
        raise CheckpointError(f"worker {a.worker} round {a.round}: base checkpoint {storage.display(a.base_key)} "
                              "is not published; the orchestrator submitted the round too early or it was deleted")
    return manifest["digest"]
