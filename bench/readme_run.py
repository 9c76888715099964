"""The README run in both worker modes: wall time of `orchestrate submit` with per-round jobs (the
baseline) and with persistent workers, on this machine, one after the other.

Each is the real command a person types (a subprocess, local executor, the built-in model and
corpus); the figure is its wall time from start to exit, and the ratio per_round / persistent.
Both runs must end with the same final eval loss (the modes train the same maths; a difference
is printed as a failure).

    python -m bench.readme_run [--workers 4] [--rounds 8] [--repeats 1]
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODES = ("per_round", "persistent")


def one_run(mode: str, workers: int, rounds: int, folder: Path, sets: tuple[str, ...] = ()) -> tuple[float, float]:
    """(wall seconds, final eval loss) of one README run in `mode`, with `--set` items `sets`."""
    run = folder / f"{mode}-{time.time_ns()}"
    cmd = [sys.executable, "-m", "orchestrator.cli", "submit", "--executor", "local", "--workers", str(workers),
           "--rounds", str(rounds), "--run-dir", str(run), "--set", f"round.worker_mode={mode}"]
    cmd += [arg for item in sets for arg in ("--set", item)]
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, capture_output=True)
    wall = time.perf_counter() - t0
    status = subprocess.run([sys.executable, "-m", "orchestrator.cli", "status", str(run), "--json"],
                            check=True, capture_output=True, text=True).stdout
    return wall, json.loads(status)["rounds"][-1]["eval_loss"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--repeats", type=int, default=1, help="runs per mode, alternating; medians reported")
    args = p.parse_args()
    walls: dict[str, list[float]] = {m: [] for m in MODES}
    losses: dict[str, set[float]] = {m: set() for m in MODES}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.repeats):
            for mode in MODES:
                wall, loss = one_run(mode, args.workers, args.rounds, Path(tmp))
                walls[mode].append(wall)
                losses[mode].add(loss)
                print(f"{mode}: {wall:.1f} s, final eval loss {loss}", flush=True)
    base, fast = (statistics.median(walls[m]) for m in MODES)
    print(f"README run, {args.workers} workers x {args.rounds} rounds: per_round {base:.1f} s, persistent "
          f"{fast:.1f} s (medians of {args.repeats}); per_round / persistent = {base / fast:.2f}")
    if losses["per_round"] != losses["persistent"]:
        print(f"FAIL: final eval losses differ: {losses}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
