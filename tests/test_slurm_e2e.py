"""Whole runs through sbatch on a real Slurm (slurm_templates/local-cluster.sh up): no mocks.

Each test uses a fresh run directory (and so a fresh submitit folder): job ids restart after
`up --fresh`, and a reused folder would hand back an earlier cluster's results.
"""
from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from core.records import RUN_INFO
from core.storage import Storage
from orchestrator.cli import main
from slurm_support import slurm_test, wait_for_sacct_state

pytestmark = [*slurm_test, pytest.mark.slow]
ROOT = Path(__file__).resolve().parent.parent
TINY = ["--set", "model.n_layer=1", "--set", "model.n_embd=32", "--set", "model.n_head=2",
        "--set", "model.block_size=32", "--set", "inner.batch_size=4", "--set", "inner.warmup_steps=2",
        "--set", "data.eval_batches=2", "--set", "round.poll_s=0.2"]


def _args(run: Path, cache: str, *extra: str) -> list[str]:
    return ["submit", "--executor", "slurm", "--set", "executor.preset=local", "--run-dir", str(run),
            "--set", f"data.cache_dir={cache}", *TINY, *extra]


def _start(args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "orchestrator.cli", *args], cwd=ROOT, env={**os.environ, **(env or {})},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)


def _wait_for(pred, what: str, timeout: float = 120, proc: subprocess.Popen | None = None):
    deadline = time.time() + timeout
    while True:
        value = pred()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"orchestrator exited {proc.returncode} before {what}:\n{proc.stdout.read().decode()[-3000:]}")
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def _finish(proc: subprocess.Popen, timeout: float = 240) -> str:
    out, _ = proc.communicate(timeout=timeout)
    text = out.decode()
    assert proc.returncode == 0, text[-3000:]
    return text


def test_rounds_are_one_array_job_each(tmp_path, corpus_cache, monkeypatch):
    # A logging shim in front of the real sbatch counts the calls (it execs the real one).
    shim = tmp_path / "bin"
    shim.mkdir()
    real = subprocess.run(["bash", "-c", "command -v sbatch"], capture_output=True, text=True).stdout.strip()
    (shim / "sbatch").write_text(f'#!/bin/sh\ncat "$1" >> {tmp_path}/sbatch.log\nexec {real} "$@"\n')
    (shim / "sbatch").chmod(stat.S_IRWXU)
    monkeypatch.setenv("PATH", f"{shim}:{os.environ['PATH']}")
    run = tmp_path / "run"
    assert main(_args(run, corpus_cache, "--workers", "2", "--rounds", "3", "--inner-steps", "3",
                      "--set", "round.worker_mode=per_round")) == 0  # a job array per round, counted here
    scripts = (tmp_path / "sbatch.log").read_text()
    assert scripts.count("#!/bin/bash") == 3  # one sbatch per round, not one per worker
    assert scripts.count("#SBATCH --array=0-1%2") == 3 and "#SBATCH --nodes=1" in scripts
    s = Storage(str(run))
    for r in range(3):
        ids = [e["job_ids"][0] for e in s.read_json(f"rounds/{r:05d}/jobs.json")["workers"].values()]
        assert len({i.split("_")[0] for i in ids}) == 1 and sorted(i.split("_")[1] for i in ids) == ["0", "1"]
        assert s.read_json(f"rounds/{r:05d}/record.json")["merged"] == [0, 1]
    # sacct records lag the job's end by up to a second: poll rather than assert at once
    assert len(wait_for_sacct_state(ids[0].split("_")[0], "COMPLETED", array_tasks=range(2))) == 2


