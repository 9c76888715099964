"""Round turnaround on a real Slurm: last accepted contribution of round r -> round r+1 running.

Runs a tiny DiLoCo run (per-round jobs, then persistent workers) on the local cluster
(`slurm_templates/local-cluster.sh up`) and splits each turnaround into: noticing the last
contribution, the merge, committing + submitting, and the scheduler's queue. The baseline measured
in the same run is a bare `sbatch --wrap true`'s submit-to-start time: the scheduler's own tick.
Goal: turnaround <= baseline + 3 s.

    python -m bench.round_turnaround [--workers 2] [--rounds 5]
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import subprocess
import tempfile
import time

from core.storage import Storage
from orchestrator.cli import main as orchestrate

TINY = ["--set", "model.n_layer=1", "--set", "model.n_embd=32", "--set", "model.n_head=2", "--set", "model.block_size=32",
        "--set", "inner.batch_size=4", "--set", "data.eval_batches=2", "--set", "round.poll_s=0.2", "--set", "executor.preset=local"]


def _epoch(stamp: str) -> float:
    return dt.datetime.fromisoformat(stamp).timestamp()


def sacct_starts(job_ids: list[str]) -> dict[str, float]:
    bases = ",".join(sorted({j.split("_")[0] for j in job_ids}))
    out = subprocess.run(["sacct", "-P", "-n", "-X", "-o", "JobID,Start", "-j", bases], capture_output=True, text=True).stdout
    return {a: _epoch(b) for a, b in (line.split("|") for line in out.splitlines()) if b not in ("Unknown", "None", "")}


def bare_sbatch_latency(n: int = 5) -> list[float]:
    """Submit-to-start of an empty job: what the scheduler costs by itself."""
    out = []
    for _ in range(n):
        job = subprocess.run(["sbatch", "--parsable", "-N", "1", "-t", "1", "-o", "/dev/null", "--wrap", "true"],
                             capture_output=True, text=True, check=True).stdout.strip()
        t0 = time.time()
        while True:
            st = subprocess.run(["sacct", "-P", "-n", "-X", "-o", "State,Start", "-j", job], capture_output=True, text=True).stdout
            if st and st.split("|")[1].strip() not in ("Unknown", "None", ""):
                out.append(_epoch(st.split("|")[1].strip()) - t0)
                break
            time.sleep(0.2)
    return out


def turnarounds(run: str, rounds: int, persistent: bool) -> list[dict[str, float]]:
    s = Storage(run)
    rows = []
    for r in range(1, rounds):
        prev = s.read_json(f"rounds/{r - 1:05d}/record.json")
        last = max(s.read_json(f"rounds/{r - 1:05d}/contrib/worker_{w:03d}.json")["written_at"] for w in prev["merged"])
        jobs = s.read_json(f"rounds/{r:05d}/jobs.json")
        if persistent:  # the job is already running: it starts training when it sees the assignment
            mans = [s.read_json(f"rounds/{r:05d}/contrib/worker_{int(w):03d}.json") for w in jobs["workers"]]
            running = max(m["written_at"] - m["seconds"] for m in mans)
        else:
            starts = sacct_starts([e["job_ids"][0] for e in jobs["workers"].values()])
            running = max(starts[e["job_ids"][0]] for e in jobs["workers"].values())
        rows.append({"round": r, "turnaround_s": running - last, "notice_s": prev["merge_started_at"] - last,
                     "merge_s": prev["merge_seconds"], "submit_s": jobs["submitted_at"] - prev["committed_at"]})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    base = bare_sbatch_latency()
    result = {"bare_sbatch_start_s": [round(x, 2) for x in base]}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in ("per_round", "persistent"):
            run = f"{tmp}/{mode}"
            orchestrate(["submit", "--executor", "slurm", "--run-dir", run, "--workers", str(args.workers), "--rounds",
                         str(args.rounds), "--inner-steps", "20", "--set", f"round.worker_mode={mode}", *TINY])
            rows = turnarounds(run, args.rounds, mode == "persistent")
            med = statistics.median(r["turnaround_s"] for r in rows)
            result[mode] = {"median_turnaround_s": round(med, 2),
                            "beyond_scheduler_tick_s": round(med - statistics.median(base), 2),
                            "rounds": [{k: round(v, 3) for k, v in r.items()} for r in rows]}
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
