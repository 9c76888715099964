"""lo-fi (Wortsman et al. 2022), Table 2: fine-tune without communication, then average once.

The model pre-trained by the DiLoCo experiments' pre-training (stdlib modules, no tests) is
fine-tuned on another domain, the standard library's own test suite (test/, tests/, idle_test/
folders), and scored on held-out test files. lo-fi: K workers, each with batch B / K on its own
iid shard (the toolkit's `algorithm: lofi`), no communication until the end. Baseline: one worker
with batch B on all the data, which is what K-way data parallelism computes, all-reducing every step.
"""
from __future__ import annotations

import statistics

from bench.reproduce import sim
from bench.reproduce.context import Context, Outcome, Row, check
from merge.methods import average
from orchestrator.observe.checkpoint_eval import ensemble_losses
from worker.weights import build_model, load_weights


def _models(cfg, weights: list[sim.Weights]) -> list:
    out = []
    for w in weights:
        m = build_model(cfg.model)
        load_weights(m, w, "fine-tuned weights")
        out.append(m)
    return out


def _one_seed(ctx: Context, seed: int) -> dict[str, float]:
    s = ctx.size
    steps = {"inner.steps": s.total_steps}
    base_cfg = ctx.cfg(seed, workers=1, rounds=1, **steps)
    data = ctx.data(base_cfg, "tests")
    pre = ctx.pretrained(seed)
    batches = data.eval_set(base_cfg)
    baseline = ctx.memo(("lofi-baseline", seed), lambda: sim.run_plain(base_cfg, data, init=pre)).extra["weights"]
    cfg = ctx.cfg(seed, algorithm="lofi", rounds=1, **steps)
    finetuned = []
    for w in range(cfg.workers):
        worker = sim.SimWorker(cfg, w, cfg.workers, data)
        finetuned.append(worker.run_round(pre, 0))
    averaged = {n: average([f[n] for f in finetuned], [1.0] * len(finetuned)) for n in pre}
    singles, ensemble = ensemble_losses(_models(cfg, finetuned), batches)
    (pre_loss, base_loss, avg_loss), _ = ensemble_losses(_models(cfg, [pre, baseline, averaged]), batches)
    return {"pre": pre_loss, "baseline": base_loss, "individual": statistics.fmean(singles),
            "best individual": min(singles), "average": avg_loss, "ensemble": ensemble}


def lofi_rows(per: list[dict[str, float]], pre: str, k: int, size: int, steps: int) -> list[Row]:
    """lo-fi's table from each seed's figures (`per`): the starting model (labelled `pre`), the
    communicating baseline, an individual worker (mean and best), the weight average, the ensemble;
    with the bytes each sends (`size`: the model's, `steps` steps, `k` workers)."""
    col = lambda key: [p[key] for p in per]  # noqa: E731
    return [Row(pre, col("pre"), 0),
            Row(f"baseline: 1 worker, batch B, all data (= {k}-way data parallel)", col("baseline"),
                steps * k * 2 * size, "all-reduce every step"),
            Row(f"lo-fi individual worker (batch B/{k}), mean of {k}", col("individual"), 0),
            Row("lo-fi best individual worker", col("best individual"), 0),
            Row(f"lo-fi: weight average of the {k}", col("average"), k * size, "one upload per worker, at the end"),
            Row(f"lo-fi: output ensemble of the {k}", col("ensemble"), k * size, f"{k} models at inference")]


def lofi(ctx: Context) -> Outcome:
    s, k = ctx.size, ctx.size.workers
    per = [_one_seed(ctx, seed) for seed in ctx.seeds]
    size = 4 * sum(p.numel() for p in build_model(ctx.cfg(0).model).parameters())
    rows = lofi_rows(per, "pre-trained model, not fine-tuned", k, size, s.total_steps)
    base, ind, avg, ens = rows[1], rows[2], rows[4], rows[5]
    checks = [check("the weight average matches the baseline (within 1% of loss, or better)",
                    [a <= 1.01 * b for a, b in zip(avg.finals, base.finals)], avg.mean <= 1.01 * base.mean,
                    f"average {avg.mean:.4f} vs baseline {base.mean:.4f} ({100 * (avg.mean / base.mean - 1):+.2f}%)"),
              check("the weight average beats an individual worker",
                    [a < i for a, i in zip(avg.finals, ind.finals)], avg.mean < ind.mean,
                    f"{avg.mean:.4f} vs {ind.mean:.4f}"),
              check("the output ensemble beats an individual worker",
                    [e < i for e, i in zip(ens.finals, ind.finals)], ens.mean < ind.mean,
                    f"{ens.mean:.4f} vs {ind.mean:.4f}"),
              check("fine-tuning helps on the new domain", [b < p for b, p in zip(base.finals, rows[0].finals)],
                    base.mean < rows[0].mean, f"{rows[0].mean:.4f} -> {base.mean:.4f}")]
    setup = (f"Pre-trained {s.pretrain_steps} steps on stdlib modules (data.include_tests: false), then fine-tuned "
             f"{s.total_steps} steps on the stdlib test suite only; eval on held-out test files. lo-fi: {k} workers, "
             f"batch {s.batch_size}/{k} each, iid shards, one round (algorithm: lofi); the average is "
             "merge.methods.average, the ensemble orchestrator.observe.checkpoint_eval's mean of probabilities.")
    return Outcome(rows, [], checks, setup)
