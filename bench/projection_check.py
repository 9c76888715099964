"""Check the queue-wait projection against real runs on a loaded Slurm.

`orchestrate bench queue-wait --project` predicts a run's end-to-end time from a wait-time
distribution and the compute time per round, under stated assumptions (docs/scheduling.md). This
benchmark tests that prediction on the local cluster (`slurm_templates/local-cluster.sh up`):

1. a background load keeps `--load` whole-node jobs of random length queued or running, so
   new jobs really wait;
2. under that load, `--probes` staggered 1-node and K-node probe jobs measure the wait
   distributions (one probe every few seconds, so they sample the queue over time, not one moment);
3. the projection runs on those distributions, with S = the workers' measured compute per round;
4. the same training then really runs, under the same load: (a) a K-node job holding its nodes for
   T x S (no data-parallel training exists here: its wait is what is checked), (b) per-round
   workers, (c) persistent workers. Actual end-to-end is split into queue, compute and the rest
   (merge, eval, polling, start-up: what the projection leaves out).

    python -m bench.projection_check [--workers 2] [--rounds 6] [--inner-steps 40] [--load 5]
"""
from __future__ import annotations

import argparse
import json
import logging
import random
import subprocess
import tempfile
import threading
import time

import numpy as np

from core.storage import Storage
from orchestrator.cli import main as orchestrate
from orchestrator.queuewait.projection import ProjectionSpec, project
from orchestrator.queuewait.stats import parse_buckets
from orchestrator.queuewait.waits import WaitData, parse_sacct
from orchestrator.queuewait.io import sacct_command

log = logging.getLogger("bench.projection_check")
TINY = ["--set", "model.n_layer=1", "--set", "model.n_embd=32", "--set", "model.n_head=2", "--set", "model.block_size=32",
        "--set", "inner.batch_size=4", "--set", "data.eval_batches=2", "--set", "round.poll_s=0.2",
        "--set", "executor.preset=local", "--set", "inner.warmup_steps=2"]


def sbatch(*args: str) -> str:
    out = subprocess.run(["sbatch", "--parsable", "-o", "/dev/null", "-e", "/dev/null", *args],
                         capture_output=True, text=True, check=True).stdout
    return out.strip().split(";")[0]


class Load(threading.Thread):
    """Keeps `n` exclusive 1-node jobs of 8-24 s queued or running; cancels them all at the end."""

    def __init__(self, n: int, seed: int) -> None:
        super().__init__(daemon=True)
        self.n, self.rng, self.ids, self.stop = n, random.Random(seed), [], threading.Event()

    def _alive(self) -> int:
        if not self.ids:
            return 0
        out = subprocess.run(["squeue", "-h", "-o", "%i", "-j", ",".join(self.ids)], capture_output=True, text=True).stdout
        return len(out.split())

    def run(self) -> None:
        while not self.stop.is_set():
            for _ in range(self.n - self._alive()):
                self.ids.append(sbatch("-N", "1", "--exclusive", "-t", "2", "-J", "islands-load",
                                       "--wrap", f"sleep {self.rng.uniform(8, 24):.1f}"))
            self.stop.wait(1.0)

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.join()
        if self.ids:
            subprocess.run(["scancel", *self.ids], capture_output=True)

    def __enter__(self) -> "Load":
        self.start()
        return self


def sacct_waits(job_ids: list[str], timeout: float = 60) -> WaitData:
    """Submit-to-start of the given jobs (array tasks included), once sacct has all of them."""
    bases = sorted({j.split("_")[0] for j in job_ids})
    deadline = time.time() + timeout
    while True:
        text = subprocess.run(sacct_command(None, None, None, bases), capture_output=True, text=True).stdout
        data = parse_sacct(text, source="sacct")
        if len(data.jobs) >= len(job_ids) or time.time() > deadline:
            return data
        time.sleep(1)


