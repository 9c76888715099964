"""What checking token ids against the vocabulary costs a worker's step (worker.data.Dataset.windows).

In one process, on the run's real data (the built-in corpus unless --source): the median seconds of
a whole inner step (its batch read, forward, backward, AdamW) of the built-in model, and the median
seconds of the check alone on that step's batch (one max over the batch, the comparison). Prints
their ratio; the goal is <= 1%.

    python -m bench.token_check [--steps 30] [--batch 16] [--block 128] [--n-layer 2 --n-embd 128]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from core.config import config_from_dict
from worker.data import BatchSampler, dataset_for
from worker.params import make_optimizer
from worker.weights import build_model


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--block", type=int, default=128)
    ap.add_argument("--n-layer", type=int, default=2)
    ap.add_argument("--n-embd", type=int, default=128)
    ap.add_argument("--source", default=None)
    args = ap.parse_args(argv)
    cfg = config_from_dict({"workers": 1, "model": {"n_layer": args.n_layer, "n_embd": args.n_embd, "block_size": args.block},
                            "inner": {"batch_size": args.batch}, "data": {"source": args.source}})
    ds = dataset_for(cfg)
    sampler = BatchSampler(ds, cfg.model.block_size, cfg.worker_batch_size, cfg.seed, 0, cfg.workers, cfg.data.sharding)
    torch.manual_seed(0)
    model = build_model(cfg.model)
    opt, _ = make_optimizer(model, cfg)
    steps, checks = [], []
    for step in range(args.steps):
        t0 = time.perf_counter()
        x, y = sampler.batch(step)
        _, loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        steps.append(time.perf_counter() - t0)
        chunk = torch.cat([x, y[:, -1:]], dim=1)  # the batch's windows as read: block_size + 1 tokens each
        t1 = time.perf_counter()
        for _ in range(10):
            assert int(chunk.max()) < ds.vocab_size  # what windows() adds to each batch
        checks.append((time.perf_counter() - t1) / 10)
    step_s, check_s = statistics.median(steps[3:]), statistics.median(checks[3:])  # the first steps warm up
    print(f"inner step (batch {cfg.worker_batch_size} x {cfg.model.block_size}, {args.n_layer} layers x {args.n_embd}): "
          f"{step_s * 1e3:.2f} ms median over {len(steps) - 3}")
    print(f"token-id check on that batch: {check_s * 1e6:.1f} us median")
    print(f"ratio check / step: {check_s / step_s:.5f} ({100 * check_s / step_s:.3f}% of a step; goal <= 1%)")


if __name__ == "__main__":
    main()
