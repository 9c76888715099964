"""Host memory a sharded (FSDP) worker's ranks take to build their model: meta-device build
against building the whole model on the CPU first (what a sharded worker did before).

Each way is a real 2-rank submitit local job (gloo) that builds the built-in GPT of the given size
and shards it with fully_shard, then writes its shard (as loading the base does); each rank reports
how far its peak resident memory rose from before the build (ru_maxrss, whole process). On a node of R GPUs the CPU-first build holds R whole models
in host memory at once; the meta build holds each rank's shard only.

    python -m bench.sharded_memory [--n-layer 12 --n-embd 1024] [--ranks 2]
"""
from __future__ import annotations

import argparse
import json
import resource
import tempfile
from pathlib import Path

import submitit
import torch

from core.config import config_from_dict


def _build(model: dict, meta: bool) -> dict:
    """In each rank of the job: join, build, shard; the rise of this process's peak RSS in MB."""
    from worker.ranks import join
    from worker.sharded import ShardedModel, shard
    from worker.weights import build_model

    cfg = config_from_dict({"model": model, "inner": {"device": "cpu", "parallel": "fsdp"}})
    ranks = join("cpu")
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if meta:
        built = ShardedModel(cfg, 0, ranks).build(torch.device("cpu"))
    else:
        with torch.device("cpu"):
            built = build_model(cfg.model, pretrained=False)
        shard(built)
    with torch.no_grad():  # as the base's scatter does: every page of the rank's shard written
        for p in built.parameters():
            p.to_local().zero_()
    rise = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    whole = sum(p.numel() for p in built.parameters()) * 4 / 2**20  # fp32 MB of the full model (DTensor numel)
    return {"rank": ranks.rank, "peak_rise_mb": round(rise, 1), "model_mb": round(whole, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n-layer", type=int, default=12)
    ap.add_argument("--n-embd", type=int, default=1024)
    ap.add_argument("--ranks", type=int, default=2)
    a = ap.parse_args()
    model = {"n_layer": a.n_layer, "n_embd": a.n_embd, "n_head": 8, "block_size": 128}
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, meta in (("cpu_first", False), ("meta", True)):
            ex = submitit.LocalExecutor(folder=Path(tmp) / name / "%j")
            ex.update_parameters(tasks_per_node=a.ranks, timeout_min=20)
            out[name] = sorted(ex.submit(_build, model, meta).results(), key=lambda r: r["rank"])
    cpu_first = max(r["peak_rise_mb"] for r in out["cpu_first"])
    meta = max(r["peak_rise_mb"] for r in out["meta"])
    print(json.dumps({"ranks": a.ranks, "model": f"{a.n_layer}x{a.n_embd}", "model_mb": out["meta"][0]["model_mb"],
                      "peak_rise_mb_cpu_first": cpu_first, "peak_rise_mb_meta": meta,
                      "ratio": round(meta / cpu_first, 3), "per_rank": out}))


if __name__ == "__main__":
    main()
