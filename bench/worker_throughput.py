"""Worker harness cost: tokens/s of a whole worker round vs a bare PyTorch loop, same process.

The bare loop trains the same model on the same batches with the same optimizer, schedule and
clipping, and touches no storage. The harness is measured two ways:

- per-round job: `worker.train.run_worker`: it reads the run's config, the corpus shard, the
  base checkpoint and its own optimizer state, trains, and publishes its optimizer state and
  weights with manifests;
- resident (a persistent worker's rounds after its first): `worker.train.serve_round` carrying
  the previous round's trainer: it reads the base checkpoint, trains, publishes its weights, and
  writes its optimizer state in a background thread (a later round waits for it if it is not done).

The ratio harness/bare is the harness's cost (goal >= 0.98); the harness's seconds beyond the bare
loop are its fixed cost per round. Runs alternate and the median of each is reported.

On a small shared machine a whole round's time varies by +-10% from run to run, more than the
harness costs, so the fixed cost is also measured directly: `--short-repeats` rounds of
`SHORT_STEPS` steps, harness and bare alternating, the difference of their medians (for the
per-round job and for the persistent worker). Training steps are the same code in both (the
harness adds a clock read and a list append per step), so each mode's ratio at H steps is also
given as bare / (bare + fixed), from the same run.

    python -m bench.worker_throughput [--steps 100] [--repeats 3] [--short-repeats 10] [--n-layer 2 --n-embd 128]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import tempfile
import time

import torch

from core.config import config_from_dict
from core.storage import Storage
from core.assignment import Assignment
from orchestrator.run_models import create_run
from worker.data import BatchSampler, dataset_for
from worker.params import make_optimizer
from worker.round import lr_at
from worker.train import pick_device, run_worker, serve_round
from worker.weights import build_model


def bare_loop(cfg, steps: int) -> float:
    """The baseline: nothing but the training loop. Returns seconds."""
    sampler = BatchSampler(dataset_for(cfg), cfg.model.block_size, cfg.worker_batch_size, cfg.seed, 0, cfg.workers,
                           cfg.data.sharding)
    device = pick_device(cfg)
    torch.manual_seed(cfg.seed)
    model = build_model(cfg.model).to(device)
    opt, _ = make_optimizer(model, cfg)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()
    t0 = time.perf_counter()
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, cfg)
        x, y = (t.to(device, non_blocking=True) for t in sampler.batch(step))
        with autocast:
            _, loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.inner.grad_clip)
        opt.step()
    float(loss.detach())  # wait for the device
    return time.perf_counter() - t0


def harness(cfg, run_dir: str, round_: int) -> float:
    """One whole worker round through run_worker, storage included. Returns seconds."""
    t0 = time.perf_counter()
    run_worker(Assignment(run_dir, round_, 0, f"global/round_{0:05d}.safetensors", threads=torch.get_num_threads()))
    return time.perf_counter() - t0


def resident(run_dir: str, round_: int, carry):
    """One round of a persistent worker carrying `carry` (None: its first). Returns (seconds, trainer)."""
    t0 = time.perf_counter()
    task = Assignment(run_dir, round_, 0, f"global/round_{0:05d}.safetensors", threads=torch.get_num_threads())
    _, trainer = serve_round(task, 0.0, carry, persistent=True)
    return time.perf_counter() - t0, trainer


SHORT_STEPS = 2


def fixed_cost(cfg, round_fn, repeats: int) -> tuple[float, float]:
    """(median seconds of a SHORT_STEPS-step round by round_fn(r), of a SHORT_STEPS-step bare loop)."""
    round_fn(0)  # warm-up (a persistent worker's first round builds its trainer)
    short, bare = [], []
    for r in range(1, repeats + 1):
        short.append(round_fn(r))
        bare.append(bare_loop(cfg, SHORT_STEPS))
    return statistics.median(short), statistics.median(bare)


class ResidentRounds:
    """Rounds of one persistent worker: each call carries the previous round's trainer.

    A round ends when its contribution is published; its optimizer state is then written in the
    background, which in a real run overlaps the wait for the merge and the next round's
    training. Here the next thing to run may be the bare loop, so each round's state write is
    waited for untimed (its seconds kept in `state_write_s`): it must neither slow the baseline
    nor, in a short round, count as the round's own cost."""

    def __init__(self, run_dir: str) -> None:
        self.run_dir, self.carry = run_dir, None
        self.state_write_s: list[float] = []

    def __call__(self, r: int) -> float:
        t, self.carry = resident(self.run_dir, r, self.carry)
        t0 = time.perf_counter()
        self.carry.settle()
        self.state_write_s.append(time.perf_counter() - t0)
        return t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--n-layer", type=int, default=2)
    ap.add_argument("--n-embd", type=int, default=128)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--short-repeats", type=int, default=10, help=f"{SHORT_STEPS}-step rounds for the fixed cost")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        runs, cfgs = [], []
        for name, steps, rounds in (("run", args.steps, args.repeats), ("resident", args.steps, args.repeats),
                                    ("short", SHORT_STEPS, args.short_repeats),
                                    ("short_resident", SHORT_STEPS, args.short_repeats)):
            cfg = config_from_dict({"workers": 4, "rounds": rounds + 1,
                                    "inner": {"steps": steps, "batch_size": args.batch},
                                    "model": {"n_layer": args.n_layer, "n_embd": args.n_embd, "n_head": 4},
                                    "run_dir": f"{tmp}/{name}"})
            create_run(Storage(cfg.run_dir), cfg)
            runs.append(cfg.run_dir)
            cfgs.append(cfg)
        cfg = cfgs[0]
        harness(cfg, runs[0], 0)  # warm-up: corpus cache, allocator, kernels
        kept_rounds = ResidentRounds(runs[1])
        kept_rounds(0)  # a persistent worker's first round builds its trainer
        bare_loop(cfg, min(args.steps, 10))
        bare, full, kept = [], [], []
        for r in range(1, args.repeats + 1):
            bare.append(bare_loop(cfg, args.steps))
            full.append(harness(cfg, runs[0], r))
            kept.append(kept_rounds(r))
        short_h, short_b = fixed_cost(cfgs[2], lambda r: harness(cfgs[2], runs[2], r), args.short_repeats)
        short_rounds = ResidentRounds(runs[3])
        short_k, short_kb = fixed_cost(cfgs[3], short_rounds, args.short_repeats)
    tokens = args.steps * cfg.worker_batch_size * cfg.model.block_size
    b, h, k = statistics.median(bare), statistics.median(full), statistics.median(kept)
    result = {"device": pick_device(cfg).type, "threads": torch.get_num_threads(),
              "params": sum(p.numel() for p in build_model(cfg.model).parameters()), "steps": args.steps,
              "tokens_per_round": tokens, "bare_tokens_per_s": round(tokens / b),
              "harness_tokens_per_s": round(tokens / h), "ratio_harness_over_bare": round(b / h, 4),
              "resident_tokens_per_s": round(tokens / k), "ratio_resident_over_bare": round(b / k, 4),
              "fixed_s_per_round": {"per_round_job": round(h - b, 3), "resident": round(k - b, 3)},
              f"short_rounds_{SHORT_STEPS}_steps": {
                  "harness_s": round(short_h, 4), "bare_s": round(short_b, 4), "fixed_s": round(short_h - short_b, 4),
                  "resident_s": round(short_k, 4), "resident_bare_s": round(short_kb, 4),
                  "resident_fixed_s": round(short_k - short_kb, 4)},
              "ratio_harness_over_bare_from_fixed": round(b / (b + short_h - short_b), 4),
              "ratio_resident_over_bare_from_fixed": round(b / (b + short_k - short_kb), 4),
              "bare_s": [round(x, 3) for x in bare], "harness_s": [round(x, 3) for x in full],
              "resident_s": [round(x, 3) for x in kept],
              "resident_state_write_s": round(statistics.median(kept_rounds.state_write_s[1:]), 3)}
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
