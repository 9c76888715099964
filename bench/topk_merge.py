"""Merge time of K top-k contributions against K int8 deltas of the same model.

K workers' outer gradients (small random perturbations of a Llama-shaped model: bench.merge_throughput's
shapes) are coded twice, as `round.codec: int8` deltas and as `topk` (default settings), and
written to local disk with the round's global weights. One DiLoCo round (Nesterov outer step) is
then merged from each set, alternating, with no running sum (all K read after the last lands, as
a resumed service does) and every file evicted from the page cache first, so reads come from the
disk. A top-k contribution is scattered into the running sum (merge.rounds.RunningSum._add_sparse),
an int8 one decoded densely and added. Also reported: bytes per contribution, and the worker's
time to code one (codec.encode, error feedback on), against int8's. With `--pruned KEEP`, also
fp32 and int8 deltas pruned to KEEP of each row (round.prune_keep: the same sparse format).

    python -m bench.topk_merge [--k 8] [--dims 1024,2816,8192,4] [--repeats 3] [--dir /tmp] [--pruned 0.5]
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench.merge_throughput import evict, llama_shapes
from core import codec
from core.checkpoint import read_manifest
from core.checkpoint_writer import write_checkpoint
from core.config import OuterConfig, RoundConfig
from core.storage import Storage
from merge.round_spec import RoundSpec
from merge.rounds import Contribution, merge_round

OUTER = OuterConfig(optimizer="nesterov", lr=0.7, momentum=0.9)
_DEFAULT = RoundConfig()
CODINGS = {"int8": codec.Encoding("int8", 1.0, ""), "topk": codec.Encoding("topk", 1.0, "", _DEFAULT.topk, _DEFAULT.bits)}


def setup(root: Path, k: int, dims: tuple[int, int, int, int], codings: dict[str, codec.Encoding]
          ) -> tuple[Storage, dict[str, list[Contribution]], dict]:
    s = Storage(str(root))
    g = torch.Generator().manual_seed(0)
    base = {n: torch.rand(sh, generator=g) - 0.5 for n, sh in llama_shapes(*dims).items()}
    write_checkpoint(s, "g0.safetensors", base, manifest={"round": 0})
    sha = read_manifest(s, "g0.safetensors")["digest"]
    sets: dict[str, list[Contribution]] = {name: [] for name in codings}
    encode_s: dict[str, list[float]] = {name: [] for name in codings}
    for i in range(k):
        w = {n: t + 0.01 * (torch.rand(t.shape, generator=g) - 0.5) for n, t in base.items()}
        for name, enc in codings.items():
            t0 = time.perf_counter()
            tensors, meta, _ = codec.encode(base, w, codec.Encoding(enc.codec, enc.keep, sha, enc.topk, enc.bits),
                                            {} if name == "topk" else None, 0.95)
            encode_s[name].append(time.perf_counter() - t0)
            key = f"{name.replace(' ', '_')}_{i}.safetensors"
            write_checkpoint(s, key, tensors, metadata=meta, manifest={"round": 0, "worker": i, "base": "g0.safetensors"})
            sets[name].append(Contribution(i, key, 1000.0 + i))
    info = {"params": sum(t.numel() for t in base.values()),
            "bytes": {name: read_manifest(s, cs[0].key)["bytes"] for name, cs in sets.items()},
            "encode_s": {name: statistics.median(v) for name, v in encode_s.items()}}
    return s, sets, info


def merge_once(s: Storage, root: Path, contribs: list[Contribution], out: str) -> float:
    (root / out).unlink(missing_ok=True)
    (root / out).with_suffix(".json").unlink(missing_ok=True)
    evict(sorted(root.glob("*.safetensors")))
    t0 = time.perf_counter()
    res = merge_round(s, RoundSpec(base="g0.safetensors", out=out, outer=OUTER), contribs)
    assert res.merged == [c.worker for c in contribs], res.rejected
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--k", type=int, default=8)
    p.add_argument("--dims", default="1024,2816,8192,4", help="hidden,intermediate,vocab,layers")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dir", default=None, help="where the checkpoints go (default: a temporary directory)")
    p.add_argument("--pruned", type=float, default=None, help="also fp32 and int8 deltas keeping this share of each row")
    args = p.parse_args()
    codings = dict(CODINGS)
    if args.pruned is not None:
        codings.update({f"{c} keep {args.pruned:g}": codec.Encoding(c, args.pruned, "") for c in ("fp32", "int8")})
    root = Path(tempfile.mkdtemp(prefix="bench-topk-merge-", dir=args.dir))
    try:
        s, sets, info = setup(root, args.k, tuple(int(x) for x in args.dims.split(",")), codings)
        times: dict[str, list[float]] = {name: [] for name in codings}
        for _ in range(args.repeats):
            for name, contribs in sets.items():
                times[name].append(merge_once(s, root, contribs, f"out_{name.replace(' ', '_')}.safetensors"))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    med = {name: statistics.median(v) for name, v in times.items()}
    print(json.dumps({"k": args.k, "params": info["params"], "bytes_per_contribution": info["bytes"],
                      "fp32_over_topk_bytes": round(4 * info["params"] / info["bytes"]["topk"], 1),
                      "merge_s": {n: round(v, 3) for n, v in med.items()},
                      "merge_over_int8": {n: round(v / med["int8"], 3) for n, v in med.items()},
                      "encode_s": {n: round(v, 3) for n, v in info["encode_s"].items()},
                      "runs_s": {n: [round(x, 3) for x in v] for n, v in times.items()}}, indent=1))


if __name__ == "__main__":
    main()
