"""Reproduce the DiLoCo, lo-fi and LTE papers' key comparisons at small scale, with one command.

    python -m bench.reproduce --all                       # every experiment, default size (tiny)
    python -m bench.reproduce diloco outer                # some experiments
    python -m bench.reproduce --only lofi --size small --seeds 3

Writes docs/img/results/NAME.{json,png} per experiment and re-renders docs/results.md.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import logging
import shlex
import sys
import time
from pathlib import Path

import torch

from bench.reproduce import report
from bench.reproduce.context import SIZES, Context
from bench.reproduce.diloco_exps import EXPERIMENTS as DILOCO
from bench.reproduce.lofi_exp import lofi
from bench.reproduce.lofi_vision import lofi_vision
from bench.reproduce.lte_vision import lte_vision
from bench.reproduce.lte_exp import lte

EXPERIMENTS = {**DILOCO,
               "lofi": ("lo-fi: fine-tuning without communication", "lo-fi Table 2", lofi),
               "lofi-vision": ("lo-fi on images: a ViT fine-tuned without communication", "lo-fi Table 1", lofi_vision),
               "lte": ("LTE vs full-model training", "LTE Table 1", lte),
               "lte-vision": ("LTE on images: a ViT's heads vs full-model training", "LTE Table 1", lte_vision)}
DOCS = Path(__file__).resolve().parents[2] / "docs"


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.reproduce", description=__doc__.split("\n")[0])
    p.add_argument("names", nargs="*", metavar="NAME", help=f"experiments to run: {', '.join(EXPERIMENTS)}")
    p.add_argument("--only", action="append", default=[], metavar="NAME", help="run this experiment (repeatable)")
    p.add_argument("--all", action="store_true", help="run every experiment")
    p.add_argument("--list", action="store_true", help="list the experiments and exit")
    p.add_argument("--render", action="store_true", help="only rewrite results.md from the saved results")
    p.add_argument("--size", choices=list(SIZES), default="tiny", help="model width and steps (default tiny)")
    p.add_argument("--rounds", type=int, default=0,
                   help="rounds of every run (default: the size's; compress takes at least 32)")
    p.add_argument("--seeds", type=int, default=2, help="seeds 0..N-1 per configuration (default 2)")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    p.add_argument("--jobs", type=int, default=1,
                   help="train the runs of experiment compress in this many processes at once, one CPU thread each "
                        "(on a GPU, where one small run leaves it mostly idle; default 1: one after another)")
    p.add_argument("--out", type=Path, default=DOCS, help="folder for results.md and img/results/ (default docs/)")
    p.add_argument("--cache-dir", help="corpus cache (default: islands' own)")
    p.add_argument("-v", "--verbose", action="store_true", help="log every run")
    args = p.parse_args(argv)
    args.selected = list(EXPERIMENTS) if args.all else list(dict.fromkeys(args.names + args.only))
    unknown = [n for n in args.selected if n not in EXPERIMENTS]
    if unknown:
        p.error(f"unknown experiment(s) {unknown}; valid: {', '.join(EXPERIMENTS)}")
    if not args.selected and not (args.list or args.render):
        p.error("name experiments to run, or --all (--list shows them)")
    if args.seeds < 1:
        p.error("--seeds must be at least 1")
    if args.rounds < 0:
        p.error("--rounds must be at least 1 (0: the size's)")
    if args.jobs < 1:
        p.error("--jobs must be at least 1")
    return args


def device_name() -> str:
    if torch.cuda.is_available():
        return f"CUDA ({torch.cuda.get_device_name(0)})"
    return f"CPU ({torch.get_num_threads()} torch threads)"


def _command(name: str, args: argparse.Namespace) -> str:
    """The command that reruns experiment `name` as this run did."""
    extra = (f" --rounds {args.rounds}" if args.rounds else "") + (f" --jobs {args.jobs}" if args.jobs > 1 else "")
    return f"python -m bench.reproduce {name} --size {args.size} --seeds {args.seeds}{extra}"


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.list:
        for name, (title, paper, _) in EXPERIMENTS.items():
            print(f"{name:10s} {title} ({paper})")
        return 0
    if args.render:
        print(f"wrote {report.render(args.out, list(EXPERIMENTS))}")
        return 0
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    command = "python -m bench.reproduce " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    size = dataclasses.replace(SIZES[args.size], rounds=args.rounds) if args.rounds else SIZES[args.size]
    ctx = Context(size, range(args.seeds), args.cache_dir, args.jobs)
    t_all = time.perf_counter()
    for name in args.selected:
        title, paper, fn = EXPERIMENTS[name]
        print(f"== {name}: {title} ({paper}), size {args.size}, seeds {ctx.seeds}", flush=True)
        t0 = time.perf_counter()
        outcome = fn(ctx)
        outcome.seconds = time.perf_counter() - t0
        meta = {"title": title, "paper": paper, "size": args.size, "seeds": ctx.seeds, "device": device_name(),
                "command": _command(name, args)}
        record = report.save(args.out, name, meta, outcome)
        for row in outcome.rows:
            print(f"   {row.label:60s} {row.mean:.4f} ± {row.spread:.4f}")
        print(f"   reproduced: {report.verdict(record['checks'])} ({outcome.seconds:.0f} s)", flush=True)
    if args.all:
        stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        (args.out / report.IMG / "_all.json").write_text(json.dumps(
            {"command": command, "seconds": round(time.perf_counter() - t_all, 1), "device": device_name(), "date": stamp}))
    path = report.render(args.out, list(EXPERIMENTS))
    print(f"wrote {path} ({time.perf_counter() - t_all:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
