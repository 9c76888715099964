"""`orchestrate merge` against mergekit, method by method, tensor by tensor (#28's oracle).

Installs nothing: give it a mergekit executable from its own venv (`--mergekit PATH/mergekit-yaml`;
mergekit pins its own torch and transformers). It builds a tiny Llama (Hugging Face directories,
fp32): a base and six fine-tuned copies (base + 0.01 N(0, 1)), then runs every method both
tools have, each tool in its own process, and prints per method the largest absolute difference
of any tensor, the largest distance in ulps, whether every tensor is bitwise equal, and each
CLI's wall time and peak RSS (wait4's ru_maxrss; at this size both are mostly start-up).

DARE and DELLA drop entries at random: the two tools' draws differ (ours is a seeded counter-based
stream, mergekit's torch's global generator), and their rescaling differs (ours 1/p per entry, as
the papers; mergekit's matches the L1 norm of the whole task vector), so those rows compare the
norm of the merged task vector instead (`tv_norm_ratio`, ours / mergekit), expected near 1.

    python -m bench.mergekit_parity --mergekit /path/to/mergekit-yaml [--json results.json]
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from bench.merge_throughput import llama_config, llama_shapes, run_child

DIMS = (64, 128, 256, 2)  # hidden, intermediate, vocab, layers


@dataclass(frozen=True)
class Case:
    ours: str
    mergekit: str
    flags: tuple[str, ...] = ()
    params: dict = field(default_factory=dict)
    """mergekit's global parameters."""
    model_params: tuple[dict, ...] = ({}, {}, {})
    """mergekit's per-model parameters (the weights go to ours as --weights)."""
    base: bool = True
    two: bool = False
    random: bool = False

    @property
    def k(self) -> int:
        return len(self.model_params)


CASES = [
    Case("average", "linear", ("--weights", "1,2,3"), base=False,
         model_params=({"weight": 1.0}, {"weight": 2.0}, {"weight": 3.0})),
    Case("task-arithmetic", "task_arithmetic", ("--weights", "0.5,0.3,0.2"),
         model_params=({"weight": 0.5}, {"weight": 0.3}, {"weight": 0.2})),
    Case("ties", "ties", ("--density", "0.3"), {"normalize": True},
         tuple({"weight": 1.0, "density": 0.3} for _ in range(3))),
    Case("ties", "ties", ("--density", "0.3", "--no-normalize", "--weights", "1,0.5,2"), {"normalize": False},
         ({"weight": 1.0, "density": 0.3}, {"weight": 0.5, "density": 0.3}, {"weight": 2.0, "density": 0.3})),
    Case("task-arithmetic", "task_arithmetic", ("--weights", "0.3,0.1,0.7,0.2,0.9,0.4"),
         model_params=tuple({"weight": w} for w in (0.3, 0.1, 0.7, 0.2, 0.9, 0.4))),  # K > 4: torch's sum order
    Case("ties", "ties", ("--density", "0.2", "--weights", "0.3,0.1,0.7,0.2,0.9,0.4"), {"normalize": True},
         tuple({"weight": w, "density": 0.2} for w in (0.3, 0.1, 0.7, 0.2, 0.9, 0.4))),
    Case("breadcrumbs", "breadcrumbs", ("--density", "0.8", "--gamma", "0.05"), {},
         tuple({"weight": 1.0, "density": 0.8, "gamma": 0.05} for _ in range(3))),
    Case("breadcrumbs-ties", "breadcrumbs_ties", ("--density", "0.8", "--gamma", "0.05"), {},
         tuple({"weight": 1.0, "density": 0.8, "gamma": 0.05} for _ in range(3))),
    Case("slerp", "slerp", ("--t", "0.3"), {"t": 0.3}, ({}, {}), base=False, two=True),
    Case("model-stock", "model_stock"),
    Case("dare-linear", "dare_linear", ("--density", "0.5"), {}, tuple({"weight": 1.0, "density": 0.5} for _ in range(3)),
         random=True),
    Case("dare-ties", "dare_ties", ("--density", "0.5"), {}, tuple({"weight": 1.0, "density": 0.5} for _ in range(3)),
         random=True),
    Case("della", "della", ("--density", "0.5", "--epsilon", "0.15"), {},
         tuple({"weight": 1.0, "density": 0.5, "epsilon": 0.15} for _ in range(3)), random=True),
    Case("della-linear", "della_linear", ("--density", "0.5", "--epsilon", "0.15"), {},
         tuple({"weight": 1.0, "density": 0.5, "epsilon": 0.15} for _ in range(3)), random=True),
]


