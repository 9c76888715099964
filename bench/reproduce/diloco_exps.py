"""The DiLoCo paper's comparisons (Douillard et al. 2023): Table 2, Table 3 / Fig. 5, Figs. 4, 6, 7, 8, 9.

Every run starts from the same pre-trained model per seed (the paper pre-trains 24k of its 88k
steps before DiLoCo), runs N = rounds x H inner steps per worker with a fresh warm-up and cosine
schedule, and is scored by the held-out eval loss (nats per byte) of the final global model.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from bench.reproduce.context import SCHEDULES, Check, Context, Outcome, Row, check, fmt_bytes
from bench.reproduce.sim import RunResult, nbytes

OUTER = {  # label: outer.* overrides (the paper's Fig. 6 set)
    "SGD lr 1.0 (FedAvg)": {"outer.optimizer": "sgd", "outer.lr": 1.0},
    "SGD-momentum lr 0.7, m 0.9": {"outer.optimizer": "sgdm", "outer.lr": 0.7, "outer.momentum": 0.9},
    "Nesterov lr 0.7, m 0.9 (DiLoCo)": {"outer.optimizer": "nesterov", "outer.lr": 0.7, "outer.momentum": 0.9},
    "Adam lr 0.1, eps 0.1": {"outer.optimizer": "adam", "outer.lr": 0.1, "outer.eps": 0.1},
}
DROPS = (0.0, 0.1, 0.3, 0.5)


def _row(ctx: Context, label: str, runs: Sequence[RunResult], note: str = "", comm: int | None = -1) -> Row:
    return Row(label, [r.final for r in runs], runs[0].comm_bytes if comm == -1 else comm, note)


def _lower(a: Row, b: Row) -> tuple[list[bool], bool]:
    """(a below b on each seed, a below b on the means)."""
    return [x < y for x, y in zip(a.finals, b.finals)], a.mean < b.mean


def _below(claim: str, a: Row, b: Row) -> Check:
    per, means = _lower(a, b)
    return check(claim, per, means, f"{a.label} {a.mean:.4f} vs {b.label} {b.mean:.4f} ({a.mean - b.mean:+.4f})")


def _monotone(claim: str, rows: Sequence[Row], increasing: bool) -> Check:
    """Each row's loss below (or, increasing, above) the previous one's."""
    def ok(vals: Sequence[float]) -> bool:
        pairs = zip(vals, vals[1:])
        return all((b > a) if increasing else (b < a) for a, b in pairs)
    per = [ok([r.finals[i] for r in rows]) for i in range(len(rows[0].finals))]
    return check(claim, per, ok([r.mean for r in rows]), " -> ".join(f"{r.mean:.4f}" for r in rows))


def table2(ctx: Context) -> Outcome:
    s, k = ctx.size, ctx.size.workers
    one = [ctx.plain(seed) for seed in ctx.seeds]
    big = [ctx.plain(seed, **{"inner.batch_size": k * s.batch_size}) for seed in ctx.seeds]
    dil = [ctx.diloco(seed) for seed in ctx.seeds]
    model_bytes = nbytes(one[0].extra["weights"])
    # data parallelism over k workers: every step, each worker sends its gradient and gets the mean
    dp_bytes = s.total_steps * k * 2 * model_bytes
    rows = [_row(ctx, "1 worker, batch B", one, "no communication", 0),
            _row(ctx, f"1 worker, batch {k}B (= {k}-way data parallel)", big, "all-reduce every step", dp_bytes),
            _row(ctx, f"DiLoCo, {k} workers, batch B each", dil, f"every H = {s.steps} steps")]
    checks = [_below(f"DiLoCo ({k} workers) beats 1 worker at equal inner steps", rows[2], rows[0]),
              _below(f"DiLoCo beats the {k}x batch baseline", rows[2], rows[1])]
    curves = [ctx.curve(r.label, runs, s.steps) for r, runs in zip(rows, (one, big, dil))]
    setup = (f"{k} workers, iid shards, N = {s.total_steps} inner steps per worker (T = {s.rounds} x H = {s.steps}), "
             f"batch B = {s.batch_size} x {s.block_size} bytes, outer Nesterov lr 0.7 m 0.9. Communication: bytes "
             f"crossing the network over the run, all workers (model {fmt_bytes(model_bytes)} in float32).")
    return Outcome(rows, curves, checks, setup)


def workers(ctx: Context) -> Outcome:
    s = ctx.size
    ks = sorted({1, 2, s.workers, 2 * s.workers})
    rows, curves, by_mode = [], [], {}
    for mode in ("iid", "non-iid"):
        by_mode[mode] = []
        for k in ks:
            runs = [ctx.diloco(seed, workers=k, **({"data.sharding": "non-iid"} if mode == "non-iid" and k > 1 else {}))
                    for seed in ctx.seeds]
            row = _row(ctx, f"K = {k}, {mode}", runs, "same run as iid" if k == 1 and mode == "non-iid" else "")
            by_mode[mode].append(row)
            rows.append(row)
            if k == max(ks) or k == 1 and mode == "iid":
                curves.append(ctx.curve(row.label, runs, s.steps))
    iid_runs = [ctx.diloco(seed, workers=max(ks)) for seed in ctx.seeds]
    non_runs = [ctx.diloco(seed, workers=max(ks), **{"data.sharding": "non-iid"}) for seed in ctx.seeds]
    early = [n.losses[1] - i.losses[1] for i, n in zip(iid_runs, non_runs)]
    late = [n.final - i.final for i, n in zip(iid_runs, non_runs)]
    mean = lambda v: sum(v) / len(v)  # noqa: E731
    checks = [_monotone("more workers, lower loss (iid)", by_mode["iid"], increasing=False),
              _monotone("more workers, lower loss (non-iid)", by_mode["non-iid"], increasing=False),
              check(f"K = {max(ks)}: iid ahead early, the non-iid gap shrinks by the end (Fig. 5)",
                    [e > 0 and abs(l) < e for e, l in zip(early, late)], mean(early) > 0 and abs(mean(late)) < mean(early),
                    f"non-iid minus iid: {mean(early):+.4f} after round 1, {mean(late):+.4f} at the end")]
    setup = (f"K in {ks} workers, each N = {s.total_steps} inner steps (so K x the data and compute), iid shards "
             "(random files) and non-iid shards (whole stdlib packages per worker, the toolkit's data.sharding: non-iid).")
    return Outcome(rows, curves, checks, setup)


def outer(ctx: Context) -> Outcome:
    s = ctx.size
    rows, curves = [], []
    for label, over in OUTER.items():
        runs = [ctx.diloco(seed, **over) for seed in ctx.seeds]
        rows.append(_row(ctx, label, runs))
        curves.append(ctx.curve(label, runs, s.steps))
    nesterov = rows[2]
    best = min(rows, key=lambda r: r.mean)
    per_seed_best = [min(range(len(rows)), key=lambda j: rows[j].finals[i]) == 2 for i in range(len(ctx.seeds))]
    checks = [check("Nesterov is the best outer optimizer", per_seed_best, best is nesterov,
                    "best: " + best.label),
              _below("Nesterov beats FedAvg (SGD lr 1.0)", nesterov, rows[0]),
              _below("Nesterov beats outer Adam", nesterov, rows[3])]
    setup = (f"{s.workers} workers, iid, T = {s.rounds} x H = {s.steps}; only the outer optimizer changes. "
             "Not tuned per optimizer (the paper tuned each): SGD-momentum uses Nesterov's lr and momentum; "
             "Adam's lr 0.1 with eps 0.1 makes its first steps about the size of FedAvg's.")
    return Outcome(rows, curves, checks, setup)


def _intervals(ctx: Context) -> list[int]:
    s = ctx.size
    cands = {s.steps // 4, s.steps // 2, s.steps, 2 * s.steps, 4 * s.steps}
    return sorted(h for h in cands if h >= 1 and s.total_steps % h == 0)


def interval(ctx: Context) -> Outcome:
    s = ctx.size
    rows, curves = [], []
    for h in _intervals(ctx):
        over = {"inner.steps": h, "rounds": s.total_steps // h, "data.sharding": "non-iid"}
        runs = [ctx.diloco(seed, **over) for seed in ctx.seeds]
        rows.append(_row(ctx, f"H = {h} (T = {s.total_steps // h})", runs))
        curves.append(ctx.curve(rows[-1].label, runs, h))
    first, last = rows[0], rows[-1]
    hs = _intervals(ctx)
    checks = [_monotone("communicating less often (larger H) gives a higher loss", rows, increasing=True),
              check(f"{hs[-1] // hs[0]}x fewer syncs cost little (< 5% loss)", [b / a - 1 < 0.05 for a, b in zip(first.finals, last.finals)],
                    last.mean / first.mean - 1 < 0.05, f"{first.label}: {first.mean:.4f}, {last.label}: "
                    f"{last.mean:.4f} ({100 * (last.mean / first.mean - 1):+.1f}%)")]
    setup = (f"{s.workers} workers, non-iid (as the paper's Fig. 4), N = {s.total_steps} inner steps per worker; H varies "
             "and T = N / H, so every run does the same compute; communication is proportional to T.")
    return Outcome(rows, curves, checks, setup)


def drop(ctx: Context) -> Outcome:
    s = ctx.size
    rows, curves = [], []
    for p in DROPS:
        runs = [ctx.diloco(seed, drop=p, **{"data.sharding": "non-iid"}) for seed in ctx.seeds]
        dropped = sum(r.extra["dropped"] for r in runs) / len(runs)
        rows.append(_row(ctx, f"drop {100 * p:.0f}%", runs, f"{dropped:.1f} of {s.rounds * s.workers} outer gradients dropped"))
        curves.append(ctx.curve(rows[-1].label, runs, s.steps))
    base, worst = rows[0], rows[-1]
    rel = [w / b - 1 for b, w in zip(base.finals, worst.finals)]
    checks = [_monotone("more dropped outer gradients, higher loss", rows, increasing=True),
              check("50% dropped costs only a few % of loss (paper: 2.1% in perplexity, non-iid)",
                    [r < 0.05 for r in rel], sum(rel) / len(rel) < 0.05,
                    f"{100 * sum(rel) / len(rel):+.2f}% eval loss at 50% vs 0% (mean over seeds)")]
    setup = (f"{s.workers} workers, non-iid, T = {s.rounds} x H = {s.steps}. Each round each worker's outer gradient is left "
             "out of the mean with probability p; a dropped worker continues from its own weights "
             "(round.late_policy: continue, through orchestrator.plan.next_bases). A round with every gradient dropped "
             "leaves the global model unchanged.")
    return Outcome(rows, curves, checks, setup)


def schedule(ctx: Context) -> Outcome:
    s = ctx.size
    rows, curves = [], []
    for name, make in SCHEDULES.items():
        runs = [ctx.diloco(seed, schedule=name) for seed in ctx.seeds]
        f = make(ctx.cfg(0))
        counts = [f(r) for r in range(s.rounds)]
        rows.append(_row(ctx, name, runs, f"workers per round {counts}, {sum(counts)} worker-rounds"))
        curves.append(ctx.curve(name, runs, s.steps))
    r = {row.label: row for row in rows}
    mid = [(a + b) / 2 for a, b in zip(r["doubling"].finals, r["halving"].finals)]
    low = [(a + b) / 2 for a, b in zip(r["ramping up"].finals, r["ramping down"].finals)]
    const = r["constant"].finals
    mean = lambda v: sum(v) / len(v)  # noqa: E731
    checks = [check("more total compute, lower loss (constant < doubling/halving < ramps)",
                    [c < m < l for c, m, l in zip(const, mid, low)], mean(const) < mean(mid) < mean(low),
                    f"{mean(const):.4f} < {mean(mid):.4f} < {mean(low):.4f}"),
              _same("doubling ~ halving (same compute, different timing)", r["doubling"], r["halving"], const, mid),
              _same("ramping up ~ ramping down", r["ramping up"], r["ramping down"], mid, low)]
    setup = (f"iid, T = {s.rounds} x H = {s.steps}; the number of workers changes over rounds (the paper's Fig. 7 with "
             f"{s.workers} in place of 8). A worker that joins late starts from the global model with a fresh AdamW "
             "state; one that leaves is simply no longer run.")
    return Outcome(rows, curves, checks, setup)


def _same(claim: str, a: Row, b: Row, ref1: Sequence[float], ref2: Sequence[float]) -> Check:
    """a and b closer to each other than the two compute levels ref1 and ref2 are."""
    per = [abs(x - y) < abs(p - q) for x, y, p, q in zip(a.finals, b.finals, ref1, ref2)]
    d = abs(a.mean - b.mean)
    level = abs(sum(ref1) / len(ref1) - sum(ref2) / len(ref2))
    return check(claim, per, d < level, f"|{a.mean:.4f} - {b.mean:.4f}| = {d:.4f} vs {level:.4f} between compute levels")


def overlap(ctx: Context) -> Outcome:
    s = ctx.size
    h, quarter = s.steps, max(1, s.steps // 4)
    sync = [ctx.diloco(seed) for seed in ctx.seeds]
    variants = [("rebase", quarter), ("rebase", h), ("mix", quarter), ("mix", h)]
    runs = {v: [ctx.diloco(seed, ahead=v[1], **{"round.overlap": v[0]}) for seed in ctx.seeds] for v in variants}
    rows = [_row(ctx, "synchronous (barrier)", sync)]
    for (mode, ahead), rs in runs.items():
        delay = "one round late: every step before the global" if ahead == h else f"{ahead} of {h} steps before the global"
        rows.append(_row(ctx, f"overlapped, {mode}{' 0.5' if mode == 'mix' else ''}, adopts at step {ahead}", rs, delay))
    rel = {v: [(o.final - b.final) / b.final for o, b in zip(rs, sync)] for v, rs in runs.items()}
    checks = [check(f"overlap {mode} adopting at step {ahead} costs under 2% of loss (Streaming DiLoCo: little or none "
                    "for a short overlap)", [x < 0.02 for x in rel[(mode, ahead)]],
                    sum(rel[(mode, ahead)]) / len(ctx.seeds) < 0.02,
                    f"{100 * sum(rel[(mode, ahead)]) / len(ctx.seeds):+.2f}% vs synchronous (mean over seeds)")
              for mode, ahead in variants]
    curves = [ctx.curve(rows[0].label, sync, h)] + [ctx.curve(r.label, rs, h) for r, rs in zip(rows[1:], runs.values())]
    setup = (f"{s.workers} workers, iid, T = {s.rounds} x H = {h}, equal inner steps. Overlapped (round.overlap): from "
             "round 1 on a worker takes its first steps from its own weights, as if the previous merge were still "
             "running, then adopts the round's global: rebase keeps those steps (global + theta - published), mix "
             "blends (0.5 global + 0.5 theta); the same worker/overlap.py the workers use. Adopting at step H is a "
             "one-round delay (every step from the previous global).")
    return Outcome(rows, curves, checks, setup)


def single(ctx: Context) -> Outcome:
    s = ctx.size
    plain = [ctx.plain(seed) for seed in ctx.seeds]
    one = [ctx.diloco(seed, workers=1) for seed in ctx.seeds]
    rows = [_row(ctx, "plain training (1 worker)", plain, "", 0),
            _row(ctx, f"DiLoCo, K = 1, H = {s.steps}", one, "Nesterov outer step on its own pseudo-gradient", 0)]
    checks = [_below("single-worker DiLoCo beats plain training", rows[1], rows[0])]
    curves = [ctx.curve(r.label, runs, s.steps) for r, runs in zip(rows, (plain, one))]
    setup = (f"One worker, N = {s.total_steps} steps, the same batches and schedule; DiLoCo adds an outer Nesterov "
             f"step every H = {s.steps} steps (no communication: the outer step is local).")
    return Outcome(rows, curves, checks, setup)


COMPRESS_ROUNDS = 32  # error feedback sends what top-k leaves out over rounds: fewer would not show it
TOPK = {"round.contribution": "delta", "round.codec": "topk"}
SPARSE_OUTER = {"outer.optimizer": "sgd", "outer.lr": 3.0}  # SparseLoCo's: the buffer is the momentum


def _topk(den: int, feedback: float = 0.95, sgd: bool = True) -> tuple[str, dict[str, Any]]:
    """(label, overrides) of top-k 1/den at 2 bits with error feedback `feedback` (0: none), outer
    SGD lr 3 (sgd) or DiLoCo's Nesterov."""
    fb = f"error feedback {feedback}" if feedback else "no error feedback"
    outer = "outer SGD lr 3" if sgd else "Nesterov lr 0.7, m 0.9"
    return (f"top-k 1/{den}, 2 bits, {fb}, {outer}",
            {**TOPK, **(SPARSE_OUTER if sgd else {}), "round.topk": 1 / den, "round.error_feedback": feedback})