def test_scancelled_worker_round_closes_with_quorum(tmp_path, corpus_cache):
    run = tmp_path / "run"
    proc = _start(_args(run, corpus_cache, "--workers", "2", "--rounds", "2", "--inner-steps", "3",
                        "--set", "round.min_workers=1", "--set", "round.max_retries=0"))
    s = Storage(str(run))
    jobs = _wait_for(lambda: s.read_json("rounds/00000/jobs.json"), "round 0 submission", proc=proc)
    victim = jobs["workers"]["1"]["job_ids"][0]
    running = lambda: "RUNNING" in subprocess.run(["squeue", "-h", "-r", "-o", "%T", "-j", victim],  # noqa: E731
                                                  capture_output=True, text=True).stdout
    _wait_for(running, f"job {victim} to run", proc=proc)  # cancelled mid-round, not while queued
    subprocess.run(["scancel", victim], check=True)
    _finish(proc)
    first = s.read_json("rounds/00000/record.json")
    assert first["merged"] == [0] and first["dropped"] == [1]
    assert "CANCELLED" in first["dropped_reasons"]["1"], first
    failures = s.read_json("rounds/00000/jobs.json")["workers"]["1"]["failures"]
    assert failures[0]["job_id"] == victim and failures[0]["state"].startswith("CANCELLED")
    # a replacement worker 1 is submitted for the next round and is merged
    assert s.read_json("rounds/00001/record.json")["merged"] == [0, 1]
    # status after the run: how each job ended (sacct), not how it looked when its round merged
    from orchestrator.jobstatus import ACTIVE
    from orchestrator.status_cli import status_with_jobs

    def ended_jobs():  # the last jobs end as the run does, and sacct lags the controller by seconds
        st = status_with_jobs(s, str(run / "jobs"))
        jobs = {(r["round"], w): j for r in st["rounds"] for w, j in r["jobs"].items()}
        return not any(j["state"].split()[0] in ACTIVE for j in jobs.values()) and (st, jobs)
    st, ended = _wait_for(ended_jobs, "every job of the run to have ended in sacct")
    assert st["scheduler"].startswith("reachable") and ended[(0, "1")]["state"].startswith("CANCELLED"), ended
    assert all(j["state"] == "COMPLETED" and j["run_s"] is not None for k, j in ended.items() if k != (0, "1")), ended


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_two_rank_worker_requeued_mid_round(tmp_path, corpus_cache, parallel):
    """Worker jobs of two ranks (srun starts both; gloo on CPUs stands in for NCCL on a node's
    GPUs), one signalled mid-round: the in-flight checkpoint is saved (DDP: by rank 0 from
    submitit's handler; FSDP: gathered by both ranks after the step), the requeued job's two ranks
    resume from it and publish one contribution made by both. FSDP in a DiLoCo run of 2 workers x
    2 rounds (persistent jobs), its eval loss falling. (One-rank workers are requeued mid-round in
    the overlapped replay test below.) `status` shows the running job, and sacct the requeue."""
    run = tmp_path / "run"
    # FSDP's per-block gathers make a CPU step ~5x slower; two 2-rank workers share the 2 cores
    workers, rounds, steps, cpus = {"ddp": (1, 1, 300, 4), "fsdp": (2, 2, 300, 2)}[parallel]
    # worker 0's round lasts >= 9 s however fast or loaded the machine (30 ms a step): the signal lands mid-round
    proc = _start(_args(run, corpus_cache, "--workers", str(workers), "--rounds", str(rounds), "--inner-steps",
                        str(steps), "--set", "executor.tasks_per_node=2", "--set", f"executor.cpus_per_task={cpus}",
                        "--set", "inner.device=cpu", "--set", f"inner.parallel={parallel}"),
                  env={"ISLANDS_SLOWPOINT": "worker_000.step=0.03"} if parallel == "ddp" else None)
    s = Storage(str(run))
    beat = _wait_for(lambda: (p := s.read_json("workers/worker_000/progress.json")) and p["step"] >= 20 and p,
                     "worker 0 training", proc=proc)
    job = s.read_json(f"rounds/{beat['round']:05d}/jobs.json")["workers"]["0"]["job_ids"][-1]
    # status shows the running worker's Slurm job, its state, queue wait, run time and progress
    from orchestrator.status_cli import status_with_jobs
    w0 = status_with_jobs(s, str(run / "jobs"))["current_round"]["workers"]["0"]
    assert w0["job_id"] == job and w0["state"] == "RUNNING" and w0["queue_wait_s"] is not None
    assert w0["run_s"] >= 0 and w0["progress"]["step"] >= 20
    # What Slurm sends before a time limit or preemption (submitit's own test helper does the same)
    subprocess.run(["scancel", "--signal", "USR2", job], check=True)
    _finish(proc, timeout=300)
    manifest = s.read_json(f"rounds/{beat['round']:05d}/contrib/worker_000.json")
    assert manifest["resumed_at_step"] is not None and manifest["resumed_at_step"] >= beat["step"]
    assert not s.exists(f"workers/worker_000/inflight_{beat['round']:05d}.safetensors")
    states = subprocess.run(["sacct", "-D", "-P", "-n", "-X", "-o", "JobID,State", "-j", job.split("_")[0]],
                            capture_output=True, text=True).stdout
    assert "REQUEUED" in states or "PREEMPTED" in states or states.count("\n") >= 2, states
    for r in range(rounds):
        assert s.read_json(f"rounds/{r:05d}/record.json")["merged"] == list(range(workers))
        for w in range(workers):
            m = s.read_json(f"rounds/{r:05d}/contrib/worker_{w:03d}.json")
            assert m["ranks"] == 2 and m["steps"] == steps, m
    last = s.read_json(f"rounds/{rounds - 1:05d}/record.json")["eval_loss"]
    assert last < s.read_json(RUN_INFO)["initial_eval_loss"]
    tasks = subprocess.run(["sacct", "-P", "-n", "-o", "JobID,NTasks", "-j", job.split("_")[0]],
                           capture_output=True, text=True).stdout
    assert any(line.split("|")[1] == "2" for line in tasks.splitlines() if line.count("|") == 1), tasks  # srun ran 2 tasks


