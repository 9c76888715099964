"""`orchestrate merge`: the command-line glue of merge.manual (parsing and printing only)."""
from __future__ import annotations

import argparse
import textwrap
from typing import Any

from core.config import OuterConfig
from merge import DEFAULT_BUFFER_BYTES, METHOD_NAMES, defaults_of  # torch-free: `--help` never loads torch
from orchestrator.console import HelpFormatter

OUTER = OuterConfig()  # the defaults --help shows

EXAMPLES = """examples:
  orchestrate merge a.safetensors b.safetensors --out soup.safetensors
  orchestrate merge ft1/ ft2/ ft3/ --base pretrained/ --method ties \\
      --density 0.2 --out merged/
  orchestrate merge ft1/ ft2/ --base pretrained/ --method dare-ties \\
      --density 0.3 --seed 7 --out merged/
  # two LoRA adapters into one, their ranks concatenated:
  orchestrate merge lora1/ lora2/ --weights 1,2 --out lora_merged/
  # an adapter folded into its base:
  orchestrate merge lora1/ --base pretrained/ --out merged/
  orchestrate merge s3://bucket/w0.safetensors s3://bucket/w1.safetensors \\
      --method outer --base g.safetensors \\
      --outer-state outer_state.safetensors --out g_next.safetensors
"""


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "merge", help="merge existing checkpoints (.safetensors files, Hugging Face model dirs, LoRA adapters)",
        description=textwrap.fill(
            "Merge checkpoints tensor by tensor (memory does not grow with their number). Inputs and OUT may be any "
            "fsspec URL; OUT follows the first input's layout (one file if OUT ends in .safetensors, else a model "
            "directory). Nothing is written unless the whole merge succeeds.", 78),
        epilog=EXAMPLES, formatter_class=HelpFormatter)
    p.add_argument("inputs", nargs="+", metavar="INPUT", help=".safetensors file, Hugging Face model directory or PEFT LoRA adapter directory")
    p.add_argument("--out", "-o", required=True, help="output .safetensors file or model directory")
    p.add_argument("--method", "-m", default="average", choices=METHOD_NAMES, metavar="METHOD",
                   help="merge method, one of %(choices)s (default: average)")
    p.add_argument("--weights", help="comma-separated weight per input (default: all 1)")
    p.add_argument("--base", help="the inputs' common starting point (task-vector methods, model-stock, outer); "
                                  "for LoRA adapters, the model to fold them into")
    p.add_argument("--density", type=float, help=f"fraction of each task vector kept ({defaults_of('density')})")
    p.add_argument("--gamma", type=float, help=f"breadcrumbs: fraction of largest entries dropped ({defaults_of('gamma')})")
    p.add_argument("--epsilon", type=float,
                   help=f"della: keep probabilities range over density +/- epsilon by magnitude rank ({defaults_of('epsilon')})")
    p.add_argument("--seed", type=int, help=f"dare, della: seed of the random drop, recorded in the output ({defaults_of('seed')})")
    p.add_argument("--rescale", action=argparse.BooleanOptionalAction, default=None,
                   help=f"dare, della: divide kept entries by their keep probability ({defaults_of('rescale')})")
    p.add_argument("--scale", type=float, help=f"factor on the merged task vector ({defaults_of('scale')})")
    p.add_argument("--normalize", action=argparse.BooleanOptionalAction, default=None,
                   help="task-vector methods: divide the summed task vectors by the weights (with a sign election: "
                        f"by the weights of the agreeing entries), mergekit's normalize ({defaults_of('normalize')})")
    p.add_argument("--t", type=float, dest="slerp_t",
                   help="slerp: where between the two inputs, 0 (the first) to 1 (the second) (default 0.5)")
    p.add_argument("--outer-optimizer", choices=["nesterov", "sgd", "sgdm", "adam"],
                   help=f"outer: the torch.optim optimizer of the outer step (default {OUTER.optimizer})")
    p.add_argument("--outer-lr", type=float, help=f"outer: learning rate (default {OUTER.lr})")
    p.add_argument("--outer-momentum", type=float, help=f"outer: momentum for nesterov/sgdm (default {OUTER.momentum})")
    p.add_argument("--outer-betas", metavar="B1,B2", help=f"outer: Adam's betas for adam (default {OUTER.betas[0]},{OUTER.betas[1]})")
    p.add_argument("--outer-eps", type=float, help=f"outer: Adam's epsilon for adam (default {OUTER.eps}, the DiLoCo paper's)")
    p.add_argument("--outer-state", metavar="STATE",
                   help="outer: optimizer state file, read if it exists and replaced by the new state")
    p.add_argument("--buffer-mib", type=int, default=DEFAULT_BUFFER_BYTES >> 20,
                   help=f"read buffers of all inputs together, MiB (default {DEFAULT_BUFFER_BYTES >> 20})")
    p.set_defaults(merge_handler=cmd_merge)
    return p


def cmd_merge(args: argparse.Namespace) -> int:
    from core.progress import human
    from merge.manual import ManualMerge, MergeError, manual_merge
    from orchestrator.console import console

    weights = None
    if args.weights:
        try:
            weights = [float(w) for w in args.weights.split(",")]
        except ValueError:
            raise MergeError([f"--weights {args.weights!r} is not a comma-separated list of numbers"]) from None
    given = {"density": args.density, "gamma": args.gamma, "epsilon": args.epsilon, "seed": args.seed,
             "rescale": args.rescale, "scale": args.scale, "normalize": args.normalize, "t": args.slerp_t}
    params = {k: v for k, v in given.items() if v is not None}
    betas = None
    if args.outer_betas:
        try:
            betas = tuple(float(b) for b in args.outer_betas.split(","))
        except ValueError:
            betas = ()
        if len(betas) != 2 or not all(0 <= b < 1 for b in betas):
            raise MergeError([f"--outer-betas {args.outer_betas!r} is not two numbers in [0, 1), e.g. 0.9,0.95"])
    if args.outer_eps is not None and not args.outer_eps > 0:
        raise MergeError([f"--outer-eps {args.outer_eps} must be a positive number, e.g. 0.1"])
    outer_opts = {k: v for k, v in (("optimizer", args.outer_optimizer), ("lr", args.outer_lr),
                                    ("momentum", args.outer_momentum), ("betas", betas), ("eps", args.outer_eps))
                  if v is not None}
    outer = OuterConfig(**outer_opts) if outer_opts else None
    res = manual_merge(ManualMerge(args.inputs, args.out, method=args.method, weights=weights, base=args.base,
                                   params=params, outer=outer, state=args.outer_state,
                                   buffer_bytes=args.buffer_mib << 20))
    rate = res.bytes_read / res.seconds if res.seconds else 0.0
    console.print(f"merged {res.inputs} input(s) with {res.method}: {human(res.bytes_read)}B read in "
                  f"{res.seconds:.2f}s ({human(rate)}B/s)")
    for path in res.outputs:
        console.print(f"wrote {path}", markup=False)
    if res.state:
        console.print(f"outer state updated: {res.state}", markup=False)
    return 0
