"""The cost of W&B and MLflow logging: wall time of the README run with both on (W&B offline, MLflow's
local SQLite store) against neither (the baseline), alternating, in one run of this script.

Each is the real command a person types (bench.readme_run.one_run: a subprocess, local executor,
persistent workers). Every run must end with the same final eval loss within 1e-4 (relative): logging
never changes training, and the last digits move with the order contributions arrive in, which the
merge sums in (merge/rounds.py), on any run.

    python -m bench.trackers [--workers 4] [--rounds 8] [--repeats 3]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from bench.readme_run import one_run


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3, help="runs per setting, alternating; medians reported")
    args = p.parse_args()
    walls: dict[str, list[float]] = {"neither": [], "both": []}
    losses: set[float] = set()
    with tempfile.TemporaryDirectory() as tmp:
        both = ("log.wandb=islands-bench", "log.wandb_mode=offline", f"log.mlflow=sqlite:///{tmp}/mlflow.db")
        for i in range(args.repeats):
            order = [("neither", ()), ("both", both)]
            for name, sets in order if i % 2 == 0 else order[::-1]:  # neither goes first every other time
                wall, loss = one_run("persistent", args.workers, args.rounds, Path(tmp), sets)
                walls[name].append(wall)
                losses.add(loss)
                print(f"{name}: {wall:.1f} s, final eval loss {loss}", flush=True)
    base, on = (statistics.median(walls[k]) for k in ("neither", "both"))
    print(f"README run, {args.workers} workers x {args.rounds} rounds: neither {base:.1f} s, W&B + MLflow {on:.1f} s "
          f"(medians of {args.repeats}); both / neither = {on / base:.3f}")
    if max(losses) - min(losses) > 1e-4 * min(losses):
        print(f"FAIL: final eval losses differ: {sorted(losses)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
