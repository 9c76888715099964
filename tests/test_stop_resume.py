"""A graceful stop loses nothing: Ctrl-C at the service (SIGINT to its process, as a terminal sends
it; the local workers ignore SIGINT) makes each local worker save where it is before it ends (the
STOP marker: mid-round its in-flight checkpoint, between rounds its state snapshot), and `resume`
ends at the uninterrupted run's final model, digest for digest (round.stream_merge=false: a run
bit-reproducible by itself). Real processes: the service and its workers are the subject.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from core.checkpoint import read_manifest
from core.layout import RunLayout
from core.storage import Storage
from orchestrator.cli import main
from runs import submit_tiny

L = RunLayout()
SHAPE = ["--workers", "2", "--rounds", "3", "--inner-steps", "4", "--set", "round.stream_merge=false"]
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, corpus_cache) -> str:
    run = tmp_path_factory.mktemp("whole") / "run"
    assert main(submit_tiny(run, corpus_cache, *SHAPE, executor="inline")) == 0  # the same bytes as processes
    return read_manifest(Storage(str(run)), L.FINAL)["digest"]


def _interrupt_when(run: Path, args: list[str], ready, slow: str) -> str:
    """The run started as a process with ISLANDS_SLOWPOINT `slow`, SIGINT once `ready(storage)`;
    its output (it ends 130, having stopped its workers)."""
    env = {**os.environ, "ISLANDS_SLOWPOINT": slow}
    # as a terminal's foreground job: its own process group, SIGINT at its default (a suite run in
    # the background of a shell has it ignored, and a child keeps that)
    proc = subprocess.Popen([sys.executable, "-m", "orchestrator.cli", *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    s, deadline = Storage(str(run)), time.time() + 180
    while not (s.exists(L.CONFIG) and ready(s)):
        assert proc.poll() is None and time.time() < deadline, proc.stdout.read()[-3000:]
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGINT)  # the whole group, as a terminal's Ctrl-C (the workers ignore it)
    out, _ = proc.communicate(timeout=180)
    assert proc.returncode == 130, out[-3000:]
    return out


def _progress(s: Storage, worker: int) -> dict:
    try:
        return json.loads(s.read_bytes(L.worker_progress(worker)))
    except (FileNotFoundError, ValueError):
        return {}


def test_ctrl_c_mid_round_then_resume_ends_at_the_same_model(tmp_path, corpus_cache, uninterrupted, capsys):
    run = tmp_path / "run"
    out = _interrupt_when(run, submit_tiny(run, corpus_cache, *SHAPE),
                          lambda s: _progress(s, 0).get("round") == 1 and _progress(s, 0).get("step", 0) >= 1,
                          slow="worker_000.step=1")  # the first step's heartbeat: 3 steps of 1 s to go
    assert "the local workers are saving their state" in out
    s = Storage(str(run))
    saved = read_manifest(s, L.worker_inflight(0, 1))
    assert saved is not None and 1 <= saved["steps_done"] < 4, saved  # worker 0 stopped mid-round 1
    # resumed, the jobs the Ctrl-C stopped are resubmitted as expected business, said in the run's
    # log, never as warnings about lost work
    resumed = subprocess.run([sys.executable, "-m", "orchestrator.cli", "resume", str(run)], cwd=ROOT,
                             capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0 and "done in" in resumed.stdout, resumed.stdout + resumed.stderr
    assert "WARNING" not in resumed.stderr and "CANCELLED" not in resumed.stdout + resumed.stderr, resumed.stderr
    log = (run / "orchestrator.log").read_text()
    assert "(islands cancelled them: Ctrl-C or `orchestrate cancel`); resubmitting" in log, log[-3000:]
    assert re.search(r"INFO orchestrator.submission: round 1: worker 0 job \d+ ended \(\w+\)", log), log[-3000:]
    got = read_manifest(s, L.contribution(1, 0))
    assert got["resumed_at_step"] == saved["steps_done"]  # went on from where it stopped
    assert read_manifest(s, L.FINAL)["digest"] == uninterrupted
    assert not s.exists(L.STOP)


def test_ctrl_c_between_rounds_then_resume_ends_at_the_same_model(tmp_path, corpus_cache, uninterrupted):
    """Worker 1 has published round 1 and waits for round 2; worker 0 has trained round 1 and is slow
    to publish it: both end with their state written (a snapshot of round 1 each), and round 2 starts
    from those."""
    run = tmp_path / "run"

    def ready(s: Storage) -> bool:  # worker 0's heartbeat after its last step, before it publishes
        p = _progress(s, 0)
        return (p.get("round"), p.get("step")) == (1, 4) and read_manifest(s, L.contribution(1, 1)) is not None
    _interrupt_when(run, submit_tiny(run, corpus_cache, *SHAPE), ready, slow="worker_000.publish=3")
    s = Storage(str(run))
    assert not s.exists(L.round_record(1))  # interrupted before round 1 was merged
    assert [read_manifest(s, L.worker_state(w, 1)) is not None for w in (0, 1)] == [True, True]
    assert main(["resume", str(run)]) == 0
    assert [read_manifest(s, L.contribution(2, w)).get("state_from_round") for w in (0, 1)] == [1, 1]
    assert read_manifest(s, L.FINAL)["digest"] == uninterrupted
