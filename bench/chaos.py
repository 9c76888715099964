"""Chaos run on the real local Slurm: a tiny DiLoCo run that must survive what a shared cluster does.

While the run goes (`orchestrate submit --executor slurm`, the merge service as a process of its
own), this driver, watching the run directory only:

- scancels 25% of the worker jobs (--cancel-fraction) at random moments, each while it still owes
  its contribution;
- kills the merge service --kills times and starts `orchestrate resume RUN` again each time: a
  SIGKILL of its process group at a random moment of a round, alternating with a failpoint
  (core/failpoints.py) that ends it in the middle of its next merge (after publishing the new global
  weights, after the round record, while reading), which no timer could hit;
- writes a corrupt file (bytes flipped behind its manifest), a NaN contribution and a wrong-shape
  contribution into the run directory as if by a worker (right manifest: round, worker, base
  digest), then scancels that worker's real job, so the service finds the bad file and nothing else;
- slows one worker: ISLANDS_SLOWPOINT makes it sleep before publishing (core/failpoints.py), so it
  misses every deadline; the run's late policy folds its late work into the next round.

Then it checks that all rounds were committed, that no merged contribution is invalid, and replays
every recorded merge offline (bench/chaos_replay.py): the final weights must be bit for bit the
run's. --clean also times the same run without faults, for the wall-time overhead.

    python -m bench.chaos [--workers 4] [--rounds 20] [--clean]

The last line: chaos: faults_injected=N faults_survived=N rounds=R/R accepted=A rejected=B replay_identical=true|false
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from bench.chaos_replay import invalid_merges, replay
from core.checkpoint import load_checkpoint, read_manifest, write_checkpoint
from core.layout import RunLayout, manifest_key
from core.storage import Storage
from orchestrator.runstate import load_run

L = RunLayout()
ROOT = Path(__file__).resolve().parent.parent
TINY = ["--set", "model.n_layer=1", "--set", "model.n_embd=32", "--set", "model.n_head=2", "--set", "model.block_size=32",
        "--set", "inner.batch_size=4", "--set", "inner.warmup_steps=2", "--set", "data.eval_batches=1",
        "--set", "round.poll_s=0.2", "--set", "executor.preset=local"]
BAD_KINDS = ("corrupt", "nan", "shape")
KILL_POINTS = ("merge.after_global", "service.after_record", "merge.while_reading")
EXPECT = {"corrupt": "checksum does not match", "nan": "NaN or Inf", "shape": "is F32["}


@dataclass
class Fault:
    kind: str
    round: int | None = None
    worker: int | None = None
    detail: str = ""
    survived: bool | None = None
    data: dict[str, Any] = field(default_factory=dict)


class Chaos:
    def __init__(self, args: argparse.Namespace, run: Path, faults_on: bool) -> None:
        self.a, self.run, self.on = args, run, faults_on
        self.rng = random.Random(args.seed)
        self.s = Storage(str(run))
        self.faults: list[Fault] = []
        self.log = open(run.parent / f"{run.name}-service.log", "ab")
        self.slow = args.workers - 1  # the straggler
        r = args.rounds
        n_kills = min(args.kills, r - 1) if self.on else 0
        # every other kill is a failpoint at a step of a merge no timer could hit; the rest are SIGKILLs
        self.kills = [KILL_POINTS[i // 2 % len(KILL_POINTS)] if i % 2 else "sigkill" for i in range(n_kills)]
        self.kill_after = sorted(self.rng.sample(range(1, r), self.kills.count("sigkill")))
        self.armed: str | None = None
        self.bad = dict(zip(sorted(self.rng.sample(range(1, r), min(3, r - 1))), BAD_KINDS)) if self.on else {}
        self.cancel_budget = math.ceil(args.cancel_fraction * args.workers * r) if self.on else 0
        self.timers: list[tuple[float, int, int]] = []  # (when, round, worker) random cancellations
        self.planned_rounds: set[int] = set()
        self.bad_written: dict[int, int] = {}  # round -> worker whose file we wrote
        self.bad_cancelled: set[int] = set()

    # -- the service process -------------------------------------------------------------------
    def _env(self, failpoint: str | None) -> dict[str, str]:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        env.pop("ISLANDS_FAILPOINT", None)
        if self.on:
            env["ISLANDS_SLOWPOINT"] = f"worker_{self.slow:03d}.publish={self.a.slow_s}"
        if failpoint:
            env["ISLANDS_FAILPOINT"] = failpoint  # core/failpoints.py: os._exit(137) at that step of the merge
        return env

    def start(self, resume: bool) -> subprocess.Popen:
        a = self.a
        args = ["resume", str(self.run)] if resume else [
            "submit", "--executor", "slurm", "--run-dir", str(self.run), "--workers", str(a.workers), "--rounds",
            str(a.rounds), "--inner-steps", str(a.inner_steps), *TINY, "--set", f"round.min_workers={a.quorum}",
            "--set", f"round.deadline_s={a.deadline_s}", "--set", "round.late_policy=fold", "--set", "round.max_retries=4",
            *(["--set", f"data.cache_dir={a.cache_dir}"] if a.cache_dir else [])]
        self.armed = self.kills[0] if self.kills and self.kills[0] != "sigkill" else None
        return subprocess.Popen([sys.executable, "-m", "orchestrator.cli", *args], cwd=ROOT, env=self._env(self.armed),
                                stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    def committed(self) -> int:
        r = 0
        while r < self.a.rounds and self.s.exists(L.round_record(r)):
            r += 1
        return r

    # -- the loop ------------------------------------------------------------------------------
    def drive(self) -> float:
        """Run to the end, killing and resuming the service as planned: a SIGKILL of its process group
        at a random moment of a round past the next planned one, or a failpoint armed in its
        environment that ends it at a given step of its next merge (exit 137)."""
        t0 = time.time()
        proc = self.start(resume=False)
        kill_at = None
        while True:
            done = self.committed()
            if proc.poll() is not None:
                if proc.returncode == 0 and done == self.a.rounds:
                    return time.time() - t0
                if proc.returncode != 137 or not self.armed:
                    raise RuntimeError(f"the merge service exited {proc.returncode} after {done} rounds; see {self.log.name}")
                proc = self._resume(done, f"failpoint {self.armed}: died during round {done}'s merge", {})
                continue
            if self.kills and self.kills[0] == "sigkill" and done >= self.kill_after[0] and done < self.a.rounds:
                kill_at = kill_at or time.time() + self.rng.uniform(0.5, self.a.deadline_s)
                if time.time() >= kill_at:
                    snapshot = {r: _strip(self.s.read_json(L.round_record(r))) for r in range(done)}
                    arrived = len(self.s.list(L.contributions_dir(done))) // 2
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                    self.kill_after.pop(0)
                    proc = self._resume(done, f"SIGKILL, round {done} open, {arrived} contribution(s) in", snapshot)
                    kill_at = None
            if self.on and done < self.a.rounds:
                self._inject(done)
                self._cancel(done)
            time.sleep(0.2)

    def _resume(self, done: int, how: str, snapshot: dict[int, Any]) -> subprocess.Popen:
        """Record the kill (with the committed records, which the resumed service must leave as they
        are), then start `orchestrate resume`."""
        snapshot = snapshot or {r: _strip(self.s.read_json(L.round_record(r))) for r in range(self.committed())}
        self.kills.pop(0)
        self.faults.append(Fault("service_killed", done, detail=how, data={"snapshot": snapshot}))
        print(f"  merge service killed ({how}); resuming", flush=True)
        return self.start(resume=True)

    def _inject(self, r: int) -> None:
        """Write round r's bad contribution once global_r is published; then cancel that worker's job."""
        if r in self.bad and r not in self.bad_written and read_manifest(self.s, L.global_weights(r)) is not None:
            w = self.rng.choice([w for w in range(self.a.workers) if w != self.slow])
            self.bad_written[r] = w
            sha = write_bad(self.s, r, w, self.bad[r], self.a)
            self.faults.append(Fault(self.bad[r], r, w, data={"digest": sha}))
            print(f"  wrote a {self.bad[r]} contribution for worker {w} in round {r}", flush=True)
        if r in self.bad_written and r not in self.bad_cancelled:
            entry = (self.s.read_json(L.round_jobs(r)) or {}).get("workers", {}).get(str(self.bad_written[r]))
            if entry:
                _scancel(entry["job_ids"][-1])
                self.bad_cancelled.add(r)

    def _cancel(self, r: int) -> None:
        jobs = (self.s.read_json(L.round_jobs(r)) or {}).get("workers", {})
        if r not in self.planned_rounds and jobs:
            self.planned_rounds.add(r)
            left = self.a.rounds - r
            n = min(self.cancel_budget - sum(f.kind == "job_cancelled" for f in self.faults) - len(self.timers),
                    math.ceil(self.cancel_budget / self.a.rounds) + (1 if left <= 2 else 0))
            pool = [w for w in range(self.a.workers) if w != self.bad_written.get(r)]
            for w in self.rng.sample(pool, max(0, min(n, len(pool)))):
                self.timers.append((time.time() + self.rng.uniform(0.5, self.a.deadline_s * 0.6), r, w))
        for t in [t for t in self.timers if t[0] <= time.time()]:
            self.timers.remove(t)
            _, tr, w = t
            entry = jobs.get(str(w)) if tr == r else None
            arrived = self.s.exists(manifest_key(L.contribution(tr, w)))
            if entry is None or arrived:
                continue  # its round closed or it delivered first: the budget moves to a later round
            job = entry["job_ids"][-1]
            _scancel(job)
            self.faults.append(Fault("job_cancelled", tr, w, detail=f"job {job}"))


def _strip(rec: dict[str, Any] | None) -> dict[str, Any]:
    return {k: v for k, v in (rec or {}).items() if k != "eval_loss"}


def _scancel(job_id: str) -> None:
    subprocess.run(["scancel", job_id], capture_output=True, timeout=30)


def write_bad(s: Storage, r: int, w: int, kind: str, a: argparse.Namespace) -> str:
    """A bad contribution with a worker's manifest; data first, manifest last, as a worker does."""
    base, _, _ = load_checkpoint(s, L.global_weights(r))
    gen = torch.Generator().manual_seed(r * 1000 + w)
    t = {k: (v + 1e-3 * torch.randn(v.shape, generator=gen)) if v.is_floating_point() else v for k, v in base.items()}
    name = sorted(n for n in t if t[n].is_floating_point() and t[n].dim() == 2)[0]
    if kind == "nan":
        t[name] = t[name].clone()
        t[name][0, 0] = float("nan")
    elif kind == "shape":
        t[name] = t[name][:-1].clone()
    key = L.contribution(r, w)
    manifest = {"round": r, "worker": w, "steps": a.inner_steps, "tokens": a.inner_steps * 4 * 32,
                "base": L.global_weights(r), "base_digest": read_manifest(s, L.global_weights(r))["digest"]}
    scratch = f"chaos/{kind}_{r:05d}.safetensors"
    m = write_checkpoint(s, scratch, t, manifest=manifest)
    raw = bytearray(s.read_bytes(scratch))
    if kind == "corrupt":
        raw[-5] ^= 0xFF  # flipped bytes in the data: only the digest can tell
    s.write_bytes(key, bytes(raw))
    s.write_json(manifest_key(key), {**m, "file": key.rsplit("/", 1)[-1]})
    return m["digest"]


