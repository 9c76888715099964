"""Host memory of a sharded (FSDP) worker's ranks against the same worker on one rank.

Each side is a real worker round (worker.train.run_worker: base read, H steps, state snapshot and
contribution written), a submitit local job: one rank, then R ranks joined by gloo with
inner.parallel=fsdp. Each rank reports its process's peak resident memory (ru_maxrss) at the end of
the round; the figure is the largest rank's peak over the one-rank worker's peak (goal: <= 0.4 for
4 ranks of a 12 x 512 built-in GPT). A rank's peak includes what any process pays to import torch,
so it is reported alone too (`baseline_mb`: a job that imports the worker and returns).

    python -m bench.rank_memory [--ranks 4] [--n-layer 12 --n-embd 512] [--steps 2]
"""
from __future__ import annotations

import argparse
import json
import resource
import tempfile
from pathlib import Path

import submitit

from core.checkpoint import load_checkpoint
from core.config import config_from_dict
from core.layout import RunLayout
from core.storage import Storage
from core.assignment import Assignment
from orchestrator.run_models import create_run

L = RunLayout()


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _round(task: Assignment | None) -> dict:
    """In each rank: one worker round (None: only the imports), then this process's peak RSS."""
    import worker.train as train
    rank = 0
    if task is not None:
        rank = train.run_worker(task)["rank"]
    return {"rank": rank, "peak_mb": round(_peak_mb(), 1)}


def _job(folder: Path, ranks: int, task: Assignment | None) -> list[dict]:
    ex = submitit.LocalExecutor(folder=folder / "%j")
    ex.update_parameters(tasks_per_node=ranks, timeout_min=30)
    out = ex.submit(_round, task).results()
    return sorted(out, key=lambda r: r["rank"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--n-layer", type=int, default=12)
    ap.add_argument("--n-embd", type=int, default=512)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--batch", type=int, default=16, help="the worker's batch in sequences of 128 tokens (split over the ranks; 16 is inner.batch_size's default)")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="islands-rank-memory-") as tmp:
        cfg = config_from_dict({"workers": 1, "rounds": 2, "seed": 0,
                                "model": {"n_layer": a.n_layer, "n_embd": a.n_embd, "n_head": 8, "block_size": 128},
                                "inner": {"steps": a.steps, "batch_size": a.batch, "device": "cpu", "parallel": "fsdp"},
                                "run_dir": str(Path(tmp) / "run")})
        run = Storage(cfg.run_dir)
        create_run(run, cfg)
        params = sum(t.numel() for t in load_checkpoint(run, L.global_weights(0))[0].values())
        base = _job(Path(tmp) / "jobs", 1, None)[0]["peak_mb"]
        one = _job(Path(tmp) / "jobs", 1, Assignment(run.url, 0, 0, L.global_weights(0), threads=1))
        many = _job(Path(tmp) / "jobs", a.ranks, Assignment(run.url, 1, 0, L.global_weights(0), threads=a.ranks))
    top = max(r["peak_mb"] for r in many)
    print(json.dumps({"ranks": a.ranks, "model": f"{a.n_layer}x{a.n_embd}", "batch": a.batch, "params_m": round(params / 1e6, 1),
                      "adamw_state_mb": round(8 * params / 2**20, 1), "baseline_mb": base,
                      "peak_mb_1_rank": one[0]["peak_mb"], "peak_mb_per_rank": [r["peak_mb"] for r in many],
                      "ratio": round(top / one[0]["peak_mb"], 3)}))


if __name__ == "__main__":
    main()
