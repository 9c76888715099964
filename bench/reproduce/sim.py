"""In-process simulation of K workers and the merge service, built from the toolkit's real pieces.

A simulated worker is an `InnerTrainer` (worker/train.py) whose constructor takes its pieces from
memory instead of a run directory: the same model, shard, BatchSampler, AdamW (make_optimizer) and
the same `train()` loop (lr schedule lr_at over the global step, clipping, autocast on CUDA). It
keeps its AdamW state across rounds, as a real worker does through its state file. The outer step
is merge.methods' `outer` method (a real torch.optim step on `global - weighted mean`), tensor by
tensor with the per-tensor state the service saves between rounds; which checkpoint a worker starts
the next round from is orchestrator.plan.next_bases (round.late_policy).
"""
from __future__ import annotations

import functools
import logging
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch

from core import codec
from core.assignment import Assignment
from core.config import Config, DataConfig
from merge.methods import get_method
from orchestrator.plan import next_bases
from worker.overlap import adopt
from worker.data import BatchSampler, Dataset, dataset_for, eval_batches
from worker.params import make_optimizer
from worker.ranks import SOLO
from worker.tasks.lm import LanguageModel
from worker.round import RoundInProgress, StopRule
from worker.train import InnerTrainer, pick_device
from worker.weights import build_model, load_weights, weights_of

log = logging.getLogger(__name__)
Weights = dict[str, torch.Tensor]
EVAL_BATCH_SIZE = 16
TEST_GROUP = "test"  # the stdlib's test/ package: lo-fi's fine-tuning domain


@functools.lru_cache(maxsize=4)
def dataset(include_tests: bool, cache_dir: str | None) -> Dataset:
    return dataset_for(Config(data=DataConfig(include_tests=include_tests, cache_dir=cache_dir)))


@dataclass
class Data:
    """A run's dataset (the stdlib), optionally only its test/ package."""
    dataset: Dataset
    groups: frozenset[str] | None

    @classmethod
    def of(cls, cfg: Config, domain: str = "source") -> "Data":
        """domain 'source': the corpus of cfg.data (stdlib modules); 'tests': only the stdlib's test/ package."""
        ds = dataset(cfg.data.include_tests or domain == "tests", cfg.data.cache_dir)
        return cls(ds, frozenset({TEST_GROUP}) if domain == "tests" else None)

    def sampler(self, cfg: Config, worker: int, num_workers: int) -> BatchSampler:
        return BatchSampler(self.dataset, cfg.model.block_size, cfg.worker_batch_size, cfg.seed, worker, num_workers,
                            cfg.data.sharding, self.groups)

    def eval_set(self, cfg: Config) -> list:
        """data.eval_batches batches of EVAL_BATCH_SIZE windows: not inner.batch_size, which differs
        between the methods of one experiment (4x batch, LTE heads), whose eval data must not."""
        return eval_batches(self.dataset, cfg.model.block_size, EVAL_BATCH_SIZE, cfg.data.eval_batches, cfg.seed,
                            self.groups)