def probe(workers: int, n: int, gap_s: float) -> WaitData:
    """n probes of 1 node and n of K nodes, alternating, one every gap_s seconds."""
    ids = []
    try:
        for i in range(2 * n):
            ids.append(sbatch("-N", str(1 if i % 2 == 0 else workers), "-t", "1", "-J", "islands-probe", "--wrap", "sleep 1"))
            time.sleep(gap_s)
        data = sacct_waits(ids, timeout=300)
    finally:
        subprocess.run(["scancel", *ids], capture_output=True)
    return data


def run_training(tmp: str, mode: str, args: argparse.Namespace) -> dict[str, float]:
    """One real run; returns its end-to-end seconds split into queue, compute and the rest."""
    run = f"{tmp}/{mode}"
    t0 = time.time()
    orchestrate(["submit", "--executor", "slurm", "--run-dir", run, "--workers", str(args.workers), "--rounds",
                 str(args.rounds), "--inner-steps", str(args.inner_steps), "--set", f"round.worker_mode={mode}", *TINY])
    total = time.time() - t0
    s = Storage(run)
    queue, compute, ids = 0.0, 0.0, []
    for r in range(args.rounds):
        jobs = s.read_json(f"rounds/{r:05d}/jobs.json")["workers"]
        mans = [s.read_json(f"rounds/{r:05d}/contrib/worker_{int(w):03d}.json") for w in jobs]
        compute += max(m["seconds"] for m in mans)
        if mode == "per_round" or r == 0:
            round_ids = [e["job_ids"][0] for e in jobs.values()]
            ids += round_ids
            queue += max(j.wait_s for j in sacct_waits(round_ids).jobs)
    rest = total - queue - compute
    return {"end_to_end_s": total, "queue_s": queue, "compute_s": compute, "rest_s": rest,
            "jobs": len(ids), "round_seconds": compute / args.rounds}


def run_data_parallel(workers: int, seconds: float) -> dict[str, float]:
    t0 = time.time()
    job = sbatch("-N", str(workers), "-t", "5", "-J", "islands-dp-standin", "--wrap", f"sleep {seconds:.1f}")
    while subprocess.run(["squeue", "-h", "-j", job], capture_output=True, text=True).stdout.strip():
        time.sleep(0.5)
    wait = sacct_waits([job]).jobs[0].wait_s
    return {"end_to_end_s": time.time() - t0, "queue_s": wait, "compute_s": seconds, "rest_s": time.time() - t0 - wait - seconds}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--inner-steps", type=int, default=40)
    ap.add_argument("--load", type=int, default=5, help="whole-node background jobs kept queued or running")
    ap.add_argument("--probes", type=int, default=10, help="probes per size")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    buckets = parse_buckets(f"1,{args.workers}")
    with tempfile.TemporaryDirectory() as tmp, Load(args.load, args.seed):
        time.sleep(20)  # let the load reach its steady state
        waits = probe(args.workers, args.probes, gap_s=3.0)
        actual = {mode: run_training(tmp, mode, args) for mode in ("per_round", "persistent")}
        s = float(np.median([a["round_seconds"] for a in actual.values()]))
        actual = {"data_parallel": run_data_parallel(args.workers, args.rounds * s), **actual}
    by_nodes = {n: [j.wait_s for j in waits.jobs if j.nodes == n] for n in (1, args.workers)}
    out = {"probe_waits_s": {str(n): sorted(round(w, 1) for w in v) for n, v in by_nodes.items()}, "models": []}
    for key, a in actual.items():  # each model projected with the compute per round it really had
        spec = ProjectionSpec(rounds=args.rounds, round_seconds=a["compute_s"] / args.rounds, workers=args.workers,
                              job_time_limit_s=600, seed=args.seed)
        p = next(m for m in project(waits, buckets, spec)["models"] if m["model"] == key)
        out["models"].append({"model": key, "projected_median_s": round(p["median_s"], 1), "projected_p90_s": round(p["p90_s"], 1),
                              "projected_queue_median_s": round(p["queue_median_s"], 1),
                              **{k: round(v, 1) for k, v in a.items()}})
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
