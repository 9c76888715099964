"""`orchestrate report` and `orchestrate eval`: the command-line edge of seeing a run.

The work is done in orchestrator.observe.report and orchestrator.observe.checkpoint_eval; this module parses
arguments and prints (a rich table on a terminal, plain lines otherwise). docs/observability.md.
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

from rich.table import Column, Table

from core.storage import Storage


def add_parsers(sub: Any) -> None:
    p = sub.add_parser("report", help="PNG plots and one self-contained HTML page of a run (docs/observability.md)")
    p.add_argument("run", help="run directory (any fsspec URL), finished or in progress")
    p.add_argument("--out", help="folder for report.html, the PNGs and metrics.jsonl (default: ./<run name>-report)")
    p.set_defaults(observe_handler=cmd_report)
    p = sub.add_parser("eval", help="held-out loss of checkpoints and of their ensemble")
    p.add_argument("checkpoints", nargs="+", metavar="CHECKPOINT",
                   help="a .safetensors checkpoint, a run directory (its final model), or a run's final/hf folder")
    p.add_argument("--batches", type=int, help="held-out batches (default: the run's data.eval_batches)")
    p.add_argument("--run", help="run directory whose held-out data to use (default: the first checkpoint's run)")
    p.add_argument("--json", action="store_true", help="print the losses (and metrics) as one JSON object (for scripts)")
    p.set_defaults(observe_handler=cmd_eval)


def cmd_report(args: argparse.Namespace) -> int:
    from orchestrator.console import say
    from orchestrator.observe.report import write_report

    storage = Storage(args.run)
    out = Path(args.out) if args.out else Path(f"{Path(storage.root).name or 'run'}-report")
    result = write_report(storage, out)
    say(f"report of {storage.display()} ({result['state']}, {result['rounds']} rounds committed): {result['html']}")
    say(f"plots: {', '.join(Path(p).name for p in result['images'])}; metrics: {result['metrics']}")
    for line in result["problems"]:
        say(line)
    return 0


def _table(rows: list[dict], title: str, cells: list[list[str]], *columns: str) -> Table:
    """A table of checkpoints for a terminal: the checkpoints' common folder is said once in the
    title; the label column takes what the other columns leave of the terminal's width, and a label
    longer than that breaks after a `/`, never inside a name, and is never cut
    (cut, `.../worker_000.safetensors` and `.../worker_001.safetensors` read the same)."""
    from orchestrator.console import break_path, console, narrow_table
    labels = [r["checkpoint"] for r in rows]
    paths = [x for x in labels if x.startswith("/")]
    common = os.path.commonpath(paths) if len(paths) > 1 else ""
    if common not in ("", "/"):
        title += f"; checkpoints under {common}/"
        labels = [x[len(common) + 1:] if x.startswith(common + "/") else x for x in labels]
    others = 2 + sum(max(len(c), *(len(row[i]) for row in cells)) + 2 for i, c in enumerate(columns))  # + the edges
    width = max(16, min(console.width - others, max(map(len, labels)) if labels else 16))
    table = narrow_table(Column("checkpoint", width=width, overflow="fold"),
                         *(Column(c, no_wrap=True) for c in columns), title=title)
    for label, row in zip(labels, cells):
        table.add_row(break_path(label, width), *row)
    return table


def _print_task_rows(rows: list[dict], title: str) -> int:
    from orchestrator.console import console
    names = [k for k in rows[0] if k != "checkpoint"]
    if console.is_terminal:
        console.print(_table(rows, title, [[f"{r[k]:.4f}" for k in names] for r in rows], *names))
        return 0
    print(title)
    for r in rows:
        print("\t".join([r["checkpoint"], *(f"{k} {r[k]:.4f}" for k in names)]))
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from orchestrator.observe.checkpoint_eval import evaluate_checkpoints
    from orchestrator.console import console

    if args.batches is not None and args.batches < 1:
        from core.errors import RunError
        raise RunError(f"--batches must be at least 1, got {args.batches}")
    result = evaluate_checkpoints(args.checkpoints, batches=args.batches, run=args.run)
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    rows = result["models"] + ([result["ensemble"]] if result["ensemble"] else [])
    d = result["data"]
    if "task" in d:  # a task's own metrics, one column each
        return _print_task_rows(rows, f"held-out eval of task {d['task']}: {d['batches']} batches of {d['batch_size']} "
                                      f"(data from {d['config']})")
    per = d["loss_per"]  # the loss is per byte (the built-in model) or per token (a tokenizer's)
    title = (f"held-out eval: {d['batches']} batches x {d['batch_size']} x {d['block_size']} {per}s "
             f"({d['tokens']} {per}s; data from {d['config']})")
    if console.is_terminal:
        cells = [[f"{r['loss']:.4f}", f"{r['perplexity']:.2f}", f"{r[f'bits_per_{per}']:.4f}"] for r in rows]
        console.print(_table(rows, title, cells, f"loss (nats/{per})", "perplexity", f"bits/{per}"))
        return 0
    print(title)
    for r in rows:
        print(f"{r['checkpoint']}\tloss {r['loss']:.4f}\tperplexity {r['perplexity']:.2f}\tbits/{per} {r[f'bits_per_{per}']:.4f}")
    return 0
