"""`executor.kind: inline` (orchestrator/inline.py): worker jobs as threads of the orchestrating
process. What the tests that use it rely on: an inline run publishes the same bytes as one whose
workers are processes; a job's state, failure and cancel are what a process's would be; its job id
reaches its manifest; what a thread cannot be (several ranks, its own GPUs, its own I/O counters)
is refused or left unsaid."""
from __future__ import annotations

import os
import threading
import time

import pytest

from core import iostat
from core.assignment import INLINE_JOB_ID, current_job_id
from core.config import config_from_dict
from core.storage import Storage
from orchestrator import inline
from orchestrator.cli import main
from orchestrator.executor import Executor
from orchestrator.slurm import rank_problems
from runs import DENSE, submit_tiny


def _digests(run) -> list[str]:
    s = Storage(str(run))
    return [s.read_json(f"rounds/{r:05d}/record.json")["global_digest"] for r in range(2)] + \
        [s.read_json(f"outer/state_{r:05d}.json")["digest"] for r in (1, 2)]


@pytest.mark.slow
def test_an_inline_run_publishes_what_a_run_of_processes_does(tmp_path, corpus_cache, capsys, dense_run):
    """Every global and outer state of the session's dense run (inline) and of the same run with its
    workers local processes; the inline jobs' ids are in the manifests and `status` shows them
    COMPLETED (it names no other state)."""
    local = tmp_path / "local"
    assert main(submit_tiny(local, corpus_cache, *DENSE)) == 0
    assert _digests(dense_run) == _digests(local)
    s = Storage(str(dense_run))
    ids = s.read_json("rounds/00000/jobs.json")["workers"]
    manifest = s.read_json("rounds/00001/contrib/worker_001.json")
    assert manifest["job_id"] == ids["1"]["job_ids"][-1] and manifest["job_id"].startswith(f"{os.getpid()}_")
    assert manifest["threads"] == 1 and "io_read" not in manifest  # its process's counters are not its own
    capsys.readouterr()
    assert main(["status", str(dense_run)]) == 0
    out = capsys.readouterr().out
    assert "worker I/O" not in out and "FAILED" not in out and "ENDED" not in out, out


def _wait(job_id: str, deadline_s: float = 30) -> str:
    """The job's state once its thread has ended."""
    deadline = time.monotonic() + deadline_s
    while job_id in inline.running():
        assert time.monotonic() < deadline, f"inline job {job_id} still runs"
        time.sleep(0.01)
    return inline.status(job_id).state


def test_a_job_s_state_failure_and_cancel_are_a_process_s():
    started, seen = threading.Event(), []

    def spin(arg):
        seen.append(current_job_id())
        started.set()
        while True:
            time.sleep(0.01)

    def fail(arg):
        raise ValueError(f"bad input {arg}")

    done = inline.submit(lambda arg: seen.append(arg), "x")
    assert _wait(done) == "COMPLETED" and "x" in seen
    st = inline.status(done)
    assert st.job_id == done and st.start and st.end and st.timing()["run_s"] is not None
    failed = inline.submit(fail, 7)
    assert _wait(failed) == "FAILED"
    assert inline.error_tail(failed, 3).splitlines()[-1] == "ValueError: bad input 7"
    running = inline.submit(spin, None)
    assert started.wait(10) and seen[-1] == running and inline.status(running).state == "RUNNING"
    assert running in inline.running()
    inline.cancel(running)
    assert inline.status(running).state == "CANCELLED"  # at once, as scancel's job
    assert _wait(running) == "CANCELLED"  # and its thread ended
    # a job of another process (an earlier orchestrator's): out of sight, not alive, so resubmitted
    assert inline.status("1_0").state == "ENDED" and not inline.status("1_0").alive
    assert INLINE_JOB_ID.get() is None and current_job_id() is None  # outside a job: no id
    assert inline.error_tail("1_0", 3) == ""