# -- verdict ---------------------------------------------------------------------------------------
def _reasons(s: Storage, r: int, w: int, rec: dict[str, Any]) -> str:
    """Why worker w's contribution to round r was refused: the record, or the jobs file when the
    refusal sent the round back to resubmit that worker (merged without it later)."""
    failures = ((s.read_json(L.round_jobs(r)) or {}).get("workers", {}).get(str(w), {}).get("failures", []))
    return " | ".join([rec.get("rejected_reasons", {}).get(str(w), "")] + [f.get("rejected", "") for f in failures])


def assess(chaos: Chaos) -> None:
    """Mark each injected fault survived or not, from the run directory alone."""
    s, a = chaos.s, chaos.a
    done = chaos.committed()
    recs = [s.read_json(L.round_record(r)) for r in range(done)]
    for f in chaos.faults:
        if f.kind == "job_cancelled":
            f.survived = done == a.rounds and len(recs[f.round]["merged"]) >= a.quorum
        elif f.kind == "service_killed":
            f.survived = done == a.rounds and all(_strip(recs[r]) == snap for r, snap in f.data["snapshot"].items())
        elif f.kind in BAD_KINDS:
            rec = recs[f.round]
            why = _reasons(s, f.round, f.worker, rec)
            merged_bad = rec.get("contrib_digest", {}).get(str(f.worker)) == f.data["digest"]
            f.survived, f.detail = (not merged_bad and EXPECT[f.kind] in why), why.strip(" |")[:160]
    late = [r for r, rec in enumerate(recs) if chaos.slow in rec["dropped"]
            and "straggler" in rec["dropped_reasons"].get(str(chaos.slow), "")]
    folded = sum(1 for rec in recs for x in rec.get("folded", []) if x["worker"] == chaos.slow)
    chaos.faults.append(Fault("slow_worker", None, chaos.slow, survived=done == a.rounds and bool(late),
                              detail=f"late in {len(late)} rounds (closed at the deadline with the quorum), "
                                     f"{folded} late contribution(s) folded into a later round"))


