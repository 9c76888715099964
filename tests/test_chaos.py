"""The chaos run, short: 3 workers x 4 rounds on the real local Slurm (bench/chaos.py has the full
one and its figures are in docs/reliability.md). Worker jobs scancelled, the merge service SIGKILLed
and resumed 3 times, a corrupt, a NaN and a wrong-shape contribution written into the run, one
worker slowed past every deadline: all rounds must finish, nothing invalid merged, and an offline
replay of the recorded merges must give the same weights bit for bit.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from slurm_support import slurm_test

pytestmark = [*slurm_test, pytest.mark.slow]
ROOT = Path(__file__).resolve().parent.parent


def test_short_chaos_run_survives_every_fault(tmp_path, corpus_cache):
    out = tmp_path / "chaos.json"
    proc = subprocess.run([sys.executable, "-m", "bench.chaos", "--workers", "3", "--rounds", "4", "--inner-steps", "3",
                           "--deadline-s", "10", "--slow-s", "14", "--run-dir", str(tmp_path / "runs"),
                           "--cache-dir", corpus_cache, "--json", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=400)
    last = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    m = re.fullmatch(r"chaos: faults_injected=(\d+) faults_survived=(\d+) rounds=4/4 accepted=(\d+) rejected=(\d+) "
                     r"replay_identical=true", last)
    assert m and m.group(1) == m.group(2), last
    figures = json.loads(out.read_text())
    kinds = [f["kind"] for f in figures["faults"]]
    assert kinds.count("service_killed") == 3 and kinds.count("job_cancelled") >= 1
    assert {"corrupt", "nan", "shape", "slow_worker"} <= set(kinds)
    assert figures["invalid_merges"] == [] and int(m.group(4)) >= 3  # the three bad files, at least
