"""LoRA-the-Explorer (Huh et al. 2024), Table 1's trends, against full-model training.

Each simulated LTE worker is a SimWorker with its LoRA heads (worker/lora.py attach_heads and its
optimizer); every round it loads the global model as its frozen base, resets B (keeping A and its
AdamW state, as the real worker does), trains H steps and hands over its heads and non-LoRA
parameters; the merge is merge/lte.py's maths: W += s * mean_n B_n A_n, the rest averaged.
As in the paper's ablation the cumulative batch is fixed: each of N heads gets batch B_total / N.
Everything trains from scratch (the paper's setting), N = rounds x H steps.
"""
from __future__ import annotations

import statistics
from typing import Any

import torch

from bench.reproduce import sim
from bench.reproduce.context import Context, Outcome, Row, check
from core.config import Config
from merge.lte import LORA_A, LORA_B, headed_layers, lte_update, weighted_mean
from worker import lora


class LteWorker(sim.SimWorker):
    def __init__(self, cfg: Config, worker: int, share: int, data: sim.Data) -> None:
        def heads(model: torch.nn.Module, w: int):
            lora.attach_heads(model, cfg.lte, seed=lora.head_seed(cfg.seed, w))
            return lora.make_optimizer
        super().__init__(cfg, worker, share, data, model_hook=heads)

    def run_round(self, start: sim.Weights | None, rnd: int) -> sim.Weights:
        if rnd > 0:  # after a merge: B <- 0 (its update is in the base now); A and AdamW state kept
            lora.reset_heads(self.model, self.cfg.lte, seed=lora.head_seed(self.cfg.seed, self.worker, rnd))
        lora.load_base(self.model, start, f"round {rnd} base")
        self._round_at(rnd)
        self.train()
        return lora.contribution_tensors(self.model)


def lte_merge(global_w: sim.Weights, contribs: list[sim.Weights], scale: float) -> sim.Weights:
    """merge/lte.py's merge_lte_round, in memory: equal weights (every head saw the same tokens)."""
    coeffs = [1.0 / len(contribs)] * len(contribs)
    layers = set(headed_layers(contribs[0]))
    out = {}
    for name, w in global_w.items():
        layer = name[: -len(".weight")] if name.endswith(".weight") else None
        if layer in layers:
            out[name] = lte_update(w, [(c[layer + LORA_A], c[layer + LORA_B]) for c in contribs], coeffs, scale)
        elif name in contribs[0]:
            out[name] = weighted_mean([c[name] for c in contribs], coeffs)
        else:
            out[name] = w
    return out


