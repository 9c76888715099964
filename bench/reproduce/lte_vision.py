"""LoRA-the-Explorer on images (Huh et al. 2024, Table 1 trains ViTs from scratch): LTE's heads
against full-model training, scored in accuracy, on the shipped vision task (`task: digits`).

Unlike the other experiments (an in-process simulation of the worker), every run here is a whole
`orchestrate submit` on the local executor: real worker processes, checkpoints, merges and the
service's eval. The LoRA heads go on the ViT's attention and MLP layers through worker/lora.py,
which the task never sees. As in the paper's ablation the cumulative batch is fixed: each of N heads
gets batch 2B / N; the full-model baseline is one worker on batch 2B (fedavg with one worker: the
outer step copies its weights, so it is plain training).
"""
from __future__ import annotations

import json
import statistics
import tempfile
from contextlib import redirect_stdout
from io import StringIO
from pathlib import Path
from typing import Any

from bench.reproduce.context import Context, Curve, Outcome, Row, check
from orchestrator.cli import main as orchestrate


def _run(ctx: Context, seed: int, folder: Path, algorithm: str, workers: int, extra: dict[str, Any]) -> list[float]:
    """The global model's eval accuracy after every round of one whole run (the initial model first)."""
    s = ctx.size
    run = folder / f"{algorithm}-{workers}-{seed}"
    batch = max(1, 2 * s.batch_size // workers)
    sets = {"task": "digits", "seed": seed, "inner.batch_size": batch, "data.eval_batches": -(-360 // batch),  # all
            "inner.warmup_steps": s.warmup_steps, "inner.lr": 1e-3, "round.poll_s": 0.1, **extra}
    args = ["submit", "--algorithm", algorithm, "--workers", str(workers), "--rounds", str(s.rounds),
            "--inner-steps", str(s.steps), "--executor", "local", "--run-dir", str(run)]
    args += [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]
    with redirect_stdout(StringIO()) as out:
        code = orchestrate(args)
        if code != 0:
            raise RuntimeError(f"{' '.join(args)} exited {code}:\n{out.getvalue()[-2000:]}")
        orchestrate(["status", str(run), "--json"])
    status = json.loads(out.getvalue()[out.getvalue().index("{\n"):])
    info = json.loads((run / "run.json").read_text())
    return [info["initial_eval_metrics"]["accuracy"], *(r["eval_metrics"]["accuracy"] for r in status["rounds"])]


def lte_vision(ctx: Context) -> Outcome:
    s = ctx.size
    rank = max(4, s.lte_rank // 2)  # the ViT is 64 wide: a head of rank 32 would be half of it
    lte = {"lte.rank": rank, "lte.alpha": 128.0 * rank}
    with tempfile.TemporaryDirectory(prefix="islands-lte-vision-") as tmp:
        folder = Path(tmp)
        runs = {"full": [_run(ctx, seed, folder, "fedavg", 1, {}) for seed in ctx.seeds]}
        for heads in (2, s.workers):
            runs[heads] = [_run(ctx, seed, folder, "lte", heads, lte) for seed in ctx.seeds]
    steps = [i * s.steps for i in range(s.rounds + 1)]
    labels = {"full": f"full-model training, 1 worker, batch {2 * s.batch_size}",
              2: f"LTE: 2 heads x rank {rank}", s.workers: f"LTE: {s.workers} heads x rank {rank}"}
    rows = [Row(labels[k], [r[-1] for r in v]) for k, v in runs.items()]
    curves = [Curve(labels[k], steps, v) for k, v in runs.items()]
    full, two, many = rows
    gap = statistics.fmean(f - m for f, m in zip(full.finals, many.finals))
    checks = [check("more heads, higher accuracy (fixed cumulative batch)",
                    [m > t for m, t in zip(many.finals, two.finals)], many.mean > two.mean,
                    f"2 heads {two.mean:.4f} -> {s.workers} heads {many.mean:.4f}"),
              check("LTE approaches full-model training (within 5 points of its accuracy)",
                    [m >= f - 0.05 for m, f in zip(many.finals, full.finals)], gap <= 0.05,
                    f"LTE {many.mean:.4f} vs full {full.mean:.4f} ({-100 * gap:+.1f} points)")]
    setup = (f"Task digits (a 137k-parameter ViT) from scratch, T = {s.rounds} rounds x H = {s.steps} steps, every run a "
             f"whole `orchestrate submit` on the local executor. LTE: heads of rank {rank} (alpha = 128 x rank) on every "
             f"linear layer wider than the rank, lte.lr 1e-4, cumulative batch {2 * s.batch_size} split over the heads; "
             f"full model: AdamW at inner.lr 1e-3, batch {2 * s.batch_size}. Accuracy of the global model on all "
             "360 held-out images (the service's own eval).")
    return Outcome(rows, curves, checks, setup, xlabel="inner steps per worker",
                   metric="final eval accuracy (higher is better)")
