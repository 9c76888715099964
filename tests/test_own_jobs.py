"""`cancel` and `resume` act only on processes proven to be this run's local jobs (orchestrator/executor.py).

A local job id is a pid read from the run directory (rounds/R/jobs.json), which a co-tenant, a buggy
script or a reused pid can make name any process. Real processes here: decoys whose command lines
name submitit, or another run's job folder; the real jobs' cancellation is tested end to end in
test_e2e_local.py and test_cli.py.
"""
from __future__ import annotations

import subprocess
import sys
import time

import pytest

from core.config import config_from_dict
from orchestrator.executor import Executor, _controller_folder

LOCAL = config_from_dict({"executor": {"kind": "local"}})  # local jobs are pids (on Slurm, cancel is scancel)


@pytest.fixture
def spawn():
    procs: list[subprocess.Popen] = []

    def start(argv: list[str]) -> subprocess.Popen:
        proc = subprocess.Popen(argv)
        procs.append(proc)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # until its command line is the one given (after exec)
            if open(f"/proc/{proc.pid}/cmdline", "rb").read().split(b"\0")[0] == argv[0].encode():
                break
            time.sleep(0.01)
        return proc

    yield start
    for proc in procs:
        proc.kill()
        proc.wait()


def test_a_process_that_only_mentions_submitit_or_another_runs_folder_is_left_alone(tmp_path, spawn):
    ours = Executor(LOCAL, tmp_path / "run" / "jobs")
    decoys = [
        spawn([sys.executable, "-c", "import time; time.sleep(60)", "submitit"]),  # what was enough before
        spawn([sys.executable, "-c", "import time; time.sleep(60)", "-m", "submitit.local._local",
               str(tmp_path / "other-run" / "jobs" / "%j")]),  # another run's job folder
    ]
    ids = [str(p.pid) for p in decoys]
    ours.cancel(ids)
    time.sleep(0.3)
    assert all(p.poll() is None for p in decoys)  # still running
    assert all(ours.status([i])[i].state != "RUNNING" for i in ids)  # and never adopted as a running job
    assert not any((tmp_path / "run" / "jobs" / i).exists() for i in ids)  # no cancel mark written for them


def test_a_controller_of_this_runs_folder_is_recognised_also_behind_a_setup_shell(tmp_path, spawn):
    folder = str(tmp_path / "run" / "jobs" / "%j")
    shell = spawn(["/bin/sh", "-c", f"sleep 60 && {sys.executable} -m submitit.local._local '{folder}'"])
    assert _controller_folder(str(shell.pid)) == folder
    assert _controller_folder("not-a-pid") is None and _controller_folder("999999999") is None
    Executor(LOCAL, tmp_path / "run" / "jobs").cancel([str(shell.pid)])
    assert shell.wait(timeout=10) in (-9, 137)  # this run's: killed (or ended as its killed child did)


def test_a_remote_runs_job_folder_is_private_and_its_own(tmp_path, monkeypatch):
    import os
    import stat

    from core.errors import RunError
    from core.storage import Storage
    from orchestrator.run_service import jobs_folder as _jobs_folder
    from orchestrator.run_service import run_storage as _storage
    monkeypatch.setenv("ISLANDS_CACHE", str(tmp_path / "cache"))
    a = _jobs_folder(Storage("memory://bucket/team/run1"))
    b = _jobs_folder(Storage("memory://bucket/other/run1"))
    assert a != b and os.path.basename(a).startswith("run1-") and stat.S_IMODE(os.stat(a).st_mode) == 0o700
    os.chmod(b, 0o777)
    with pytest.raises(RunError, match="not a private folder of yours"):
        _jobs_folder(Storage("memory://bucket/other/run1"))
    with pytest.raises(RunError, match="'..' component"):
        _storage("s3://bucket/..")