def test_merge_service_killed_and_resumed(tmp_path, corpus_cache, capsys):
    run = tmp_path / "run"
    proc = _start(_args(run, corpus_cache, "--workers", "2", "--rounds", "3", "--inner-steps", "3"))
    s = Storage(str(run))
    _wait_for(lambda: s.exists("rounds/00001/jobs.json"), "round 1 submission", proc=proc)
    os.killpg(proc.pid, signal.SIGKILL)  # the service dies while round 1's jobs are in Slurm
    proc.wait()
    first = s.read_json("rounds/00000/record.json")
    round1_jobs = s.read_json("rounds/00001/jobs.json")
    assert main(["resume", str(run)]) == 0
    after = s.read_json("rounds/00000/record.json")
    assert {k: v for k, v in after.items() if k != "eval_loss"} == {k: v for k, v in first.items() if k != "eval_loss"}
    # the jobs already in Slurm were adopted, not submitted again
    assert s.read_json("rounds/00001/jobs.json")["workers"] == round1_jobs["workers"]
    capsys.readouterr()
    main(["status", str(run), "--json"])
    st = json.loads(capsys.readouterr().out)
    assert st["state"] == "done" and [r["round"] for r in st["rounds"]] == [0, 1, 2]


def test_a_job_sbatch_refuses_is_one_clear_error(tmp_path, corpus_cache, capsys):
    """Slurm refuses what no node has (64 GB on nodes of 4000 MB): asked with `sbatch --test-only`
    before anything is made, the submit stops with Slurm's reason, what was asked and what to change,
    not submitit's traceback, and leaves no run directory."""
    run = tmp_path / "run"
    assert main(_args(run, corpus_cache, "--set", "executor.mem_gb=64", "--workers", "2", "--rounds", "1")) == 2
    out = capsys.readouterr()
    assert "error: --executor slurm: Slurm refuses the worker jobs: " in out.out
    assert "65536MB of memory" in out.out and "executor.mem_gb" in out.out
    assert "Traceback" not in out.out + out.err and "sbatch: error" not in out.err and not run.exists()


def test_detached_merge_service_runs_as_a_slurm_job(tmp_path, corpus_cache, capsys):
    from orchestrator.runstate import run_status

    run = tmp_path / "run"
    assert main(_args(run, corpus_cache, "--workers", "2", "--rounds", "2", "--inner-steps", "3", "--detach")) == 0
    out = capsys.readouterr().out
    job = out.split("Slurm job ")[1].split(";")[0]
    s = Storage(str(run))
    _wait_for(lambda: run_status(s)["state"] == "done", "the detached run to finish", timeout=240)
    assert len(wait_for_sacct_state(job, "COMPLETED")) == 1  # the service's own job ended cleanly
    assert s.read_json("rounds/00001/record.json")["merged"] == [0, 1]


def test_persistent_workers_serve_rounds_across_a_requeue(tmp_path, corpus_cache):
    """One job per worker serves every round; signalled as at its time limit, it is requeued and carries on."""
    run = tmp_path / "run"
    rounds = 6
    proc = _start(_args(run, corpus_cache, "--workers", "2", "--rounds", str(rounds), "--inner-steps", "30",
                        "--set", "round.worker_mode=persistent"))
    s = Storage(str(run))
    _wait_for(lambda: s.exists("rounds/00001/record.json"), "two rounds served", timeout=180, proc=proc)
    job = s.read_json("rounds/00000/jobs.json")["workers"]["0"]["job_ids"][0]
    # USR2 is what Slurm sends before the time limit (--signal=USR2@...): submitit checkpoints and requeues
    subprocess.run(["scancel", "--signal", "USR2", job], check=True)
    _finish(proc, timeout=300)
    jobs = [s.read_json(f"rounds/{r:05d}/jobs.json") for r in range(rounds)]
    assert sum(j.get("sbatch_calls", 0) for j in jobs) == 1  # the queue was paid once
    ids = {w: {tuple(j["workers"][w]["job_ids"]) for j in jobs} for w in ("0", "1")}
    assert all(len(v) == 1 for v in ids.values()), ids  # the same job served every round
    assert all(s.read_json(f"rounds/{r:05d}/record.json")["merged"] == [0, 1] for r in range(rounds))
    history = subprocess.run(["sacct", "-D", "-P", "-n", "-X", "-o", "JobID,State", "-j", job.split("_")[0]],
                             capture_output=True, text=True).stdout
    assert "REQUEUED" in history, history  # requeued, and no contribution was lost
    waits = [s.read_json(f"rounds/{r:05d}/contrib/worker_001.json")["waited_s"] for r in range(1, rounds)]
    assert all(w is not None and w >= 0 for w in waits)  # idle time between rounds is recorded