def _counts(s: Storage, rounds: int) -> tuple[int, int]:
    accepted = rejected = 0
    for r in range(rounds):
        rec = s.read_json(L.round_record(r)) or {}
        accepted += len(rec.get("merged", [])) + len(rec.get("folded", []))
        rejected += len(rec.get("rejected", [])) + len(rec.get("fold_rejected", []))
        for e in ((s.read_json(L.round_jobs(r)) or {}).get("workers", {})).values():
            rejected += sum(1 for f in e.get("failures", []) if "rejected" in f)  # set aside, then resubmitted
    return accepted, rejected


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.chaos", description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--inner-steps", type=int, default=5)
    p.add_argument("--quorum", type=int, default=0, help="round.min_workers (default: half the workers, at least 2)")
    p.add_argument("--deadline-s", type=float, default=20.0, help="round.deadline_s")
    p.add_argument("--slow-s", type=float, default=0.0, help="the straggler's extra sleep (default 2 x deadline)")
    p.add_argument("--kills", type=int, default=3, help="times the merge service is SIGKILLed and resumed")
    p.add_argument("--cancel-fraction", type=float, default=0.25, help="share of worker jobs scancelled")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--clean", action="store_true", help="also time the same run without faults (overhead)")
    p.add_argument("--run-dir", help="parent folder of the runs (default: a new temporary folder)")
    p.add_argument("--cache-dir", help="data.cache_dir for the corpus")
    p.add_argument("--json", help="write the figures here as JSON")
    a = p.parse_args(argv)
    a.quorum = a.quorum or min(a.workers, max(2, a.workers // 2))
    a.slow_s = a.slow_s or 2 * a.deadline_s
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if subprocess.run(["sinfo", "-h"], capture_output=True).returncode != 0:
        print("chaos: no usable Slurm here (sinfo failed); start one: bash slurm_templates/local-cluster.sh up")
        return 2
    base = Path(a.run_dir or tempfile.mkdtemp(prefix="islands-chaos-"))
    base.mkdir(parents=True, exist_ok=True)
    print(f"chaos run: {a.workers} workers x {a.rounds} rounds on Slurm, runs under {base}", flush=True)
    chaos = Chaos(a, base / "chaos", faults_on=True)
    wall = chaos.drive()
    clean = Chaos(a, base / "clean", faults_on=False).drive() if a.clean else None
    assess(chaos)
    invalid = invalid_merges(chaos.s, a.rounds)
    rep = replay(chaos.s, load_run(chaos.s), a.rounds)
    accepted, rejected = _counts(chaos.s, a.rounds)
    for f in chaos.faults:
        where = f"round {f.round}" if f.round is not None else "every round"
        who = f" worker {f.worker}" if f.worker is not None else ""
        print(f"  {f.kind:15s} {where}{who}: {'survived' if f.survived else 'NOT SURVIVED'}  {f.detail}")
    print(f"  invalid merges: {invalid or 'none'}; replay: {rep['problems'] or 'every round bit for bit identical'}")
    print(f"  wall time {wall:.0f}s" + (f", clean run {clean:.0f}s, overhead {100 * (wall / clean - 1):+.0f}%" if clean else ""))
    survived = sum(bool(f.survived) for f in chaos.faults)
    figures = {"faults_injected": len(chaos.faults), "faults_survived": survived, "rounds": chaos.committed(),
               "rounds_total": a.rounds, "accepted": accepted, "rejected": rejected, "replay_identical": rep["identical"],
               "invalid_merges": invalid, "wall_s": round(wall, 1), "clean_wall_s": clean and round(clean, 1),
               "faults": [{k: v for k, v in vars(f).items() if k != "data"} for f in chaos.faults], "run_dir": str(base)}
    if a.json:
        Path(a.json).write_text(json.dumps(figures, indent=1))
    ok = survived == len(chaos.faults) and not invalid and rep["identical"] and chaos.committed() == a.rounds
    print(f"chaos: faults_injected={len(chaos.faults)} faults_survived={survived} rounds={chaos.committed()}/{a.rounds} "
          f"accepted={accepted} rejected={rejected} replay_identical={str(rep['identical']).lower()}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
