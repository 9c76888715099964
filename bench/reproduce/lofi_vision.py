"""lo-fi on images (Wortsman et al. 2022, Table 1 and Figures 1-5 fine-tune ViTs): the `lofi`
comparison again, scored in accuracy, on the shipped vision task (`task: digits`, a ViT on
scikit-learn's digits) through the task interface the workers train with (worker/tasks/).

Pre-training sees only the digits 0-4; fine-tuning sees all ten (a new domain, as lo-fi fine-tunes
an ImageNet model on another distribution), and the eval is the held-out images of all ten. lo-fi:
K workers, each with batch B / K on its own share of the examples, one round, no communication until
the weights are averaged once. Baseline: one worker with batch B on all the data, which is what
K-way data parallelism computes, all-reducing every step. Each run is the worker's loop in miniature:
the task's sampler, loss and eval, AdamW with the run's schedule and clipping.
"""
from __future__ import annotations

import statistics
from typing import Any

import torch

from bench.reproduce.context import Context, Outcome, check
from bench.reproduce.lofi_exp import lofi_rows
from core.config import Config, load_config
from merge.methods import average
from worker.params import make_optimizer
from worker.tasks import Ensemble, Examples
from worker.tasks.digits import Digits
from worker.round import lr_at
from worker.weights import load_weights, weights_of

Weights = dict[str, torch.Tensor]
PRETRAIN_CLASSES = range(5)


class _Digits(Digits):
    """Task digits, its train examples limited to `classes` (pre-training's domain)."""

    def __init__(self, cfg: Config, classes: range | None = None) -> None:
        super().__init__(cfg)
        self.classes = classes

    def examples(self, split: str) -> list[Any]:
        got = super().examples(split)
        return got if self.classes is None or split == "eval" else [e for e in got if e[1] in self.classes]


def _train(runner: Examples, cfg: Config, init: Weights | None, worker: int, workers: int) -> Weights:
    torch.manual_seed(cfg.seed)
    model = runner.build_model()
    if init is not None:
        load_weights(model, init, "starting weights")
    opt, _ = make_optimizer(model, cfg)
    sampler = runner.sampler(worker, workers, cfg.worker_batch_size)
    model.train()
    for step in range(cfg.inner.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg)
        loss = runner.loss(model, sampler.batch(step))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.inner.grad_clip)
        opt.step()
    return weights_of(model)


def _accuracy(runner: Examples, cfg: Config, weights: list[Weights]) -> float:
    models = []
    for w in weights:
        m = runner.build_model()
        load_weights(m, w, "fine-tuned weights")
        models.append(m)
    model = models[0] if len(models) == 1 else Ensemble(models)
    return runner.evaluate(model, runner.eval_batches(10**6, 64))["accuracy"]  # every held-out image


def _cfg(ctx: Context, seed: int, **over: Any) -> Config:
    s = ctx.size
    base = {"task": "digits", "seed": seed, "workers": s.workers, "rounds": 1, "inner.batch_size": s.batch_size,
            "inner.warmup_steps": s.warmup_steps, "inner.lr": 1e-3}
    return load_config(None, {**base, **over})


def _one_seed(ctx: Context, seed: int) -> dict[str, float]:
    s, k = ctx.size, ctx.size.workers
    pre_cfg = _cfg(ctx, seed, workers=1, **{"inner.steps": 4 * s.pretrain_steps})
    pre = _train(Examples(_Digits(pre_cfg, PRETRAIN_CLASSES), "digits", pre_cfg), pre_cfg, None, 0, 1)
    base_cfg = _cfg(ctx, seed, workers=1, **{"inner.steps": s.total_steps})
    full = Examples(_Digits(base_cfg), "digits", base_cfg)
    baseline = _train(full, base_cfg, pre, 0, 1)
    cfg = _cfg(ctx, seed, algorithm="lofi", **{"inner.steps": s.total_steps})
    finetuned = [_train(Examples(_Digits(cfg), "digits", cfg), cfg, pre, w, k) for w in range(k)]
    averaged = {n: average([f[n] for f in finetuned], [1.0] * k) for n in pre}
    singles = [_accuracy(full, cfg, [f]) for f in finetuned]
    return {"pre": _accuracy(full, cfg, [pre]), "baseline": _accuracy(full, cfg, [baseline]),
            "individual": statistics.fmean(singles), "best individual": max(singles),
            "average": _accuracy(full, cfg, [averaged]), "ensemble": _accuracy(full, cfg, finetuned)}


def lofi_vision(ctx: Context) -> Outcome:
    s, k = ctx.size, ctx.size.workers
    per = [_one_seed(ctx, seed) for seed in ctx.seeds]
    cfg = _cfg(ctx, 0)
    size = 4 * sum(p.numel() for p in Examples(Digits(cfg), "digits", cfg).build_model().parameters())
    rows = lofi_rows(per, "pre-trained on digits 0-4, not fine-tuned", k, size, s.total_steps)
    base, ind, avg, ens = rows[1], rows[2], rows[4], rows[5]
    checks = [check("the weight average matches the baseline (within 1 point of accuracy, or better)",
                    [a >= b - 0.01 for a, b in zip(avg.finals, base.finals)], avg.mean >= base.mean - 0.01,
                    f"average {avg.mean:.4f} vs baseline {base.mean:.4f} ({100 * (avg.mean - base.mean):+.1f} points)"),
              check("the weight average beats an individual worker",
                    [a > i for a, i in zip(avg.finals, ind.finals)], avg.mean > ind.mean, f"{avg.mean:.4f} vs {ind.mean:.4f}"),
              check("the output ensemble beats an individual worker",
                    [e > i for e, i in zip(ens.finals, ind.finals)], ens.mean > ind.mean, f"{ens.mean:.4f} vs {ind.mean:.4f}"),
              check("fine-tuning helps on the new domain", [b > p for b, p in zip(base.finals, rows[0].finals)],
                    base.mean > rows[0].mean, f"{rows[0].mean:.4f} -> {base.mean:.4f}")]
    setup = (f"Task digits (a 137k-parameter ViT, worker/tasks/digits.py). Pre-trained {4 * s.pretrain_steps} steps on "
             f"the digits 0-4 only, then fine-tuned {s.total_steps} steps on all ten; accuracy on all {360} held-out "
             f"images. lo-fi: {k} workers, batch {s.batch_size}/{k} each, disjoint shares of the examples, one round; "
             "the average is merge.methods.average, the ensemble the mean of the models' probabilities "
             "(worker.tasks.Ensemble). Inner lr 1e-3 (AdamW, warm-up and cosine as the workers).")
    return Outcome(rows, [], checks, setup, metric="final eval accuracy (higher is better)")
