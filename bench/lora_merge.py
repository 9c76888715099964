"""LoRA adapters in `orchestrate merge`: time and peak RSS of folding adapters into a base model and
of merging K adapters into one, against the plainest Python copy of the base (safetensors'
load_file then save_file: the floor of any tool that rewrites it) and, where PEFT is importable,
PEFT's own fold (`PeftModel.from_pretrained(...).merge_and_unload()` then
`save_pretrained`), whose output is compared tensor by tensor with ours.

It builds a Llama-shaped Hugging Face directory (fp32, random) and K adapters in PEFT's layout
(LoRA rank `--rank` on every attention and MLP projection), each in a child process; every
measurement is one child (wait4's ru_maxrss), caches warm.

    python -m bench.lora_merge [--dims 1024,2816,16384,8] [--rank 16] [--k 4] [--json PATH]
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from bench.merge_throughput import llama_config, llama_shapes, run_child

PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make(folder: Path, dims: tuple[int, int, int, int], rank: int, k: int) -> None:
    g = torch.Generator().manual_seed(0)
    shapes = llama_shapes(*dims)
    (folder / "base").mkdir(parents=True)
    save_file({n: torch.randn(s, generator=g) * 0.02 for n, s in shapes.items()},
              str(folder / "base" / "model.safetensors"), metadata={"format": "pt"})
    (folder / "base" / "config.json").write_text(json.dumps(llama_config(*dims)))
    for i in range(k):
        d = folder / f"lora{i}"
        d.mkdir()
        tensors = {}
        for n, (out_f, in_f) in ((n, s) for n, s in shapes.items() if n.rsplit(".", 2)[-2] in PROJ):
            m = "base_model.model." + n[: -len(".weight")]
            tensors[m + ".lora_A.weight"] = torch.randn(rank, in_f, generator=g) * 0.02
            tensors[m + ".lora_B.weight"] = torch.randn(out_f, rank, generator=g) * 0.02
        save_file(tensors, str(d / "adapter_model.safetensors"), metadata={"format": "pt"})
        (d / "adapter_config.json").write_text(json.dumps(
            {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(PROJ),
             "task_type": "CAUSAL_LM", "base_model_name_or_path": str(folder / "base")}))


def plain_copy(base: str, out: str) -> None:
    Path(out).mkdir()
    save_file(load_file(str(Path(base) / "model.safetensors")), str(Path(out) / "model.safetensors"),
              metadata={"format": "pt"})


def peft_fold(base: str, adapter: str, out: str) -> None:
    from peft import PeftModel
    from transformers import LlamaForCausalLM
    model = LlamaForCausalLM.from_pretrained(base, dtype=torch.float32)
    PeftModel.from_pretrained(model, adapter).merge_and_unload().save_pretrained(out)


def has_peft() -> bool:
    return all(importlib.util.find_spec(m) is not None for m in ("peft", "transformers"))


def row(name: str, cmd: list[str], base_bytes: int, floor_s: float | None = None) -> dict:
    wall, rss, cpu, _ = run_child(cmd)
    r = {"case": name, "wall_s": round(wall, 2), "cpu_s": round(cpu, 2), "peak_rss_mb": round(rss / 2**20),
         "rss_over_base": round(rss / base_bytes, 2)}
    if floor_s:
        r["time_vs_plain_copy"] = round(wall / floor_s, 2)
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--child", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    ap.add_argument("--dims", default="1024,2816,16384,8", help="hidden,intermediate,vocab,layers")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--k", type=int, default=4, help="adapters merged into one, and folded together")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()
    if args.child:
        if args.child[0] == "make":
            make(Path(args.child[1]), tuple(int(x) for x in args.child[2].split(",")), int(args.child[3]),
                 int(args.child[4]))
        elif args.child[0] == "copy":
            plain_copy(*args.child[1:])
        else:
            peft_fold(*args.child[1:])
        return
    me = [sys.executable, "-m", "bench.lora_merge", "--child"]
    cli = [sys.executable, "-m", "orchestrator.cli", "merge"]
    with tempfile.TemporaryDirectory(prefix="lora-merge-") as tmp:
        t = Path(tmp)
        run_child([*me, "make", tmp, args.dims, str(args.rank), str(args.k)])
        base = t / "base"
        base_bytes = (base / "model.safetensors").stat().st_size
        loras = [str(t / f"lora{i}") for i in range(args.k)]
        floor = row("load_file + save_file the base", [*me, "copy", str(base), str(t / "copy")], base_bytes)
        rows = [floor,
                row("fold 1 adapter", [*cli, loras[0], "--base", str(base), "--out", str(t / "fold1")], base_bytes,
                    floor["wall_s"]),
                row(f"fold {args.k} adapters", [*cli, *loras, "--base", str(base), "--out", str(t / "foldk")],
                    base_bytes, floor["wall_s"]),
                row(f"merge {args.k} adapters into one", [*cli, *loras, "--out", str(t / "mergedk")], base_bytes)]
        if has_peft():
            rows.append(row("PEFT merge_and_unload, 1 adapter", [*me, "peft", str(base), loras[0], str(t / "peft1")],
                            base_bytes, floor["wall_s"]))
            ours, theirs = load_file(str(t / "fold1" / "model.safetensors")), load_file(str(t / "peft1" / "model.safetensors"))
            rows[-1]["max_abs_diff_vs_ours"] = max((ours[n] - theirs[n]).abs().max().item() for n in ours)
            rows[-1]["bitwise_vs_ours"] = all(torch.equal(ours[n], theirs[n]) for n in ours)
    print(f"base {base_bytes / 2**20:.0f} MiB ({args.dims}), {args.k} adapters of rank {args.rank}")
    for r in rows:
        extra = ", ".join(f"{k} {v}" for k, v in r.items() if k not in ("case", "wall_s", "cpu_s", "peak_rss_mb"))
        print(f"{r['case']:<36}{r['wall_s']:>7.2f} s{r['cpu_s']:>7.2f} cpu-s{r['peak_rss_mb']:>7} MB   {extra}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
