"""What a round moves and keeps: bytes through storage per worker-round, and the run directory's
size as rounds go, each over W (the model's fp32 weights), against the same run writing its state
every round and keeping everything (the baseline, in the same process of measurement).

Each configuration is the real `orchestrate submit` (local executor, the built-in model, K workers,
2 inner steps a round so that I/O dominates) run twice, for R and 2R rounds, with
ISLANDS_IO_REPORT (core/iostat.py): every worker and service process reports the bytes it read and
wrote as it exits. The difference of the two runs over R x K worker-rounds is the per-worker-round
figure, free of what does not grow with rounds (imports, the corpus). The run directory (its
checkpoints and records; jobs/ logs left out) is measured after R and after 2R rounds.

With top-k a second row reads the dense global every round (round.replica never): the workers'
replica of the merge (worker/replica.py) against dense reads, in the same run. Its turnaround is
the 2R run's mean, per worker-round, from the last contribution of round r (its manifest's
written_at) to the worker's base of round r+1 in its model (`base_at`), with the seconds it took
to get that base (`base_s`: read or replayed) and the share of bases replayed.

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
                               "--set", "outer.optimizer=sgd", "--set", "outer.lr=3", "--set", "round.replica=always"]}
BASELINE = ["--set", "round.state_every=1", "--set", "round.keep_last=0"]
"""State written every round, nothing deleted: what a run did before snapshots and retention."""
DENSE_BASE = ["--set", "round.replica=never"]
"""Every worker reads the global weights: what a run did before workers replayed the merge."""


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
    return {**out, **turnaround(run, rounds)}


def turnaround(run: Path, rounds: int) -> dict[str, float]:
    """Means over the worker-rounds from round 1 on: the last contribution of the round before ->
    this worker's base in its model (s), the seconds getting that base took, the share replayed."""
    turn, took, replayed = [], [], []
    for r in range(1, rounds):
        prev = json.loads((run / "rounds" / f"{r - 1:05d}" / "record.json").read_text())
        last = max(json.loads((run / "rounds" / f"{r - 1:05d}" / "contrib" / f"worker_{w:03d}.json").read_text())
                   ["written_at"] for w in prev["merged"])
        for m in (json.loads(p.read_text()) for p in (run / "rounds" / f"{r:05d}" / "contrib").glob("worker_*.json")):
            turn.append(m["base_at"] - last)
            took.append(m["base_s"])
            replayed.append(bool(m.get("replica")))
    n = max(len(turn), 1)
    return {"turnaround": sum(turn) / n, "base_s": sum(took) / n, "replayed": sum(replayed) / n}


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
            "dir_R": short["dir"] / w, "dir_2R": long["dir"] / w,
            **{k: long[k] for k in ("turnaround", "base_s", "replayed")}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=16)
    ap.add_argument("--codecs", default="fp32,topk")
    ap.add_argument("--baseline", action=argparse.BooleanOptionalAction, default=True)
    args = ap.parse_args()
    k, r = args.workers, args.rounds
    print(f"K = {k} workers, R = {r} and {2 * r} rounds, 2 inner steps; figures / W (fp32 weights)")
    print(f"{'codec':6} {'settings':10} {'read/wr':>8} {'written/wr':>10} {'both/wr':>8} {'service/r':>9} "
          f"{'dir@' + str(r):>8} {'dir@' + str(2 * r):>8} {'turn s':>7} {'base s':>7} {'replayed':>8}")
    for codec in args.codecs.split(","):
        rows = [("default", CODECS[codec])] + ([("dense base", CODECS[codec] + DENSE_BASE)] if codec == "topk" else []) \
            + ([("baseline", CODECS[codec] + BASELINE)] if args.baseline else [])
        got = {}
        for name, extra in rows:
            m = got[name] = measure(k, r, extra)
            print(f"{codec:6} {name:10} {m['read']:8.2f} {m['written']:10.2f} {m['read'] + m['written']:8.2f} "
                  f"{m['service']:9.2f} {m['dir_R']:8.1f} {m['dir_2R']:8.1f} {m['turnaround']:7.2f} {m['base_s']:7.3f} "
                  f"{m['replayed']:8.2f}", flush=True)
        d = got["default"]
        for name in ("dense base", "baseline"):
            if name in got:
                b = got[name]
                print(f"{codec:6} {'/ ' + name:13} bytes per worker-round {(d['read'] + d['written']) / (b['read'] + b['written']):.2f}"
                      f", reads {d['read'] / b['read']:.2f}, run directory after {2 * r} rounds {d['dir_2R'] / b['dir_2R']:.2f}"
                      f", turnaround {d['turnaround'] / b['turnaround']:.2f}")


if __name__ == "__main__":
    main()
