"""Barrier rounds against time-budgeted and overlapped rounds, with one slow worker: worker
utilization, wall time and final eval loss of the same persistent DiLoCo run, on the local
executor or on Slurm (`--executor slurm`).

One worker is made slow by the fault-injection slowpoint `worker_001.step` (ISLANDS_SLOWPOINT),
which sleeps `--slow-step` seconds after each of its steps; the figure printed says how much
slower that made it. `sync`: every worker takes H = --inner-steps steps a round, so every round
waits for the slow one (the barrier). `budget`: round.budget seconds, S = the median time the
other workers took for their H steps in the sync run; inner.steps stays H (the cap, and the same
learning-rate schedule), so the fast workers take about H steps and the slow one fewer. `overlap`:
the same budget, and round.overlap rebase: a worker trains on while its round is merged. `--json`
writes {"sync": {"utilization", "final_eval_loss", "wall_s"}, "budget": {...}, "overlap": {...}, "setup"}.

    python -m bench.overlap [--workers 2] [--rounds 6] [--inner-steps 30] [--slow-step 0.1] [--json PATH]
    python -m bench.overlap --executor slurm --set executor.preset=local   # slurm_templates/local-cluster.sh up
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def run(folder: Path, name: str, args: argparse.Namespace, extra: list[str]) -> dict:
    """One `orchestrate submit` (a subprocess, as a person types it); its status and manifests."""
    run_dir = folder / name
    cmd = [sys.executable, "-m", "orchestrator.cli", "submit", "--executor", args.executor, "--workers", str(args.workers),
           "--rounds", str(args.rounds), "--inner-steps", str(args.inner_steps), "--run-dir", str(run_dir), *extra,
           *(f for item in args.sets for f in ("--set", item))]
    env = {**os.environ, "ISLANDS_SLOWPOINT": f"worker_001.step={args.slow_step}"}
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, capture_output=True, env=env)
    wall = time.perf_counter() - t0
    status = json.loads(subprocess.run([sys.executable, "-m", "orchestrator.cli", "status", str(run_dir), "--json"],
                                       check=True, capture_output=True, text=True).stdout)
    manifests = [json.loads((run_dir / f"rounds/{r:05d}/contrib/worker_{w:03d}.json").read_text())
                 for r in range(args.rounds) for w in range(args.workers)]
    return {"wall_s": round(wall, 1), "utilization": status["utilization"],
            "final_eval_loss": status["rounds"][-1]["eval_loss"], "manifests": manifests}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--inner-steps", type=int, default=30)
    p.add_argument("--slow-step", type=float, default=0.1, help="seconds added to each step of worker 1")
    p.add_argument("--executor", choices=["local", "slurm"], default="local",
                   help="where the workers run (slurm: jobs inherit the slowpoint from the service)")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                   help="passed to every run, e.g. --set executor.preset=local on the one-machine cluster")
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="budget-") as tmp:
        sync = run(Path(tmp), "sync", args, [])
        fast = [m for m in sync["manifests"] if m["worker"] != 1]
        slow = [m for m in sync["manifests"] if m["worker"] == 1]
        step = {k: statistics.median(m["trained_s"] / m["steps"] for m in ms) for k, ms in (("fast", fast), ("slow", slow))}
        budget_s = statistics.median(m["trained_s"] for m in fast)
        flags = ["--set", "round.budget=seconds", "--set", f"round.budget_seconds={budget_s:.3f}"]
        budget = run(Path(tmp), "budget", args, flags)
        overlapped = run(Path(tmp), "overlap", args, [*flags, "--set", "round.overlap=rebase"])
    results = {"sync": sync, "budget": budget, "overlap": overlapped}
    out: dict = {name: {k: res[k] for k in ("utilization", "final_eval_loss", "wall_s")} for name, res in results.items()}
    out["setup"] = {"executor": args.executor, "workers": args.workers, "rounds": args.rounds, "inner_steps": args.inner_steps,
                    "slowdown": round(step["slow"] / step["fast"], 2), "budget_seconds": round(budget_s, 3),
                    "steps_per_worker": {name: {w: [m["steps"] for m in res["manifests"] if m["worker"] == w]
                                                for w in range(args.workers)} for name, res in results.items()},
                    "adopted_at_step": {w: [(m.get("overlap") or {}).get("adopted_at_step") for m in overlapped["manifests"]
                                            if m["worker"] == w] for w in range(args.workers)}}
    print(f"{args.executor} executor, {args.workers} workers x {args.rounds} rounds, H = {args.inner_steps}; worker 1 is "
          f"{out['setup']['slowdown']:.2f}x slower a step; budget S = {budget_s:.2f} s")
    for name in results:
        r = out[name]
        print(f"{name:>8}: utilization {r['utilization']:.3f} ({r['utilization'] / out['sync']['utilization']:.2f}x "
              f"sync), wall {r['wall_s']:.1f} s ({r['wall_s'] / out['sync']['wall_s']:.2f}x), final eval loss "
              f"{r['final_eval_loss']:.4f} ({r['final_eval_loss'] / out['sync']['final_eval_loss'] - 1:+.1%})")
    print("overlap: the step each worker adopted its round's global at, per round: "
          + "; ".join(f"worker {w} {steps}" for w, steps in out["setup"]["adopted_at_step"].items()))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
