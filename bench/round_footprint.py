"""What a round moves and keeps: bytes through storage per worker-round, and the run directory's
size as rounds go, each over W (the model's fp32 weights), against the same run writing its state
every round and keeping everything (the baseline, in the same process of measurement).

Each configuration is the real `orchestrate submit` (local executor, the built-in model, K workers,
2 inner steps a round so that I/O dominates) run twice, for R and 2R rounds, with
ISLANDS_IO_REPORT (core/iostat.py): every worker and service process reports the bytes it read and
wrote as it exits. The difference of the two runs over R x K worker-rounds is the per-worker-round
figure, free of what does not grow with rounds (imports, the corpus). The run directory (its
checkpoints and records; jobs/ logs left out) is measured after R and after 2R rounds.

    python -m bench.round_footprint [--workers 3] [--rounds 16] [--codecs fp32,topk]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

CODECS = {"fp32": [], "topk": ["--set", "round.contribution=delta", "--set", "round.codec=topk",
                               "--set", "outer.optimizer=sgd", "--set", "outer.lr=3"]}
BASELINE = ["--set", "round.state_every=1", "--set", "round.keep_last=0"]
"""State written every round, nothing deleted: what a run did before snapshots and retention."""


def run_dir_bytes(run: Path) -> int:
    return sum(p.stat().st_size for p in run.rglob("*") if p.is_file() and "jobs" not in p.relative_to(run).parts)


def one_run(folder: Path, workers: int, rounds: int, extra: list[str]) -> dict[str, float]:
    """Bytes the workers and the service read and wrote, the run directory's size, and W."""
    run, io = folder / f"run-{rounds}", folder / f"io-{rounds}"
    io.mkdir()
    cmd = [sys.executable, "-m", "orchestrator.cli", "submit", "--executor", "local", "--workers", str(workers),
           "--rounds", str(rounds), "--inner-steps", "2", "--run-dir", str(run), "--set", "inner.warmup_steps=1",
           "--set", "data.eval_batches=1", *extra]
    subprocess.run(cmd, check=True, capture_output=True, env={**os.environ, "ISLANDS_IO_REPORT": str(io)})
    reports = [json.loads(p.read_text()) for p in io.glob("*.json")]
    w = json.loads((run / "global" / "round_00000.json").read_text())["bytes"]
    out = {"W": w, "dir": run_dir_bytes(run)}
    for role in ("worker", "service"):
        out[f"{role}_read"] = sum(r.get("rchar", 0) for r in reports if r["role"] == role)
        out[f"{role}_written"] = sum(r.get("wchar", 0) for r in reports if r["role"] == role)
    return out


def measure(workers: int, rounds: int, extra: list[str]) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="islands-footprint-") as tmp:
        a, b = Path(tmp) / "a", Path(tmp) / "b"
        a.mkdir()
        b.mkdir()
        short, long = one_run(a, workers, rounds, extra), one_run(b, workers, 2 * rounds, extra)
    w, n = short["W"], rounds * workers
    return {"read": (long["worker_read"] - short["worker_read"]) / n / w,
            "written": (long["worker_written"] - short["worker_written"]) / n / w,
            "service": (long["service_read"] + long["service_written"] - short["service_read"] - short["service_written"])
            / rounds / w,
            "dir_R": short["dir"] / w, "dir_2R": long["dir"] / w}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=16)
    ap.add_argument("--codecs", default="fp32,topk")
    ap.add_argument("--baseline", action=argparse.BooleanOptionalAction, default=True)
    args = ap.parse_args()
    k, r = args.workers, args.rounds
    print(f"K = {k} workers, R = {r} and {2 * r} rounds, 2 inner steps; figures / W (fp32 weights)")
    print(f"{'codec':6} {'settings':9} {'read/wr':>8} {'written/wr':>10} {'both/wr':>8} {'service/r':>9} "
          f"{'dir@' + str(r):>8} {'dir@' + str(2 * r):>8}")
    for codec in args.codecs.split(","):
        rows = [("default", CODECS[codec])] + ([("baseline", CODECS[codec] + BASELINE)] if args.baseline else [])
        got = {}
        for name, extra in rows:
            m = got[name] = measure(k, r, extra)
            print(f"{codec:6} {name:9} {m['read']:8.2f} {m['written']:10.2f} {m['read'] + m['written']:8.2f} "
                  f"{m['service']:9.2f} {m['dir_R']:8.1f} {m['dir_2R']:8.1f}", flush=True)
        if "baseline" in got:
            d, b = got["default"], got["baseline"]
            print(f"{codec:6} ratio     bytes per worker-round {(d['read'] + d['written']) / (b['read'] + b['written']):.2f}"
                  f", run directory after {2 * r} rounds {d['dir_2R'] / b['dir_2R']:.2f}")


if __name__ == "__main__":
    main()
