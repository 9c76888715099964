"""What every experiment shares: sizes, configs, memoised runs, and the shape of a result.

Runs are memoised by (kind, seed, config overrides, options), so a run two experiments need (the
1-worker baseline, DiLoCo with the default K) is trained once per invocation.
"""
from __future__ import annotations

import logging
import multiprocessing
import statistics
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any

from core.config import Config, load_config
from bench.reproduce import sim

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Size:
    """Model and schedule of one --size. N = rounds x steps inner steps per worker in every run."""
    n_layer: int
    n_head: int
    n_embd: int
    block_size: int
    batch_size: int
    rounds: int
    steps: int
    pretrain_steps: int
    warmup_steps: int
    eval_batches: int
    workers: int = 4
    lte_rank: int = 16

    @property
    def total_steps(self) -> int:
        return self.rounds * self.steps


SIZES = {
    # a few seconds per experiment: the smoke test's size, not a result
    "test": Size(1, 2, 32, 32, 4, rounds=2, steps=3, pretrain_steps=4, warmup_steps=2, eval_batches=2, lte_rank=4),
    # the default: `--all` in about half an hour on 2 shared CPU cores
    "tiny": Size(2, 4, 64, 64, 16, rounds=16, steps=10, pretrain_steps=80, warmup_steps=10, eval_batches=8),
    # the toolkit's default model (0.48M parameters)
    "small": Size(2, 4, 128, 128, 16, rounds=16, steps=25, pretrain_steps=200, warmup_steps=20, eval_batches=8, lte_rank=32),
    # for a GPU
    "medium": Size(4, 4, 256, 128, 32, rounds=32, steps=50, pretrain_steps=800, warmup_steps=50, eval_batches=16, lte_rank=64),
}


@dataclass
class Row:
    """One method of one experiment: its final eval loss per seed, and its other columns."""
    label: str
    finals: list[float]
    comm_bytes: int | None = None
    note: str = ""

    @property
    def mean(self) -> float:
        return statistics.fmean(self.finals)

    @property
    def spread(self) -> float:
        """Half the range over seeds (0 for one seed)."""
        return (max(self.finals) - min(self.finals)) / 2


@dataclass
class Curve:
    label: str
    steps: list[int]  # inner steps per worker at each point
    per_seed: list[list[float]]


@dataclass
class Check:
    """One of the paper's directions, tested on this run's numbers."""
    claim: str
    holds: bool  # on the means over seeds
    every_seed: bool  # and on every seed alone
    detail: str


@dataclass
class Outcome:
    rows: list[Row]
    curves: list[Curve]
    checks: list[Check]
    setup: str  # what was run, in one paragraph
    seconds: float = 0.0
    xlabel: str = "inner steps per worker"
    metric: str = "final eval loss"
    """What a row's finals are (lofi_vision: accuracy, where higher is better)."""


def check(claim: str, per_seed: Sequence[bool], on_means: bool, detail: str) -> Check:
    return Check(claim, bool(on_means), all(per_seed), detail)


