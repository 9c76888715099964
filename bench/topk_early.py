"""Top-k contributions on a short run: the README-shaped run (4 workers x 8 rounds of 25 steps,
local executor, the built-in model and corpus) with the documented top-k settings against the
dense run, per seed.

Each run is the real `orchestrate submit` (a subprocess); the figures are its eval losses by round
from `orchestrate status --json`. Printed per variant: the final eval loss against the dense run's
of the same seed, and the worst rise of the eval loss from one round to the next (goal: within 2%
and no rise over 10%).

    python -m bench.topk_early [--seeds 0 1] [--variant NAME=--set k=v,...]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TOPK = ["round.contribution=delta", "round.codec=topk", "outer.optimizer=sgd", "outer.lr=3"]
VARIANTS = {"dense": [], "topk": TOPK}


def losses(sets: list[str], seed: int, folder: Path, workers: int, rounds: int) -> list[float]:
    """Initial and per-round eval losses of one README-shaped run."""
    run = folder / f"run-{time.time_ns()}"
    cmd = [sys.executable, "-m", "orchestrator.cli", "submit", "--executor", "local", "--workers", str(workers),
           "--rounds", str(rounds), "--run-dir", str(run), "--set", f"seed={seed}"]
    for s in sets:
        cmd += ["--set", s]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    st = json.loads(subprocess.run([sys.executable, "-m", "orchestrator.cli", "status", str(run), "--json"],
                                   check=True, capture_output=True, text=True).stdout)
    return [st["initial_eval_loss"]] + [r["eval_loss"] for r in st["rounds"]]


def worst_rise(curve: list[float]) -> float:
    """The largest relative rise of the eval loss from one round to the next (0 if it only falls)."""
    return max([0.0] + [(b - a) / a for a, b in zip(curve[1:], curve[2:])])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--variant", action="append", default=[],
                    help="NAME=k=v,k=v: another top-k variant (its --set keys on top of the documented ones)")
    ap.add_argument("--skip", nargs="*", default=[], help="variants not to run (dense always runs: the baseline)")
    a = ap.parse_args()
    variants = {k: v for k, v in VARIANTS.items() if k == "dense" or k not in a.skip}
    for v in a.variant:
        name, _, sets = v.partition("=")
        variants[name] = TOPK + [s for s in sets.split(",") if s]
    with tempfile.TemporaryDirectory() as tmp:
        for seed in a.seeds:
            curves = {name: losses(sets, seed, Path(tmp), a.workers, a.rounds) for name, sets in variants.items()}
            dense = curves["dense"][-1]
            for name, curve in curves.items():
                print(json.dumps({"seed": seed, "variant": name, "final": round(curve[-1], 4),
                                  "vs_dense": round(curve[-1] / dense - 1, 4), "worst_rise": round(worst_rise(curve), 4),
                                  "curve": [round(x, 4) for x in curve]}), flush=True)


if __name__ == "__main__":
    main()
