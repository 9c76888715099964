"""Compressed contributions: bytes per worker-round, and what each codec costs in eval loss.

One short DiLoCo run per variant, in this process, with the real pieces in the real order:
`worker.train.run_worker` trains each worker and publishes its contribution (weights, or the
outer gradient coded as round.codec / round.prune_keep: core/codec.py), `merge.rounds.merge_round`
merges the round (the call the merge service makes), and the service's evaluator scores the new
global model on the held-out batches. Every variant has the same seed, data, schedule and
outer optimizer, so the only difference is the coding. Workers run one after another (the
local executor would run them at once; the arithmetic is the same).

Reported: the contribution's bytes (from its manifest, the file's header included) per
worker-round and how many times fewer than the fp32 weights; the worker's seconds coding it, as a
share of its round (the largest over the run); the final eval loss, against the first variant's;
and the data bytes for bigger built-in models, computed from the shapes alone
(core.codec.stored_specs) since they are not trained here.

    python -m bench.codecs [--workers 4 --rounds 6 --inner-steps 25] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import tempfile
import time
from pathlib import Path

import torch

from core import codec
from core.checkpoint import DTYPES, ITEMSIZE
from core.config import ModelConfig, load_config
from core.layout import RunLayout, manifest_key
from core.storage import Storage
from core.assignment import Assignment
from merge.rounds import Contribution, merge_round
from merge.round_spec import RoundSpec
from orchestrator.run_models import Evaluator, create_run
from worker.train import run_worker
from worker.weights import build_model

L = RunLayout()
D = {"round.contribution": "delta"}
T = {**D, "round.codec": "topk"}
VARIANTS: dict[str, dict] = {  # name: config overrides
    "weights (fp32)": {},
    "delta fp32": D,
    "delta bf16": {**D, "round.codec": "bf16"},
    "delta int8": {**D, "round.codec": "int8"},
    "delta int8, keep 0.25": {**D, "round.codec": "int8", "round.prune_keep": 0.25},
    "topk 1/16, 2 bits, feedback 0.9 (default)": T,
    "topk 1/16, 2 bits, no feedback": {**T, "round.error_feedback": 0.0},
    "topk 1/16, 4 bits, feedback 0.9": {**T, "round.bits": 4},
    "topk 1/32, 2 bits, feedback 0.9": {**T, "round.topk": 1 / 32},
    "topk 1/64, 2 bits, feedback 0.9": {**T, "round.topk": 1 / 64},
    "topk 1/128, 2 bits, feedback 0.9": {**T, "round.topk": 1 / 128},
    "delta int8, keep 0.1": {**D, "round.codec": "int8", "round.prune_keep": 0.1},
}


def encoding(over: dict) -> codec.Encoding | None:
    """How a variant codes its contributions (None: plain weights), from its config overrides."""
    rc = load_config(None, over).round
    if rc.contribution == "weights":
        return None
    return codec.encoding_for(rc, "")


def run_variant(name: str, args: argparse.Namespace, root: Path) -> dict:
    run = root / f"v{list(VARIANTS).index(name)}"
    cfg = load_config(None, {"workers": args.workers, "rounds": args.rounds, "inner.steps": args.inner_steps,
                             "run_dir": str(run), **VARIANTS[name],
                             **({"data.cache_dir": args.cache_dir} if args.cache_dir else {})}, args.sets)
    s = Storage(str(run))
    create_run(s, cfg)
    ev = Evaluator(cfg)
    losses, sent, t0 = [ev.metrics(s, L.global_weights(0))["loss"]], [], time.perf_counter()
    encode = []  # seconds to code a contribution, as a share of the worker's round
    for r in range(args.rounds):
        contribs = []
        for w in range(args.workers):
            run_worker(Assignment(s.url, r, w, L.global_weights(r), threads=args.threads))
            m = s.read_json(manifest_key(L.contribution(r, w)))
            sent.append(m["bytes"])
            encode.append((m.get("contribution") or {}).get("encode_s", 0.0) / m["seconds"])
            contribs.append(Contribution(w, L.contribution(r, w), float(m["tokens"])))
        spec = RoundSpec(base=L.global_weights(r), out=L.global_weights(r + 1), outer=cfg.outer,
                         state_in=L.outer_state(r) if r else None, state_out=L.outer_state(r + 1), metadata=ev.metadata,
                         manifest={"round": r + 1})
        res = merge_round(s, spec, contribs)
        assert res.merged == list(range(args.workers)), res.rejected
        losses.append(ev.metrics(s, L.global_weights(r + 1))["loss"])
    return {"variant": name, "losses": losses, "bytes": sum(sent) / len(sent), "encode_share": max(encode),
            "weights_bytes": s.read_json(manifest_key(L.global_weights(0)))["bytes"], "seconds": time.perf_counter() - t0}


def shape_bytes(model: ModelConfig, name: str) -> int:
    """Data bytes of one contribution of `model` coded as variant `name` (headers left out), from shapes alone."""
    with torch.device("meta"):
        sd = build_model(model).state_dict()
    ref = {n: (DTYPES[torch.float32 if t.is_floating_point() else t.dtype], tuple(t.shape)) for n, t in sd.items()}
    enc = encoding(VARIANTS[name])
    specs = ref if enc is None else codec.stored_specs(ref, enc)
    return sum(ITEMSIZE[d] * math.prod(shape) for d, shape in specs.values())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--inner-steps", type=int, default=25)
    p.add_argument("--threads", type=int, default=1, help="torch threads of each (sequential) worker")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                   help="any config key, e.g. --set model.n_embd=64 (applies to every variant)")
    p.add_argument("--variants", help="comma-separated indices into VARIANTS (default: all)")
    p.add_argument("--cache-dir", help="corpus cache (data.cache_dir)")
    p.add_argument("--json", help="write the results here too")
    args = p.parse_args()
    logging.disable(logging.INFO)  # the workers log every round
    with tempfile.TemporaryDirectory(prefix="bench-codecs-") as tmp:
        chosen = [list(VARIANTS)[int(i)] for i in args.variants.split(",")] if args.variants else list(VARIANTS)
        rows = [run_variant(v, args, Path(tmp)) for v in chosen]
    base = rows[0]
    print(f"K={args.workers} workers x {args.rounds} rounds x {args.inner_steps} inner steps, built-in model "
          f"{' '.join(args.sets)} ({base['weights_bytes']:,} bytes of weights)\n")
    print("| contribution | bytes / worker-round | fp32 weights / bytes | coding / round | final eval loss | vs first row |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['variant']} | {row['bytes']:,.0f} | {base['bytes'] / row['bytes']:.1f}x | "
              f"{100 * row['encode_share']:.2f}% | {row['losses'][-1]:.4f} | "
              f"{100 * (row['losses'][-1] / base['losses'][-1] - 1):+.2f}% |")
    bigger = [ModelConfig(), ModelConfig(n_layer=12, n_head=12, n_embd=768, block_size=1024),
              ModelConfig(n_layer=24, n_head=16, n_embd=1024, block_size=1024)]
    print("\n| fp32 weights / data bytes, from shapes | " + " | ".join(VARIANTS) + " |")
    print("|---|" + "---|" * len(VARIANTS))
    for m in bigger:
        full = shape_bytes(m, "weights (fp32)")
        print(f"| {m.n_layer} x {m.n_head} x {m.n_embd} ({full / 4e6:.3g}M params) | " + " | ".join(
            f"{full / shape_bytes(m, v):.1f}x" for v in VARIANTS) + " |")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
