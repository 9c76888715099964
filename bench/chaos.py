"""Chaos run: a tiny DiLoCo run that must survive what a shared cluster does, judged fault by fault
and against a clean run of the same seed, bit for bit.

The run goes on the local executor or the real local Slurm (`--executor`, default Slurm where
`sinfo` answers), its merge service a process of its own. Every worker is required
(round.min_workers = K), so every fault must be absorbed without changing the maths and the
published weights must equal, byte for byte, those of the same run without faults. Meanwhile this
driver, watching the run directory only:

- cancels 25% of the worker jobs (--cancel-fraction) at random moments, each while it still owes
  its contribution (scancel; on the local executor SIGKILL to the job, as `orchestrate cancel`
  does); when none has landed by the last two rounds, one job is SIGKILLed at once;
- kills the merge service --kills times and starts `orchestrate resume RUN` again each time: a
  SIGKILL of its process group (local jobs die with it) at a random moment of a round, alternating
  with a failpoint (core/failpoints.py) that ends it at a given step of its next merge;
- plants a corrupt file, a NaN and a wrong-shape contribution, a FIFO and a link to a checkpoint
  outside the run, each with a worker's manifest, then cancels that worker's real job, so the
  service finds the planted file and nothing else;
- slows one worker (ISLANDS_SLOWPOINT: it sleeps before publishing) past every deadline;
- with --poison, plants a well-formed contribution with wrong weights that nothing can tell from a
  real one (each entry off by up to 3x round.max_update, inside the bound a contribution in weights
  is held to): the comparison with the clean run must then report replay_identical=false.

Every fault has its own check (bench/chaos_checks.py). Then the clean run, and every published
global checkpoint and the final model are re-hashed in both runs and compared.

    python -m bench.chaos [--executor local] [--workers 3] [--rounds 6]

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

from bench import chaos_checks as check
from core import codec, trust
from core.checkpoint import load_checkpoint, read_manifest
from core.checkpoint_writer import write_checkpoint
from core.layout import RunLayout, manifest_key
from core.storage import Storage
from orchestrator.executor import kill_local_job

L = RunLayout()
ROOT = Path(__file__).resolve().parent.parent
TINY = ["--set", "model.n_layer=1", "--set", "model.n_embd=32", "--set", "model.n_head=2", "--set", "model.block_size=32",
        "--set", "inner.batch_size=4", "--set", "inner.warmup_steps=2", "--set", "data.eval_batches=1",
        "--set", "round.poll_s=0.2", "--set", "executor.preset=local",
        # per-round jobs: a planted file is kept from being overwritten by cancelling the one job that
        # would publish over it; a persistent worker may already have published (docs/reliability.md)
        "--set", "round.worker_mode=per_round"]
PLANTED = ("corrupt", "nan", "shape", "fifo", "symlink")
KILL_POINTS = ("merge.after_global", "service.after_record", "merge.while_reading")


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
        # the clean run is the oracle: it may run elsewhere (--clean-executor), its bytes are the same
        self.executor = args.executor if faults_on else args.clean_executor or args.executor
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
        kinds = (("poison",) if args.poison else ()) + PLANTED
        self.plant = {q: kinds[i] for i, q in enumerate(self.rng.sample(range(r), min(len(kinds), r)))} if self.on else {}
        self.cancel_budget = math.ceil(args.cancel_fraction * args.workers * r) if self.on else 0
        self.timers: list[tuple[float, int, int, bool]] = []  # (when, round, worker, hard) cancellations
        self.planned_rounds: set[int] = set()
        self.planted: dict[int, int] = {}  # round -> worker whose file we planted
        self.plant_cancelled: set[int] = set()

    # -- the service process -------------------------------------------------------------------
    def _env(self, failpoint: str | None) -> dict[str, str]:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        env.pop("ISLANDS_FAILPOINT", None)
        env.pop("ISLANDS_SLOWPOINT", None)
        if self.on:
            env["ISLANDS_SLOWPOINT"] = f"worker_{self.slow:03d}.publish={self.a.slow_s}"
        if failpoint:
            env["ISLANDS_FAILPOINT"] = failpoint  # core/failpoints.py: os._exit(137) at that step of the merge
        return env

    def start(self, resume: bool) -> subprocess.Popen:
        a = self.a
        args = ["resume", str(self.run)] if resume else [
            "submit", "--executor", self.executor, "--run-dir", str(self.run), "--workers", str(a.workers), "--rounds",
            str(a.rounds), "--inner-steps", str(a.inner_steps), "--set", f"seed={a.seed}", *TINY,
            "--set", f"round.min_workers={a.workers}", "--set", f"round.deadline_s={a.deadline_s}",
            "--set", "round.stream_merge=false", "--set", "round.max_retries=8",
            # bit for bit against the clean run: a killed worker must restart from the state it had (a
            # snapshot every round), and the checks read every round's tensors (none deleted)
            "--set", "round.state_every=1", "--set", "round.keep_last=0",
            *(["--set", f"data.cache_dir={a.cache_dir}"] if a.cache_dir else [])]
        self.armed = self.kills[0] if self.kills and self.kills[0] != "sigkill" else None
        return subprocess.Popen([sys.executable, "-m", "orchestrator.cli", *args], cwd=ROOT, env=self._env(self.armed),
                                stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    def committed(self) -> int:
        r = 0
        while r < self.a.rounds and self.s.exists(L.round_record(r)):
            r += 1
        return r

    def _records(self) -> dict[int, Any]:
        return {q: check.strip(self.s.read_json(L.round_record(q))) for q in range(self.committed())}

    # -- the loop ------------------------------------------------------------------------------
    def drive(self) -> float:
        """Run to the end, killing and resuming the service as planned."""
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
                proc = self._resume(done, f"failpoint {self.armed}: died during round {done}'s merge", self._records())
                continue
            if self.kills and self.kills[0] == "sigkill" and self.kill_after[0] <= done < self.a.rounds:
                kill_at = kill_at or time.time() + self.rng.uniform(0.5, 2 * self.a.slow_s)
                if time.time() >= kill_at:
                    snapshot = self._records()
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                    self.kill_after.pop(0)
                    proc = self._resume(done, f"SIGKILL, round {done} open", snapshot)
                    kill_at = None
            if self.on and done < self.a.rounds:
                self._plant(done)
                self._cancel(done)
            time.sleep(0.2)

    def _resume(self, done: int, how: str, snapshot: dict[int, Any]) -> subprocess.Popen:
        self.kills.pop(0)
        self.faults.append(Fault("service_killed", done, detail=how, data={"snapshot": snapshot}))
        print(f"  merge service killed ({how}); resuming", flush=True)
        return self.start(resume=True)

    def _plant(self, r: int) -> None:
        """Plant round r's file once global_r is published and the run exists (its config, written after
        global_0: orchestrator.run_models); then cancel that worker's job."""
        if r in self.plant and r not in self.planted and read_manifest(self.s, L.global_weights(r)) is not None \
                and self.s.exists(L.CONFIG):
            w = self.rng.choice([w for w in range(self.a.workers) if w != self.slow])
            self.planted[r] = w
            digest = plant(self.s, r, w, self.plant[r], self.a)
            self.faults.append(Fault(self.plant[r], r, w, data={"digest": digest}))
            print(f"  planted a {self.plant[r]} contribution for worker {w} in round {r}", flush=True)
        if r in self.planted and r not in self.plant_cancelled:
            entry = (self.s.read_json(L.round_jobs(r)) or {}).get("workers", {}).get(str(self.planted[r]))
            if entry:
                self._cancel_job(entry["job_ids"][-1])
                self.plant_cancelled.add(r)

    def _cancel(self, r: int) -> None:
        jobs = (self.s.read_json(L.round_jobs(r)) or {}).get("workers", {})
        if r not in self.planned_rounds and jobs:
            self.planned_rounds.add(r)
            left = self.a.rounds - r
            # a cancel the job outran (it published first) cost nothing: it leaves the budget
            landed = [f for f in self.faults if f.kind == "job_cancelled"
                      and not check.delivered_before(self.s, f.round, f.worker, f.data)]
            n = min(self.cancel_budget - len(landed) - len(self.timers),
                    math.ceil(self.cancel_budget / self.a.rounds) + (1 if left <= 2 else 0))
            pool = [w for w in range(self.a.workers) if w not in (self.planted.get(r), self.slow)]
            # a round of a few steps can publish within scancel's grace (SIGTERM, then SIGKILL KillWait
            # later): when none has landed by the last two rounds, SIGKILL at once, as a dying node
            # would, so that a run with a budget always has one
            hard = left <= 2 and not landed
            for w in self.rng.sample(pool, max(0, min(n, len(pool)))):
                self.timers.append((time.time() + (0.0 if hard else self.rng.uniform(0.5, 3.0)), r, w, hard))
        for t in [t for t in self.timers if t[0] <= time.time()]:
            self.timers.remove(t)
            _, tr, w, hard = t
            entry = jobs.get(str(w)) if tr == r else None
            if entry is None or self.s.exists(manifest_key(L.contribution(tr, w))):
                continue  # its round closed or it delivered first: the budget moves to a later round
            job = entry["job_ids"][-1]
            if self._cancel_job(job, hard):
                how = "SIGKILL at once" if hard else "cancelled"
                self.faults.append(Fault("job_cancelled", tr, w, detail=f"job {job} {how}", data={"job": job, "at": time.time()}))

    def _cancel_job(self, job: str, hard: bool = False) -> bool:
        if self.executor == "slurm":
            cmd = ["scancel", *(["--signal=KILL", "--full"] if hard else []), job]
            return subprocess.run(cmd, capture_output=True, timeout=30).returncode == 0
        if not Path(f"/proc/{job}").exists():
            return False
        kill_local_job(job)  # what the local executor's cancel does: its tasks and controller SIGKILLed
        return True