class SimWorker(InnerTrainer):
    """One worker: the real InnerTrainer's loop minus storage (no run directory, no heartbeat file)."""

    def __init__(self, cfg: Config, worker: int, share: int, data: Data,
                 model_hook: Callable[[torch.nn.Module, int], Any] | None = None) -> None:
        # InnerTrainer.__init__ reads the run directory; the parts its loop uses are built here instead
        self.cfg, self.ranks, self.worker = cfg, SOLO, worker
        self.sampler = data.sampler(cfg, worker, share)  # `worker`'s share of the train split among `share`
        self.task = LanguageModel(cfg)  # the loss of task lm; its dataset is never opened here
        device = pick_device(cfg)
        model = build_model(cfg.model).to(device)
        optimizer = make_optimizer
        if model_hook is not None:  # LTE: attach heads, and use their optimizer
            optimizer = model_hook(model, worker) or make_optimizer
        opt, names = optimizer(model, cfg)
        # the learner's parts the loop uses: no params (nothing read or published), no DDP
        self.learner = SimpleNamespace(model=model, opt=opt, names=names, step_model=model, device=device)
        self.stop = StopRule(cfg, None, SOLO)  # no replay
        self.publisher = SimpleNamespace(before_training=lambda: None)  # nothing published, no snapshot to wait for
        self.preemption = None  # a simulation: no job to preempt
        self.next_beat = float("inf")
        self.stopping, self.next_stop_poll = False, float("inf")  # no run directory to stop it
        self._round_at(0)

    def _heartbeat(self) -> None:
        """No progress file: nothing watches a simulated worker."""

    def _round_at(self, rnd: int) -> None:
        """Round rnd, no step of it taken (InnerTrainer._start, without reseeding torch)."""
        self.round = RoundInProgress.start(Assignment("memory", rnd, self.worker, ""), self.cfg)

    def run_round(self, start: Weights | None, rnd: int) -> Weights:
        """H inner steps at global steps rnd*H.., from `start` (None: the model's current weights)."""
        if start is not None:
            load_weights(self.model, start, f"round {rnd} base")
        self._round_at(rnd)
        self.train()
        return weights_of(self.model)

    def run_overlapped(self, base: Weights, published: Weights, rnd: int, ahead: int, mode: str, alpha: float) -> Weights:
        """round.overlap: round rnd's first `ahead` steps from the worker's own weights (those it
        published last round, trained on), then `base` adopted (worker/overlap.py), then the rest."""
        self._round_at(rnd)
        self.train(until=lambda: self.round.done >= ahead)
        load_weights(self.model, adopt(weights_of(self.model), published, base, mode, alpha), f"round {rnd} base")
        self.train()
        return weights_of(self.model)


def init_weights(cfg: Config, init: Weights | None = None) -> Weights:
    """The round-0 global weights, as orchestrator/run_models.py makes them (seeded init or init_from)."""
    torch.manual_seed(cfg.seed)
    model = build_model(cfg.model)
    if init is not None:
        load_weights(model, init, "pre-trained weights")
    return weights_of(model)


class Evaluator:
    """Held-out loss of weights, on the same fixed batches for every model of a run."""

    def __init__(self, cfg: Config, data: Data) -> None:
        self.model = build_model(cfg.model).to(pick_device(cfg))
        self.batches = data.eval_set(cfg)
        self.task = LanguageModel(cfg)  # the service's eval: task lm's loss, averaged over the batches

    def __call__(self, weights: Weights) -> float:
        load_weights(self.model, weights, "evaluated weights")
        return self.task.evaluate(self.model, self.batches)["loss"]


def outer_merge(global_w: Weights, contribs: Sequence[Weights], weights: Sequence[float],
                states: dict[str, dict[str, torch.Tensor]], cfg: Config) -> Weights:
    """The merge service's DiLoCo step: per tensor, merge.methods.outer (weighted mean, then one
    torch.optim step of cfg.outer on the pseudo-gradient global - mean, with that tensor's state)."""
    outer = get_method("outer")
    return {name: outer([c[name] for c in contribs], weights, base=g, optimizer=cfg.outer,
                        state=states.setdefault(name, {}))
            for name, g in global_w.items()}


@dataclass
class RunResult:
    losses: list[float]  # held-out loss of the global model: initial, then after every round
    comm_bytes: int = 0  # bytes that crossed storage: every download of a base + every upload
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def final(self) -> float:
        return self.losses[-1]


def nbytes(weights: Weights) -> int:
    return sum(t.numel() * t.element_size() for t in weights.values())


def run_plain(cfg: Config, data: Data, init: Weights | None = None) -> RunResult:
    """One worker trained without any merge for rounds x H steps (its batches and lr schedule
    are those of worker 0 of a DiLoCo run), evaluated every H steps."""
    worker = SimWorker(cfg, 0, 1, data)
    evaluate = Evaluator(cfg, data)
    w = init_weights(cfg, init)
    load_weights(worker.model, w, "initial weights")
    losses = [evaluate(w)]
    for r in range(cfg.rounds):
        w = worker.run_round(None, r)
        losses.append(evaluate(w))
    return RunResult(losses, extra={"weights": w, "worker": worker})