def test_cancel_lets_slurm_workers_save_their_round_and_end_on_their_own(tmp_path, corpus_cache, capsys):
    """`orchestrate cancel` mid-round: each persistent worker (a Slurm job) sees CANCEL between two
    steps, saves its round's in-flight checkpoint and ends by itself within the grace wait
    (COMPLETED in sacct: never killed by scancel); the service stops at its next poll."""
    from core.checkpoint import read_manifest
    from core.layout import RunLayout
    from orchestrator.runstate import read_heartbeat
    run = tmp_path / "run"
    proc = _start(_args(run, corpus_cache, "--workers", "2", "--rounds", "3", "--inner-steps", "5000"))
    s = Storage(str(run))
    _wait_for(lambda: all((read_heartbeat(s, w) or {}).get("step", 0) > 0 for w in (0, 1)), "both workers to train",
              timeout=180, proc=proc)
    assert main(["cancel", str(run)]) == 0
    assert "its workers save their state first" in capsys.readouterr().out
    assert proc.wait(timeout=60) == 3, proc.stdout.read().decode()[-3000:]
    saved = [read_manifest(s, RunLayout().worker_inflight(w, 0)) for w in (0, 1)]
    assert all(m is not None and 0 < m["steps_done"] < 5000 for m in saved), saved
    for w in (0, 1):
        job = s.read_json("rounds/00000/jobs.json")["workers"][str(w)]["job_ids"][0]
        assert set(wait_for_sacct_state(job, "COMPLETED").values()) == {"COMPLETED"}


def test_lte_four_workers_as_slurm_jobs(tmp_path, corpus_cache, capsys):
    """`--algorithm lte --workers 4` on the real scheduler: each head is its own array task on its
    own emulated node, only heads cross storage, and the merged base moves every round."""
    run = tmp_path / "run"
    assert main(_args(run, corpus_cache, "--algorithm", "lte", "--workers", "4", "--rounds", "2",
                      "--inner-steps", "3", "--set", "lte.rank=4")) == 0
    capsys.readouterr()
    assert main(["status", str(run), "--json"]) == 0
    st = json.loads(capsys.readouterr().out)
    assert st["state"] == "done" and st["algorithm"] == "lte"
    assert [r["merged"] for r in st["rounds"]] == [[0, 1, 2, 3]] * 2
    s = Storage(str(run))
    jobs = [e["job_ids"][0] for e in s.read_json("rounds/00001/jobs.json")["workers"].values()]
    assert len({j.split("_")[0] for j in jobs}) == 1 and len(set(jobs)) == 4  # one array, 4 tasks
    assert len(wait_for_sacct_state(jobs[0].split("_")[0], "COMPLETED", array_tasks=range(4))) == 4
    full = s.read_json("global/round_00001.json")["bytes"]
    heads = [s.read_json(f"rounds/00001/contrib/worker_{w:03d}.json") for w in range(4)]
    assert all(h["bytes"] < full / 2 and h["lte"]["rank"] == 4 for h in heads)


def _replay_digests(run: Path, rounds: int) -> list[str]:
    s = Storage(str(run))
    return [s.read_json(f"rounds/{r:05d}/record.json")["global_digest"] for r in range(rounds)]