def plant(s: Storage, r: int, w: int, kind: str, a: argparse.Namespace) -> str | None:
    """A planted contribution with a worker's manifest (data first, manifest last, as a worker does);
    returns the digest its manifest claims."""
    base, _, _ = load_checkpoint(s, L.global_weights(r))
    gen = torch.Generator().manual_seed(r * 1000 + w)
    # a poison inside what a round can move an entry (core.codec.max_update): no check tells it from a real one
    noise = codec.max_update(trust.load_run_config(s)) if kind == "poison" else 1e-3
    t = {k: (v + noise * torch.randn(v.shape, generator=gen).clamp_(-3, 3)) if v.is_floating_point() else v
         for k, v in base.items()}
    name = sorted(n for n in t if t[n].is_floating_point() and t[n].dim() == 2)[0]
    if kind == "nan":
        t[name][0, 0] = float("nan")
    elif kind == "shape":
        t[name] = t[name][:-1].clone()
    key = L.contribution(r, w)
    manifest = {"round": r, "worker": w, "steps": a.inner_steps, "tokens": a.inner_steps * 4 * 32,
                "base": L.global_weights(r), "base_digest": read_manifest(s, L.global_weights(r))["digest"]}
    scratch = f"chaos/{kind}_{r:05d}.safetensors"
    m = write_checkpoint(s, scratch, t, manifest=manifest)
    path = Path(s.path(key))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)  # its worker may have published already: the planted file replaces it
    if kind == "fifo":
        os.mkfifo(path)  # opening it to read would block until someone writes: forever
    elif kind == "symlink":  # a co-tenant's checkpoint outside the run
        outside = Path(s.root).parent / f"outside-{r}.safetensors"
        outside.write_bytes(s.read_bytes(scratch))
        path.symlink_to(outside)
    else:
        raw = bytearray(s.read_bytes(scratch))
        if kind == "corrupt":
            raw[-5] ^= 0xFF  # flipped bytes in the data: only the digest can tell
        s.write_bytes(key, bytes(raw))
    s.write_json(manifest_key(key), {**m, "file": key.rsplit("/", 1)[-1]})
    return m["digest"]


