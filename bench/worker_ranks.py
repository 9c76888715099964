"""A worker of several ranks against a worker of one: tokens/s of the same round, same machine.

Both are real worker rounds of one run (worker.train.run_worker: base read, H steps, publish),
each a submitit local job: the one-rank worker with one CPU thread, the R-rank worker with
tasks_per_node=R, one thread per rank, joined by gloo (on a GPU node: NCCL, one GPU
per rank). Throughput is the manifest's tokens over its seconds (which include joining the ranks,
reading the base and publishing, not the process start). Runs alternate; medians are reported, and
their ratio (goal: >= 1.7 for 2 ranks on 2 cores).

    python -m bench.worker_ranks [--ranks 2] [--parallel ddp|fsdp] [--device cpu|cuda] [--steps 200] [--repeats 3] [--n-layer 2 --n-embd 128 --batch 16]
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import submitit

from core.checkpoint import read_manifest
from core.config import config_from_dict
from core.layout import RunLayout
from core.storage import Storage
from core.assignment import Assignment
from orchestrator.run_models import create_run
from worker.train import run_worker

L = RunLayout()


def _round(run: Storage, r: int, ranks: int, folder: Path, gpus: int) -> float:
    """One worker round on `ranks` ranks; its tokens/s from its manifest."""
    task = Assignment(run.url, r, 0, L.global_weights(0), threads=ranks)
    ex = submitit.LocalExecutor(folder=folder / "%j")  # a fresh process for both: the same cold start
    ex.update_parameters(tasks_per_node=ranks, gpus_per_node=gpus, timeout_min=30)
    ex.submit(run_worker, task).results()
    m = read_manifest(run, L.contribution(r, 0))
    return m["tokens"] / m["seconds"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--n-layer", type=int, default=2)
    ap.add_argument("--n-embd", type=int, default=128)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--parallel", choices=["ddp", "fsdp"], default="ddp")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cuda: NCCL, one GPU per rank")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="islands-ranks-"))
    cfg = config_from_dict({"workers": 1, "rounds": 2 * args.repeats, "seed": 0,
                            "model": {"n_layer": args.n_layer, "n_embd": args.n_embd, "n_head": 4, "block_size": 128},
                            "inner": {"steps": args.steps, "batch_size": args.batch, "device": args.device, "parallel": args.parallel},
                            "run_dir": str(tmp / "run")})
    run = Storage(cfg.run_dir)
    create_run(run, cfg)
    one, many = [], []
    for i in range(args.repeats):  # every round starts from global_0; rounds only name the files
        one.append(_round(run, 2 * i, 1, tmp / "jobs", int(args.device == "cuda")))
        many.append(_round(run, 2 * i + 1, args.ranks, tmp / "jobs", args.ranks if args.device == "cuda" else 0))
    a, b = statistics.median(one), statistics.median(many)
    print(json.dumps({"ranks": args.ranks, "device": args.device, "parallel": args.parallel, "steps": args.steps, "model": f"{args.n_layer}x{args.n_embd}",
                      "batch": args.batch, "tokens_per_s_1_rank": round(a), f"tokens_per_s_{args.ranks}_ranks": round(b),
                      "ratio": round(b / a, 3), "runs_1": [round(x) for x in one], "runs_n": [round(x) for x in many]}))


if __name__ == "__main__":
    main()