def test_the_executor_reports_cancels_and_tails_inline_jobs(tmp_path):
    ex = Executor(config_from_dict({"executor": {"kind": "inline"}}), tmp_path / "jobs")
    assert ex.kind == "inline" and ex.here
    job = inline.submit(lambda arg: time.sleep(30), None)
    ex._jobs[job] = None  # as submit() keeps it
    assert ex.own_jobs() == [job] and ex.status([job])[job].state == "RUNNING"
    ex.cancel([job])
    assert ex.cancelled_here(job) and ex.status([job])[job].state == "CANCELLED"
    assert not (tmp_path / "jobs").exists()  # no submitit folder, no files


def test_what_a_thread_cannot_be_is_refused():
    problems = rank_problems(config_from_dict({"executor": {"kind": "inline", "tasks_per_node": 2, "cpus_per_task": 2}}))
    assert any("executor.kind=inline runs each worker as one thread" in p for p in problems), problems
    assert rank_problems(config_from_dict({"executor": {"kind": "inline"}})) == []
    seen = {}
    job = inline.submit(lambda arg: seen.update(io=iostat.counters()), None)
    _wait(job)
    assert seen["io"] == {}  # the process's counters would count the service and every other worker


@pytest.mark.slow
def test_a_cancelled_inline_run_stops_its_threads(tmp_path, corpus_cache):
    """`orchestrate cancel` of an inline run: the service (here on a thread of this process) stops
    with the cancel's exit code, and its worker threads, which nothing outside the process can
    reach, stop on the run's CANCEL mark as a persistent worker does."""
    run, done = tmp_path / "run", {}
    before = set(inline.running())
    service = threading.Thread(target=lambda: done.update(rc=main(submit_tiny(
        run, corpus_cache, "--workers", "2", "--rounds", "50", "--inner-steps", "300", executor="inline"))))
    service.start()
    s, deadline = Storage(str(run)), time.monotonic() + 60
    while not s.exists("rounds/00000/jobs.json"):
        assert time.monotonic() < deadline and service.is_alive(), done
        time.sleep(0.1)
    assert set(inline.running()) - before  # its workers train
    assert main(["cancel", str(run)]) == 0
    service.join(60)
    assert done == {"rc": 3}
    deadline = time.monotonic() + 30
    while set(inline.running()) - before:
        assert time.monotonic() < deadline, "the run's worker threads outlived its cancel"
        time.sleep(0.05)


def test_a_job_id_is_the_scheduler_s_name_for_it(monkeypatch):
    """One reader of a job's id for the worker (its manifest, its persistent wait, its errors): an
    array task is `JOB_TASK`, as jobs.json names it; an inline job's id comes from its thread."""
    for key in ("SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID", "SLURM_JOB_ID", "SUBMITIT_LOCAL_JOB_ID"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("SLURM_JOB_ID", "15")
    assert current_job_id() == "15"
    monkeypatch.setenv("SLURM_ARRAY_JOB_ID", "12")
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "3")
    assert current_job_id() == "12_3"
    seen = {}
    _wait(inline.submit(lambda arg: seen.update(id=current_job_id()), None))
    assert seen["id"].startswith(f"{os.getpid()}_")


@pytest.mark.slow
def test_a_detached_inline_service_runs_its_workers_as_its_threads(tmp_path, corpus_cache, capsys):
    """`--detach`: the service is a background process (as for local jobs), whose workers are its
    threads; one worker takes one intra-op thread, where a local one would take the machine's cores."""
    from orchestrator.runstate import run_status
    run = tmp_path / "run"
    assert main(submit_tiny(run, corpus_cache, "--workers", "1", "--rounds", "1", "--inner-steps", "1", "--detach",
                            executor="inline")) == 0
    assert "merge service started as process" in capsys.readouterr().out
    s, deadline = Storage(str(run)), time.monotonic() + 120
    while run_status(s)["state"] != "done":
        assert time.monotonic() < deadline, (run / "jobs" / "service.log").read_text()[-2000:]
        time.sleep(0.2)
    manifest = s.read_json("rounds/00000/contrib/worker_000.json")
    assert manifest["threads"] == 1 and not manifest["job_id"].startswith(f"{os.getpid()}_")  # the service's threads
    assert not list((run / "jobs").glob("*/*_submitted.pkl"))  # no submitit job was made