def run_lte(cfg: Config, data: sim.Data) -> sim.RunResult:
    workers = [LteWorker(cfg, w, cfg.workers, data) for w in range(cfg.workers)]
    evaluate = sim.Evaluator(cfg, data)
    global_w = sim.init_weights(cfg)
    losses, sent = [evaluate(global_w)], 0
    for r in range(cfg.rounds):
        contribs = [w.run_round(global_w, r) for w in workers]
        sent += sum(sim.nbytes(c) for c in contribs)
        global_w = lte_merge(global_w, contribs, cfg.lte.alpha / cfg.lte.rank)
        losses.append(evaluate(global_w))
    return sim.RunResult(losses, sent, {"per_worker_round": sent // (cfg.rounds * cfg.workers)})


def _variants(ctx: Context) -> list[tuple[str, dict[str, Any], str]]:
    """(label, overrides, group): heads at the default rank, ranks at the default heads, merge intervals."""
    s = ctx.size
    r0, n0 = s.lte_rank, s.workers
    out = [(f"{n} heads x rank {r0}", {"workers": n}, "heads") for n in (1, 2, n0, 2 * n0)]
    out += [(f"{n0} heads x rank {r}", {"lte.rank": r, "lte.alpha": 128.0 * r}, "rank") for r in (r0 // 4, r0 // 2)]
    for h in (max(1, s.steps // 10), s.steps * 4):
        if s.total_steps % h == 0 and h != s.steps:
            out.append((f"{n0} heads x rank {r0}, merge every {h}", {"inner.steps": h, "rounds": s.total_steps // h}, "interval"))
    return out


def _cfg(ctx: Context, seed: int, over: dict[str, Any]) -> Config:
    s = ctx.size
    heads = over.get("workers", s.workers)
    base = {"algorithm": "lte", "workers": s.workers, "lte.rank": s.lte_rank, "lte.alpha": 128.0 * s.lte_rank,
            "lte.lr": 1e-4, "inner.batch_size": max(1, 2 * s.batch_size // heads)}
    return ctx.cfg(seed, **{**base, **over})


def lte(ctx: Context) -> Outcome:
    s = ctx.size
    full = [ctx.memo(("lte-full", seed), lambda seed=seed: _full(ctx, seed)) for seed in ctx.seeds]
    rows = [Row(f"full-model training, 1 worker, batch {2 * s.batch_size}", [r.final for r in full], None,
                f"{sim.nbytes(full[0].extra['weights']):,} bytes of weights")]
    groups: dict[str, list[Row]] = {"heads": [], "rank": [], "interval": []}
    curves = [ctx.curve(rows[0].label, full, s.steps)]
    for label, over, group in _variants(ctx):
        runs = [ctx.memo(("lte", seed, tuple(sorted(over.items()))), lambda seed=seed, over=over: run_lte(
            _cfg(ctx, seed, over), ctx.data(_cfg(ctx, seed, over)))) for seed in ctx.seeds]
        row = Row(label, [r.final for r in runs], runs[0].comm_bytes, f"{runs[0].extra['per_worker_round']:,} bytes per head-round")
        rows.append(row)
        groups[group].append(row)
        if group != "rank":
            curves.append(ctx.curve(label, runs, over.get("inner.steps", s.steps)))
    default = groups["heads"][2]
    return Outcome(rows, curves, _checks(rows[0], groups, default), _setup(ctx))


def _full(ctx: Context, seed: int) -> sim.RunResult:
    cfg = ctx.cfg(seed, workers=1, **{"inner.batch_size": 2 * ctx.size.batch_size})
    return sim.run_plain(cfg, ctx.data(cfg))


def _checks(full: Row, groups: dict[str, list[Row]], default: Row) -> list:
    heads, ranks = groups["heads"], groups["rank"] + [default]
    mono = lambda rows: [all(b.finals[i] < a.finals[i] for a, b in zip(rows, rows[1:]))  # noqa: E731
                         for i in range(len(rows[0].finals))]
    means = lambda rows: all(b.mean < a.mean for a, b in zip(rows, rows[1:]))  # noqa: E731
    out = [check("more heads, lower loss (fixed cumulative batch)", mono(heads), means(heads),
                 " -> ".join(f"{r.mean:.4f}" for r in heads)),
           check("higher rank, lower loss", mono(ranks), means(ranks), " -> ".join(f"{r.mean:.4f}" for r in ranks))]
    if len(groups["interval"]) == 2:
        often, rare = groups["interval"]
        out.append(check("merging too often or too rarely hurts (the default interval is best of the three)",
                         [default.finals[i] < min(often.finals[i], rare.finals[i]) for i in range(len(full.finals))],
                         default.mean < min(often.mean, rare.mean),
                         f"often {often.mean:.4f}, default {default.mean:.4f}, rarely {rare.mean:.4f}"))
    gap = statistics.fmean(d / f - 1 for d, f in zip(default.finals, full.finals))
    out.append(check("LTE approaches full-model training (within 5% of its loss)", [d <= 1.05 * f for d, f in zip(
        default.finals, full.finals)], gap <= 0.05, f"LTE {default.mean:.4f} vs full {full.mean:.4f} ({100 * gap:+.1f}%)"))
    return out


def _setup(ctx: Context) -> str:
    s = ctx.size
    return (f"From scratch, N = {s.total_steps} steps (T = {s.rounds} x H = {s.steps} unless stated), cumulative batch "
            f"{2 * s.batch_size} split over the heads (the paper's Table 1 protocol), LoRA on every linear layer wider "
            f"than the rank, alpha = 128 x rank (s = 128), lte.lr {_cfg(ctx, 0, {}).lte.lr:g}, Bernstein A; the "
            "full-model baseline trains every weight with AdamW at inner.lr on the same cumulative batch.")