def make_models(folder: Path) -> tuple[Path, list[Path]]:
    shapes = llama_shapes(*DIMS)
    g = torch.Generator().manual_seed(100)
    base = {k: torch.rand(s, generator=g) - 0.5 for k, s in shapes.items()}
    dirs = []
    for i, tensors in enumerate([base] + [{k: v + 0.01 * torch.randn(v.shape, generator=g) for k, v in base.items()}
                                          for _ in range(6)]):
        d = folder / ("base" if i == 0 else f"ft{i - 1}")
        d.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
        (d / "config.json").write_text(json.dumps(llama_config(*DIMS)))
        dirs.append(d)
    return dirs[0], dirs[1:]


def _yaml_value(v: object) -> str:
    return json.dumps(v) if not isinstance(v, bool) else str(v).lower()


def mergekit_config(case: Case, base: Path, fts: list[Path], path: Path) -> None:
    inputs = fts[:case.k]
    lines = [f"merge_method: {case.mergekit}", "dtype: float32"]
    if case.base or case.two:
        lines.append(f"base_model: {inputs[0] if case.two else base}")
    if case.params:
        lines += ["parameters:"] + [f"  {k}: {_yaml_value(v)}" for k, v in case.params.items()]
    lines.append("models:")
    for p, mp in zip(inputs, case.model_params):
        lines.append(f"  - model: {p}")
        if mp:
            lines += ["    parameters:"] + [f"      {k}: {_yaml_value(v)}" for k, v in mp.items()]
    path.write_text("\n".join(lines) + "\n")


def load_dir(d: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def compare(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor], base: dict[str, torch.Tensor],
            random: bool) -> dict:
    if sorted(ours) != sorted(theirs):
        return {"error": f"tensor names differ: {sorted(set(ours) ^ set(theirs))[:5]}"}
    diff, ulps, bitwise, num, den = 0.0, 0.0, True, 0.0, 0.0
    for n, a in ours.items():
        b = theirs[n].to(a.dtype)
        x, y = a.double().numpy(), b.double().numpy()
        diff = max(diff, float(np.abs(x - y).max()))
        spacing = np.spacing(np.maximum(np.abs(x), np.abs(y)).astype(np.float32)).astype(np.float64)
        ulps = max(ulps, float((np.abs(x - y) / spacing).max()))
        bitwise &= torch.equal(a, b)
        num += float(((a - base[n]).double() ** 2).sum())
        den += float(((b - base[n]).double() ** 2).sum())
    row = {"max_abs_diff": diff, "max_ulps": ulps, "bitwise": bitwise}
    if random:
        row["tv_norm_ratio"] = (num / den) ** 0.5 if den else float("nan")
    return row


def run_case(case: Case, base: Path, fts: list[Path], work: Path, mergekit: str) -> dict:
    tag = f"{case.ours}{'-' + '-'.join(f.strip('-') for f in case.flags) if case.flags else ''}"
    ours_out, mk_out, cfg = work / f"ours-{tag}", work / f"mk-{tag}", work / f"{tag}.yml"
    inputs = fts[:case.k]
    cmd = [sys.executable, "-m", "orchestrator.cli", "merge", *map(str, inputs), "--out", str(ours_out),
           "--method", case.ours, *case.flags, *(["--base", str(base)] if case.base else [])]
    ours_wall, ours_rss, _, _ = run_child(cmd)
    mergekit_config(case, base, fts, cfg)
    mk_wall, mk_rss, _, _ = run_child([mergekit, str(cfg), str(mk_out), "--no-copy-tokenizer", "--no-write-model-card",
                                       "--quiet", "--out-shard-size", "100B"])
    row = compare(load_dir(ours_out), load_dir(mk_out), load_dir(inputs[0] if case.two else base), case.random)
    return {"method": case.ours, "mergekit": case.mergekit, "flags": " ".join(case.flags), **row,
            "ours_s": ours_wall, "mergekit_s": mk_wall, "ours_rss_mb": ours_rss / 2**20, "mergekit_rss_mb": mk_rss / 2**20}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mergekit", required=True, help="the mergekit-yaml executable (mergekit in its own venv)")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="mergekit-parity-") as tmp:
        base, fts = make_models(Path(tmp))
        rows = [run_case(c, base, fts, Path(tmp), args.mergekit) for c in CASES]
    print(f"{'method':<18}{'flags':<48}{'max |diff|':>11}{'ulps':>10}{'bitwise':>9}{'tv ratio':>9}"
          f"{'ours s':>8}{'mk s':>7}{'ours MB':>9}{'mk MB':>7}")
    for r in rows:
        if "error" in r:
            print(f"{r['method']:<18}{r['flags']:<48}{r['error']}")
            continue
        ratio = f"{r['tv_norm_ratio']:.3f}" if "tv_norm_ratio" in r else "-"
        print(f"{r['method']:<18}{r['flags']:<48}{r['max_abs_diff']:>11.2e}{r['max_ulps']:>10.3g}{str(r['bitwise']):>9}"
              f"{ratio:>9}{r['ours_s']:>8.2f}{r['mergekit_s']:>7.2f}{r['ours_rss_mb']:>9.0f}{r['mergekit_rss_mb']:>7.0f}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