def assess(chaos: Chaos, clean: Storage) -> None:
    """Mark each injected fault survived or not, each by its own check."""
    s, a = chaos.s, chaos.a
    moot = [f for f in chaos.faults if f.kind == "job_cancelled" and check.delivered_before(s, f.round, f.worker, f.data)]
    for f in moot:  # it published between our look and the cancel: nothing was lost, nothing to survive
        print(f"  (job_cancelled round {f.round} worker {f.worker}: {f.detail} had published before the cancel landed; "
              "not counted)")
        chaos.faults.remove(f)
    for f in chaos.faults:
        if f.kind == "job_cancelled":
            f.survived, f.detail = check.cancelled_job_survived(s, f.round, f.worker, f.data["job"])
        elif f.kind == "service_killed":
            ok, why = check.kill_survived(s, clean, f.round, f.data["snapshot"])
            f.survived, f.detail = ok, f"{f.detail}; {why}"
        elif f.kind == "poison":
            f.survived, f.detail = check.poisoned_file_survived(s, f.round, f.worker, f.data["digest"])
        elif f.kind in PLANTED:
            f.survived, f.detail = check.planted_file_survived(s, f.round, f.worker, f.kind, f.data["digest"])
    ok, why = check.slow_worker_survived(s, chaos.slow, a.rounds, a.deadline_s)
    chaos.faults.append(Fault("slow_worker", None, chaos.slow, survived=ok, detail=why))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.chaos", description=__doc__.split("\n\n")[0])
    p.add_argument("--executor", choices=["auto", "local", "slurm"], default="auto",
                   help="where the jobs run (auto: Slurm if `sinfo` answers, else local)")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--inner-steps", type=int, default=5)
    p.add_argument("--deadline-s", type=float, default=2.0, help="round.deadline_s (the straggler misses it)")
    p.add_argument("--slow-s", type=float, default=4.0, help="the straggler's extra sleep before publishing")
    p.add_argument("--kills", type=int, default=3, help="times the merge service is killed and resumed")
    p.add_argument("--cancel-fraction", type=float, default=0.25, help="share of worker jobs cancelled")
    p.add_argument("--clean-executor", choices=["local", "slurm", "inline"],
                   help="where the clean run's jobs run (default: --executor's); inline, threads of its service, "
                        "publishes the same bytes and starts no worker process")
    p.add_argument("--poison", action="store_true",
                   help="also plant a well-formed contribution with wrong weights: the run must then differ")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--run-dir", help="parent folder of the runs (default: a new temporary folder)")
    p.add_argument("--cache-dir", help="data.cache_dir for the corpus")
    p.add_argument("--json", help="write the figures here as JSON")
    a = p.parse_args(argv)
    if a.executor == "auto":
        try:
            a.executor = "slurm" if subprocess.run(["sinfo", "-h"], capture_output=True).returncode == 0 else "local"
        except OSError:
            a.executor = "local"
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.executor == "slurm" and subprocess.run(["sinfo", "-h"], capture_output=True).returncode != 0:
        print("chaos: no usable Slurm here (sinfo failed); start one: bash slurm_templates/local-cluster.sh up, "
              "or run with --executor local")
        return 2
    base = Path(a.run_dir or tempfile.mkdtemp(prefix="islands-chaos-"))
    base.mkdir(parents=True, exist_ok=True)
    print(f"chaos run: {a.workers} workers x {a.rounds} rounds, {a.executor} executor, runs under {base}", flush=True)
    chaos = Chaos(a, base / "chaos", faults_on=True)
    wall = chaos.drive()
    print("  chaos run done; the clean run of the same seed", flush=True)
    clean = Chaos(a, base / "clean", faults_on=False)
    clean_wall = clean.drive()
    assess(chaos, clean.s)
    invalid = check.invalid_merges(chaos.s, a.rounds)
    differ = check.compare_runs(chaos.s, clean.s, a.rounds)
    accepted, rejected = check.counts(chaos.s, a.rounds)
    for f in chaos.faults:
        where = f"round {f.round}" if f.round is not None else "every round"
        who = f" worker {f.worker}" if f.worker is not None else ""
        print(f"  {f.kind:15s} {where}{who}: {'survived' if f.survived else 'NOT SURVIVED'}  {f.detail}")
    print(f"  invalid merges: {invalid or 'none'}; against the clean run: {differ or 'every global bit for bit identical'}")
    print(f"  wall time {wall:.0f}s, clean run {clean_wall:.0f}s, overhead {100 * (wall / clean_wall - 1):+.0f}%")
    survived = sum(bool(f.survived) for f in chaos.faults)
    identical = not differ
    figures = {"executor": a.executor, "faults_injected": len(chaos.faults), "faults_survived": survived,
               "rounds": chaos.committed(), "rounds_total": a.rounds, "accepted": accepted, "rejected": rejected,
               "replay_identical": identical, "differences": differ, "invalid_merges": invalid,
               "wall_s": round(wall, 1), "clean_wall_s": round(clean_wall, 1),
               "faults": [{k: v for k, v in vars(f).items() if k != "data"} for f in chaos.faults], "run_dir": str(base)}
    if a.json:
        Path(a.json).write_text(json.dumps(figures, indent=1))
    ok = survived == len(chaos.faults) and not invalid and identical and chaos.committed() == a.rounds
    print(f"chaos: faults_injected={len(chaos.faults)} faults_survived={survived} rounds={chaos.committed()}/{a.rounds} "
          f"accepted={accepted} rejected={rejected} replay_identical={str(identical).lower()}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