def test_overlapped_workers_requeued_ahead_and_mid_round_are_replayed_bit_for_bit(tmp_path, corpus_cache):
    """round.overlap on the real scheduler, each worker's job signalled as at its time limit (USR2):
    worker 0 while it trains ahead of its next round's global (worker 1 is slow to publish, so the
    merge waits for it), whose steps are then lost and whose requeued job starts the round from its
    base; worker 1 in the middle of a round it had adopted the global of, whose in-flight
    checkpoint keeps the adoption step. The run finishes, and its replay on the inline executor,
    which knows nothing of the requeues, equals it global by global: what the run recorded is what
    it did. (The replay pins the source's torch threads: a sum split over other threads differs.)"""
    run, rounds = tmp_path / "run", 4
    # worker 1 slow to publish (a slowpoint, inherited by the jobs): worker 0 then trains ahead ~3 s a round
    proc = _start(_args(run, corpus_cache, "--workers", "2", "--rounds", str(rounds), "--inner-steps", "20000",
                        "--set", "round.overlap=rebase", "--set", "round.budget=seconds", "--set", "round.budget_seconds=3",
                        "--set", "inner.threads=1"),  # the replay's too: one thread per worker on this machine
                  env={"ISLANDS_SLOWPOINT": "worker_001.publish=3"})
    s = Storage(str(run))

    def job(w: int) -> str:
        return s.read_json("rounds/00000/jobs.json")["workers"][str(w)]["job_ids"][0]

    def training(w: int, ahead: bool):  # the round worker w trains, ahead of its base (or with it adopted)
        p = s.read_json(f"workers/worker_{w:03d}/progress.json")
        return p["round"] if p and 0 < p["round"] < rounds - 1 and p.get("ahead") is ahead else None

    ahead = _wait_for(lambda: training(0, ahead=True), "worker 0 training ahead", timeout=180, proc=proc)
    subprocess.run(["scancel", "--signal", "USR2", job(0)], check=True)
    mid = _wait_for(lambda: training(1, ahead=False), "worker 1 training a round it adopted", timeout=180, proc=proc)
    subprocess.run(["scancel", "--signal", "USR2", job(1)], check=True)
    _finish(proc, timeout=400)
    manifests = {(r, w): s.read_json(f"rounds/{r:05d}/contrib/worker_{w:03d}.json") for r in range(rounds) for w in (0, 1)}
    assert "overlap" not in manifests[ahead, 0], manifests[ahead, 0]  # the steps ahead were lost: from its base
    assert any(m.get("resumed_at_step") is not None and "overlap" in m for (r, w), m in manifests.items() if w == 1), \
        {k: (m.get("resumed_at_step"), m.get("overlap")) for k, m in manifests.items()}
    for j in (job(0), job(1)):
        history = subprocess.run(["sacct", "-D", "-P", "-n", "-X", "-o", "JobID,State", "-j", j.split("_")[0]],
                                 capture_output=True, text=True).stdout
        assert "REQUEUED" in history, history
    again = tmp_path / "replay"
    assert main(["submit", "--replay", str(run), "--run-dir", str(again), "--executor", "inline"]) == 0
    assert _replay_digests(again, rounds) == _replay_digests(run, rounds), (ahead, mid)


def test_the_vision_task_and_a_users_task_run_as_slurm_jobs(tmp_path, capsys):
    """Task digits (a ViT on real images) with diloco and lte (heads on its attention and MLP), and a
    user's task imported from a directory outside the repository (task_path) with lofi: each as
    worker jobs on the real scheduler."""
    from test_tasks import SMALL, USER_TASK, _write_task
    slurm = ["--executor", "slurm", "--set", "executor.preset=local", "--workers", "2", *SMALL]
    where = _write_task(tmp_path / "mytasks", USER_TASK)
    runs = {tmp_path / "diloco": ["--set", "task=digits", "--algorithm", "diloco", "--rounds", "2", "--inner-steps", "4"],
            tmp_path / "lte": ["--set", "task=digits", "--algorithm", "lte", "--rounds", "2", "--inner-steps", "4",
                               "--set", "lte.rank=4"],
            tmp_path / "own": ["--set", "task=blobs:Blobs", "--set", f"task_path={where}", "--algorithm", "lofi",
                               "--rounds", "1", "--inner-steps", "10"]}
    for run, args in runs.items():
        assert main(["submit", *args, "--run-dir", str(run), *slurm]) == 0
        capsys.readouterr()
        assert main(["status", str(run), "--json"]) == 0
        st = json.loads(capsys.readouterr().out)
        assert st["state"] == "done" and all(r["merged"] == [0, 1] and "accuracy" in r["eval_metrics"] for r in st["rounds"])
        job = Storage(str(run)).read_json("rounds/00000/jobs.json")["workers"]["0"]["job_ids"][0]
        assert len(wait_for_sacct_state(job.split("_")[0], "COMPLETED", array_tasks=range(2))) == 2
    heads = Storage(str(tmp_path / "lte")).read_json("rounds/00001/contrib/worker_000.json")
    assert heads["lte"]["rank"] == 4
