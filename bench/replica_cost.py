"""What a worker's replica of the merge costs against reading the global weights: seconds on this
machine's CPU, per model size, and the storage bandwidth below which the replica is the faster way.

A transformer-shaped global (per layer: attention [d, 3d] and [d, d], MLP [d, 4d] and [4d, d]) and
K top-k contributions coded against it (core.codec, 1/16 at 2 bits) are written to --dir; the real
merge (merge.rounds.merge_round, outer Nesterov) writes the next global and its outer state, and a
record names them as the service's would. Then, alternating, `repeats` times each: the dense read
a worker does today (codec.load_weights: read, hash, verify) and the replica's next_global
(worker/replica.py: read and check the K contributions, fold, outer step, hash), from the page cache
both, after one of each not counted (a worker has made its first calls by then). The baseline is the dense read, in the same run; a shared filesystem's bandwidth B makes the
dense read W / B, the replica's reads K x c / B on top of its CPU time, hence the break-even
B = (W - K c) / (replica - dense read from cache).

    python -m bench.replica_cost [--hidden 512,1024] [--layers 8] [--k 8] [--dir /var/tmp] [--repeats 3]
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

from core import codec
from core.assignment import Assignment
from core.checkpoint import read_manifest
from core.checkpoint_writer import write_checkpoint
from core.config import load_config
from core.layout import RunLayout
from core.records import RoundRecord
from core.storage import Storage
from merge.round_spec import Contribution, RoundSpec
from merge.rounds import merge_round
from worker.replica import Replica

L = RunLayout()
SETS = ["round.contribution=delta", "round.codec=topk"]


def model(hidden: int, layers: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = {}
    for i in range(layers):
        for name, shape in (("qkv", (hidden, 3 * hidden)), ("proj", (hidden, hidden)), ("up", (hidden, 4 * hidden)),
                            ("down", (4 * hidden, hidden)), ("ln", (hidden,))):
            out[f"h.{i}.{name}"] = torch.randn(shape, generator=g) * 0.02
    return out


def make_round(s: Storage, hidden: int, layers: int, k: int) -> tuple[Replica, int, int]:
    """Round 0 merged as the service does; a replica holding global_0. (the replica, W, K x c)."""
    cfg = load_config(None, {"workers": k, "rounds": 2}, SETS)
    g0 = model(hidden, layers)
    write_checkpoint(s, L.global_weights(0), g0, manifest={"round": 0})
    d0 = read_manifest(s, L.global_weights(0))["digest"]
    enc = codec.encoding_for(cfg.round, d0, 0)
    inputs = []
    for w in range(k):
        gen = torch.Generator().manual_seed(w + 1)
        trained = {n: t + 1e-3 * torch.randn(t.shape, generator=gen) for n, t in g0.items()}
        tensors, meta, _ = codec.encode(g0, trained, enc)
        write_checkpoint(s, L.contribution(0, w), tensors, metadata=meta,
                         manifest={"round": 0, "worker": w, "base": L.global_weights(0), "base_digest": d0})
        inputs.append(Contribution(w, L.contribution(0, w), 1.0))
    spec = RoundSpec(base=L.global_weights(0), out=L.global_weights(1), outer=cfg.outer, state_out=L.outer_state(1),
                     manifest={"round": 1})
    result = merge_round(s, spec, inputs)
    sizes = {str(w): read_manifest(s, L.contribution(0, w))["bytes"] for w in range(k)}
    RoundRecord(round=0, merged=list(range(k)), dropped=[], rejected=[], rejected_reasons={}, dropped_reasons={},
                late=[], reason="bench", merge_seconds=result.seconds, bytes_read=result.bytes_read,
                outer_grad_norm=result.outer_grad_norm, weights={str(w): 1.0 for w in range(k)}, submitted_at=0.0,
                merge_started_at=0.0, committed_at=0.0, global_digest=result.manifest["digest"],
                merge_order=result.order, contrib_digest={str(w): read_manifest(s, L.contribution(0, w))["digest"]
                                                          for w in range(k)},
                folded=[], fold_rejected=[], worker_idle_s={}, jobs={}, contribution_bytes=sizes).save(s)
    return Replica.of(cfg, world=1, collective=False), read_manifest(s, L.global_weights(1))["bytes"], sum(sizes.values())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", default="512,1024")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    print(f"K = {args.k} top-k contributions (1/16, 2 bits), outer Nesterov; {torch.get_num_threads()} threads; "
          "seconds from the page cache, median of the repeats")
    print(f"{'params':>8} {'W MB':>7} {'K c MB':>7} {'read s':>7} {'replica s':>9} {'replica/read':>12} {'break-even B':>12}")
    for hidden in (int(h) for h in args.hidden.split(",")):
        with tempfile.TemporaryDirectory(prefix="islands-replica-", dir=args.dir) as tmp:
            s = Storage(tmp)
            rep, w_bytes, kc = make_round(s, hidden, args.layers, args.k)
            task = Assignment(s.url, 1, 0, L.global_weights(1), persistent=True)
            digest = read_manifest(s, L.global_weights(1))["digest"]
            reads, replays = [], []
            for _ in range(args.repeats + 1):  # the first of each is a warm-up (imports, first calls), not counted
                t0 = time.perf_counter()
                codec.load_weights(s, L.global_weights(1))
                reads.append(time.perf_counter() - t0)
                base = codec.load_weights(s, L.global_weights(0))  # global_0 held, as after the worker's round 0
                rep.off = None
                rep.hold(Assignment(s.url, 0, 0, L.global_weights(0), persistent=True), base,
                         read_manifest(s, L.global_weights(0))["digest"])
                t0 = time.perf_counter()
                ok = rep.next_global(s, task, digest) is not None
                replays.append(time.perf_counter() - t0)
                assert ok, "the replica was not used: see the log"
            read, replay = statistics.median(reads[1:]), statistics.median(replays[1:])
            params = sum(t.numel() for t in model(hidden, args.layers).values())
            even = (w_bytes - kc) / max(replay - read, 1e-9)
            print(f"{params / 1e6:7.1f}M {w_bytes / 1e6:7.1f} {kc / 1e6:7.1f} {read:7.3f} {replay:9.3f} "
                  f"{replay / read:12.1f} {even / 1e6:9.0f} MB/s", flush=True)


if __name__ == "__main__":
    main()