def compress(ctx: Context) -> Outcome:
    s = ctx.size
    rounds = max(COMPRESS_ROUNDS, s.rounds)
    variants = [("DiLoCo, fp32 weights (Nesterov lr 0.7, m 0.9)", {}), _topk(16), _topk(16, 0.9), _topk(16, 0.0),
                _topk(32), _topk(64), _topk(16, sgd=False)]
    ctx.prefetch([(seed, {"rounds": rounds, **over}) for _, over in variants for seed in ctx.seeds])
    runs = {label: [ctx.diloco(seed, rounds=rounds, **over) for seed in ctx.seeds] for label, over in variants}
    rows = [_row(ctx, label, rs) for label, rs in runs.items()]
    base, ef, noef = rows[0], rows[1], rows[3]
    checks = [check(f"{r.label} ends at most 1% above uncompressed DiLoCo",
                    [e <= 1.01 * b for e, b in zip(r.finals, base.finals)], r.mean <= 1.01 * base.mean,
                    f"{100 * (r.mean / base.mean - 1):+.2f}% ({r.mean:.4f} vs {base.mean:.4f})") for r in rows[1:3]]
    checks.append(_below("error feedback beats the same top-k without it", ef, noef))
    curves = [ctx.curve(r.label, rs, s.steps) for r, rs in zip(rows, runs.values())]
    setup = (f"{s.workers} workers, iid, T = {rounds} x H = {s.steps}. Contributions coded as round.codec (the worker's "
             "core.codec.encode, with its error-feedback buffer carried from round to round) and decoded as the merge "
             "does; communication counts each base read in fp32 and each contribution's coded bytes.")
    return Outcome(rows, curves, checks, setup)


EXPERIMENTS: dict[str, tuple[str, str, Callable[[Context], Outcome]]] = {
    "diloco": ("DiLoCo vs baselines at equal inner steps", "DiLoCo Table 2 / Fig. 2", table2),
    "workers": ("Number of workers, iid and non-iid", "DiLoCo Table 3 / Fig. 5", workers),
    "outer": ("Outer optimizers", "DiLoCo Fig. 6", outer),
    "interval": ("Communication interval H", "DiLoCo Fig. 4", interval),
    "drop": ("Dropped outer gradients", "DiLoCo Fig. 8", drop),
    "schedule": ("Changing the number of workers over time", "DiLoCo Fig. 7", schedule),
    "single": ("Single-worker DiLoCo vs plain training", "DiLoCo Fig. 9", single),
    "overlap": ("Overlapped rounds: synchronous vs overlapped at equal inner steps", "Streaming DiLoCo", overlap),
    "compress": ("Compressed contributions: top-k with error feedback", "SparseLoCo", compress),
}
