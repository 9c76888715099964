"""Full-model DiLoCo vs LoRA-the-Explorer on the built-in model and corpus, at equal total samples.

Both runs go through the real round loop (`orchestrate submit`, local executor: real worker
processes, real files): same model, K workers, T rounds, H inner steps, batch, seed, so both see
exactly the same number of samples. LTE gives each worker one head of rank r per linear layer,
with K x r = the model width by default (the paper's "heads x rank around the width"). Reported:

- eval loss (held-out nats per byte) after every round;
- bytes moved per worker-round: the published contribution (from its manifest) vs full weights,
  plus the analytical r x (m + n) vs m x n per linear layer;
- per-worker trainable parameters and AdamW memory (2 float32 slots per trainable parameter),
  and what the frozen base costs the worker (float32, or bfloat16 with lte.base_dtype).

    python -m bench.lte_vs_full [--workers 4 --rounds 6 --inner-steps 25] [--set lte.alpha=2048 ...] [--lte-only]
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from core.config import load_config
from core.layout import RunLayout, manifest_key
from core.storage import Storage
from orchestrator.cli import main as orchestrate
from worker import lora
from worker.weights import build_model

L = RunLayout()
MODEL = {"model.n_layer": 2, "model.n_embd": 64, "model.n_head": 4, "model.block_size": 64}
LTE = {"lte.rank": 16, "lte.alpha": 2048, "lte.lr": 1e-4}  # 4 heads x rank 16 = width 64; s = 128


def run(algorithm: str, args: argparse.Namespace, root: Path) -> dict:
    sets = {**MODEL, "inner.batch_size": args.batch_size, "data.eval_batches": 8, "round.poll_s": 0.2,
            **(LTE if algorithm == "lte" else {})}
    argv = ["submit", "--executor", "local", "--run-dir", str(root / algorithm), "--workers", str(args.workers),
            "--rounds", str(args.rounds), "--inner-steps", str(args.inner_steps), "--set", f"algorithm={algorithm}"]
    for k, v in sets.items():
        argv += ["--set", f"{k}={v}"]
    for item in args.sets if algorithm == "lte" else []:
        argv += ["--set", item]
    if args.cache_dir:
        argv += ["--set", f"data.cache_dir={args.cache_dir}"]
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):
        code = orchestrate(argv)
    if code != 0:
        raise SystemExit(f"{algorithm} run failed (exit {code}); see {root / algorithm}")
    wall = time.perf_counter() - t0
    s = Storage(str(root / algorithm))
    info = s.read_json("run.json")
    records = [s.read_json(L.round_record(r)) for r in range(args.rounds)]
    sent = [s.read_json(manifest_key(L.contribution(r, w)))["bytes"] for r in range(args.rounds) for w in records[r]["merged"]]
    full = s.read_json(manifest_key(L.global_weights(0)))["bytes"]
    state = s.read_json(manifest_key(L.worker_state(0, args.rounds - 1)))["bytes"]
    tokens = sum(s.read_json(manifest_key(L.contribution(r, w)))["tokens"] for r in range(args.rounds) for w in records[r]["merged"])
    return {"algorithm": algorithm, "losses": [info["initial_eval_loss"]] + [rec["eval_loss"] for rec in records],
            "bytes_per_worker_round": statistics.mean(sent), "full_checkpoint_bytes": full, "state_file_bytes": state,
            "tokens": tokens, "wall_s": wall, "merge_s": statistics.mean(rec["merge_seconds"] for rec in records),
            "config": argv}


def memory(cfg) -> dict:
    """Per-worker parameter and optimizer figures, full model vs LTE heads."""
    full = build_model(cfg.model)
    n = sum(p.numel() for p in full.parameters())
    model = build_model(cfg.model)
    lora.attach_heads(model, cfg.lte, seed=0)
    sz = lora.sizes(model)
    frozen = sum(h.weight.numel() for _, h in lora.heads(model))
    layers = [(name, h.out_features, h.in_features) for name, h in lora.heads(model)]
    return {"full_params": n, "lte_trainable": sz["trainable"], "lte_head_params": sz["head_params"],
            "full_adamw_bytes": 8 * n, "lte_adamw_bytes": sz["optimizer_bytes"], "frozen_params": frozen,
            "layers": [(name, m, k, cfg.lte.rank * (m + k), m * k) for name, m, k in layers]}


def analytical(n_layer: int, n_head: int, n_embd: int, block_size: int, rank: int) -> tuple[int, int]:
    """(LTE contribution, full model) parameter counts of a bigger built-in model, built on the meta device."""
    from core.config import Config, ModelConfig
    mc = ModelConfig(n_layer=n_layer, n_head=n_head, n_embd=n_embd, block_size=block_size)
    with torch.device("meta"):
        full = sum(p.numel() for p in build_model(mc).parameters())
    return sum(torch.Size(s).numel() for s in lora.contribution_shapes(Config(model=mc), rank).values()), full


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--inner-steps", type=int, default=25)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--set", dest="sets", action="append", default=[], help="extra lte.* overrides for the LTE run")
    p.add_argument("--cache-dir", help="corpus cache (default: islands' own)")
    p.add_argument("--keep", help="keep both run directories here (default: a temporary folder)")
    p.add_argument("--lte-only", action="store_true", help="skip the full-model run (for LTE ablations)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(1)
    with contextlib.ExitStack() as stack:
        root = Path(args.keep) if args.keep else Path(stack.enter_context(tempfile.TemporaryDirectory()))
        results = ([] if args.lte_only else [run("diloco", args, root)]) + [run("lte", args, root)]
        cfg = load_config(None, {**MODEL, **LTE, "algorithm": "lte"}, args.sets)
        mem = memory(cfg)
    if args.json:
        print(json.dumps({"runs": results, "memory": mem}, indent=1))
        return
    t = results[-1]
    if args.lte_only:
        print(f"lte {' '.join(args.sets) or '(defaults of the benchmark)'}: eval loss " + " ".join(f"{v:.4f}" for v in t["losses"]))
        return
    d = results[0]
    print(f"model {cfg.model.n_layer}x{cfg.model.n_head}x{cfg.model.n_embd} (block {cfg.model.block_size}), "
          f"{args.workers} workers x {args.rounds} rounds x {args.inner_steps} steps x batch {args.batch_size}; "
          f"LTE rank {cfg.lte.rank} x {args.workers} heads, alpha {cfg.lte.alpha:g} (s = {cfg.lte.alpha / cfg.lte.rank:g}), "
          f"lte.lr {cfg.lte.lr:g}, a_init {cfg.lte.a_init}; tokens: diloco {d['tokens']}, lte {t['tokens']}")
    print("\n| round | " + " | ".join(str(i) for i in range(args.rounds + 1)) + " |")
    print("|---|" + "---|" * (args.rounds + 1))
    for r in results:
        print(f"| {r['algorithm']} eval loss | " + " | ".join(f"{v:.4f}" for v in r["losses"]) + " |")
    print("\n| per worker-round | full-model DiLoCo | LTE | LTE / full |")
    print("|---|---|---|---|")
    rows = [("bytes published (contribution)", d["bytes_per_worker_round"], t["bytes_per_worker_round"]),
            ("own state file (AdamW, + heads for LTE)", d["state_file_bytes"], t["state_file_bytes"]),
            ("trainable parameters", mem["full_params"], mem["lte_trainable"]),
            ("AdamW state bytes (2 x fp32)", mem["full_adamw_bytes"], mem["lte_adamw_bytes"])]
    for name, a, b in rows:
        print(f"| {name} | {a:,.0f} | {b:,.0f} | {b / a:.3f} |")
    print(f"\nLTE frozen base on the worker: {mem['frozen_params']:,} parameters ({4 * mem['frozen_params']:,} bytes in "
          f"float32, {2 * mem['frozen_params']:,} with lte.base_dtype=bfloat16); of the {mem['lte_trainable']:,} "
          f"trainable, {mem['lte_head_params']:,} are heads.")
    print("\n| layer | out x in | head r x (out + in) | full out x in |")
    print("|---|---|---|---|")
    for name, m, k, head, full in mem["layers"]:
        print(f"| {name} | {m} x {k} | {head:,} | {full:,} |")
    for shape in ((12, 12, 768, 1024, 64), (24, 16, 1024, 1024, 64)):
        sent, full = analytical(*shape)
        print(f"analytical, built-in model {shape[0]}x{shape[1]}x{shape[2]} (block {shape[3]}), rank {shape[4]}: "
              f"{4 * sent / 1e6:.1f} MB per worker-round vs {4 * full / 1e6:.1f} MB full ({sent / full:.3f})")
    print(f"\nwall: diloco {d['wall_s']:.0f}s, lte {t['wall_s']:.0f}s; mean merge: diloco {d['merge_s']:.2f}s, lte {t['merge_s']:.2f}s")


if __name__ == "__main__":
    main()