def sent(global_w: Weights, weights: Weights, cfg: Config, feedback: dict[int, codec.Feedback], w: int
         ) -> tuple[Weights, int]:
    """What worker `w`'s contribution merges as, and its bytes: its weights, or (round.contribution
    delta) global - its coded delta, decoded as the merge does; codec topk carries `feedback[w]`."""
    rc = cfg.round
    if rc.contribution == "weights":
        return weights, nbytes(weights)
    enc = codec.encoding_for(rc, "")
    ef = codec.uses_feedback(rc)
    tensors, _, left = codec.encode(global_w, weights, enc, feedback.get(w, {}) if ef else None, rc.error_feedback)
    if left is not None:
        feedback[w] = left
    decoded = {n: g - codec.decode_tensor(n, tuple(g.shape), enc, tensors.__getitem__) if g.is_floating_point()
               else tensors[n] for n, g in global_w.items()}
    return decoded, nbytes(tensors)


def _active_count(schedule: Callable[[int], int] | None, cfg: Config, rnd: int) -> int:
    return cfg.workers if schedule is None else schedule(rnd)


def run_diloco(cfg: Config, data: Data, *, drop: float = 0.0, schedule: Callable[[int], int] | None = None,
               init: Weights | None = None, ahead: int = 0) -> RunResult:
    """DiLoCo with cfg.workers shards. `drop`: probability that a worker's outer gradient is left out
    of a round (it then continues from its own weights, round.late_policy); `schedule(round)`: how
    many workers (ids 0..k-1) train that round (the DiLoCo paper's Fig. 7), default all. `ahead`
    (with cfg.round.overlap): from round 1 on, each worker takes that many of its steps before it
    adopts the round's global, as an overlapped worker whose merge took that long."""
    workers: dict[int, SimWorker] = {}
    evaluate = Evaluator(cfg, data)
    global_w = init_weights(cfg, init)
    states: dict[str, dict[str, torch.Tensor]] = {}
    own: dict[int, Weights] = {}
    bases: dict[int, str] = {}
    rng = random.Random(f"drop:{cfg.seed}:{drop}")
    feedback: dict[int, codec.Feedback] = {}  # round.codec topk: each worker's error feedback
    contributions: dict[int, Weights] = {}
    losses, comm, dropped = [evaluate(global_w)], 0, 0
    size = nbytes(global_w)
    for r in range(cfg.rounds):
        active = _active_count(schedule, cfg, r)
        for w in range(active):
            if w not in workers:  # a worker joining later starts with a fresh AdamW state
                workers[w] = SimWorker(cfg, w, cfg.workers, data)
            base = bases.get(w, "global")
            if cfg.round.overlap != "off" and r > 0 and base == "global" and w in own:
                own[w] = workers[w].run_overlapped(global_w, own[w], r, ahead, cfg.round.overlap, cfg.round.overlap_mix)
            else:
                own[w] = workers[w].run_round(global_w if base == "global" else own[w], r)
            contributions[w], up = sent(global_w, own[w], cfg, feedback, w)
            comm += (size if base == "global" else 0) + up
        merged = [w for w in range(active) if not (drop and rng.random() < drop)]
        dropped += active - len(merged)
        if merged:  # every gradient dropped: the global model stays as it is
            tokens = [float(cfg.inner.steps * workers[w].sampler.tokens_per_batch) for w in merged]
            global_w = outer_merge(global_w, [contributions[w] for w in merged], tokens, states, cfg)
        late = {w: f"own:{w}" for w in range(active) if w not in merged}
        bases = next_bases(active, merged, late, cfg.round.late_policy, "global")
        losses.append(evaluate(global_w))
        log.debug("round %d: %d workers, merged %s, eval %.4f", r, active, merged, losses[-1])
    return RunResult(losses, comm, {"weights": global_w, "dropped": dropped})