class Context:
    """Configs of one size and seeds, with memoised data, pre-trained weights and runs."""

    def __init__(self, size: Size, seeds: Sequence[int], cache_dir: str | None = None, jobs: int = 1) -> None:
        self.size, self.seeds, self.cache_dir, self.jobs = size, list(seeds), cache_dir, jobs
        self._memo: dict[Any, sim.RunResult] = {}
        self._data: dict[Any, sim.Data] = {}

    def cfg(self, seed: int, **overrides: Any) -> Config:
        """The size's config with `overrides` ({"inner.steps": 10, ...}), validated like a run's."""
        s = self.size
        base = {"model.n_layer": s.n_layer, "model.n_head": s.n_head, "model.n_embd": s.n_embd,
                "model.block_size": s.block_size, "inner.batch_size": s.batch_size, "rounds": s.rounds,
                "inner.steps": s.steps, "inner.warmup_steps": s.warmup_steps, "workers": s.workers,
                "data.eval_batches": s.eval_batches, "data.cache_dir": self.cache_dir, "seed": seed}
        return load_config(None, {**base, **overrides})

    def data(self, cfg: Config, domain: str = "source") -> sim.Data:
        key = (cfg.seed, cfg.data.heldout_fraction, domain)
        if key not in self._data:
            self._data[key] = sim.Data.of(cfg, domain)
        return self._data[key]

    def pretrained(self, seed: int) -> sim.Weights:
        """The model the DiLoCo runs start from (the paper pre-trains before DiLoCo): one worker,
        pretrain_steps on the stdlib modules, with its own warm-up and cosine schedule."""
        cfg = self.cfg(seed, rounds=1, workers=1, **{"inner.steps": self.size.pretrain_steps})
        return self.memo(("pretrain", seed), lambda: sim.run_plain(cfg, self.data(cfg))).extra["weights"]

    def memo(self, key: Any, fn: Callable[[], sim.RunResult], label: str | None = None) -> sim.RunResult:
        if key not in self._memo:
            t0 = time.perf_counter()
            self._memo[key] = fn()
            log.info("%s: %.1fs, final eval loss %.4f", label or key, time.perf_counter() - t0, self._memo[key].final)
        return self._memo[key]

    def diloco(self, seed: int, *, drop: float = 0.0, schedule: str | None = None, ahead: int = 0,
               **overrides: Any) -> sim.RunResult:
        """DiLoCo from the pre-trained model; `schedule` names one of SCHEDULES; `ahead`: steps an
        overlapped worker takes before adopting each global (with round.overlap)."""
        cfg, key = self._diloco_key(seed, drop=drop, schedule=schedule, ahead=ahead, **overrides)
        sched = None if schedule is None else SCHEDULES[schedule](cfg)
        return self.memo(key, lambda: sim.run_diloco(cfg, self.data(cfg), drop=drop, schedule=sched,
                                                    init=self.pretrained(seed), ahead=ahead),
                         f"diloco seed {seed} drop {drop} schedule {schedule} ahead {ahead} {overrides}")

    def _diloco_key(self, seed: int, drop: float = 0.0, schedule: str | None = None, ahead: int = 0,
                    **overrides: Any) -> tuple[Config, tuple]:
        """The config and memo key of ctx.diloco(seed, ...)'s run."""
        cfg = self.cfg(seed, **overrides)
        return cfg, ("diloco", drop, schedule, ahead, repr(cfg))  # the resolved config: equal runs asked differently are one

    def prefetch(self, runs: Sequence[tuple[int, dict[str, Any]]]) -> None:
        """Train the DiLoCo runs (seed, ctx.diloco's keyword arguments) not yet memoised in `jobs`
        processes at once (each pre-trains its seed's model again: cheap next to the runs), so that
        the experiment's own calls find them. Nothing happens with jobs = 1."""
        if self.jobs <= 1:
            return
        todo = {key: (seed, kw) for seed, kw in runs if (key := self._diloco_key(seed, **kw)[1]) not in self._memo}
        if not todo:
            return
        # spawn: a forked child cannot use CUDA that its parent has started
        with ProcessPoolExecutor(self.jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
            futures = {key: pool.submit(_diloco_alone, self.size, self.cache_dir, seed, kw) for key, (seed, kw) in todo.items()}
            for key, f in futures.items():
                self._memo[key] = f.result()
                log.info("%s: final eval loss %.4f", todo[key], self._memo[key].final)

    def plain(self, seed: int, **overrides: Any) -> sim.RunResult:
        """One worker, no merges, from the pre-trained model."""
        cfg = self.cfg(seed, workers=1, **overrides)
        key = ("plain", repr(cfg))
        return self.memo(key, lambda: sim.run_plain(cfg, self.data(cfg), init=self.pretrained(seed)),
                         f"plain seed {seed} {overrides}")

    def curve(self, label: str, runs: Sequence[sim.RunResult], steps: int) -> Curve:
        """Eval losses of a run's global model at every round (x: inner steps per worker)."""
        n = len(runs[0].losses)
        return Curve(label, [i * steps for i in range(n)], [r.losses for r in runs])


def _diloco_alone(size: Size, cache_dir: str | None, seed: int, kw: dict[str, Any]) -> sim.RunResult:
    """One DiLoCo run in a process of its own (Context.prefetch); one torch thread, as the runs share the cores."""
    import torch
    torch.set_num_threads(1)
    return Context(size, [seed], cache_dir).diloco(seed, **kw)


def _ramp(lo: int, hi: int, rounds: int) -> Callable[[int], int]:
    return lambda r: round(lo + (hi - lo) * r / max(1, rounds - 1))


# The DiLoCo paper's Fig. 7, with K = cfg.workers in place of its 8: workers per round.
SCHEDULES: dict[str, Callable[[Config], Callable[[int], int]]] = {
    "constant": lambda c: lambda r: c.workers,
    "doubling": lambda c: lambda r: c.workers // 2 if r < c.rounds // 2 else c.workers,
    "halving": lambda c: lambda r: c.workers if r < c.rounds // 2 else c.workers // 2,
    "ramping up": lambda c: _ramp(1, c.workers, c.rounds),
    "ramping down": lambda c: _ramp(c.workers, 1, c.rounds),
}


def fmt_bytes(n: int | None) -> str:
    if n is None:
        return ""
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return str(n)
