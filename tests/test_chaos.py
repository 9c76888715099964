"""The chaos run, short (bench/chaos.py has the full one; its figures are in docs/reliability.md).

On the local executor (always) and on the real local Slurm: worker jobs cancelled, the merge service
killed and resumed 3 times, a corrupt, a NaN, a wrong-shape contribution, a FIFO and a link planted
in the run, one worker slowed past every deadline. Every fault must pass its own check and the
published weights must equal a clean run's of the same seed, bit for bit. And the comparison must
be able to fail: a well-formed poisoned contribution, which nothing in the service can tell from a
real one, gives replay_identical=false.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from slurm_support import SLURM_OK, requires_slurm

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parent.parent
LAST = re.compile(r"chaos: faults_injected=(\d+) faults_survived=(\d+) rounds=(\d+)/(\d+) accepted=(\d+) rejected=(\d+) "
                  r"replay_identical=(true|false)")


def _chaos(tmp_path, corpus_cache, *args: str) -> tuple[subprocess.CompletedProcess, re.Match | None, dict]:
    out = tmp_path / "chaos.json"
    # the clean run (the oracle) on inline workers: the same bytes as processes (tests/test_inline.py)
    proc = subprocess.run([sys.executable, "-m", "bench.chaos", "--inner-steps", "3", "--slow-s", "3", "--clean-executor", "inline",
                           "--run-dir", str(tmp_path / "runs"), "--cache-dir", corpus_cache, "--json", str(out), *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    last = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    return proc, LAST.fullmatch(last), json.loads(out.read_text()) if out.exists() else {}


def _survives_everything(tmp_path, corpus_cache, executor: str) -> None:
    proc, m, figures = _chaos(tmp_path, corpus_cache, "--executor", executor, "--workers", "3", "--rounds", "5")
    assert proc.returncode == 0 and m, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert m.group(1) == m.group(2) and m.group(3) == m.group(4) == "5" and m.group(7) == "true"
    kinds = [f["kind"] for f in figures["faults"]]
    assert kinds.count("service_killed") == 3 and kinds.count("job_cancelled") >= 1, kinds
    assert {"corrupt", "nan", "shape", "fifo", "symlink", "slow_worker"} <= set(kinds)
    assert figures["invalid_merges"] == [] and int(m.group(6)) >= 5  # the five planted files, at least


@pytest.mark.skipif(SLURM_OK, reason="Slurm is up: the same faults run on the real scheduler (test_short_chaos_run_on_slurm), "
                    "which keeps CI near 20 minutes")
def test_short_chaos_run_on_the_local_executor(tmp_path, corpus_cache):
    _survives_everything(tmp_path, corpus_cache, "local")


@pytest.mark.slurm
@requires_slurm
def test_short_chaos_run_on_slurm(tmp_path, corpus_cache):
    _survives_everything(tmp_path, corpus_cache, "slurm")


def test_a_poisoned_merge_is_caught_by_the_comparison_with_a_clean_run(tmp_path, corpus_cache):
    proc, m, figures = _chaos(tmp_path, corpus_cache, "--executor", "local", "--workers", "2", "--rounds", "1",
                              "--kills", "0", "--cancel-fraction", "0", "--poison")
    assert proc.returncode == 1 and m, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert m.group(7) == "false" and int(m.group(2)) == int(m.group(1)) - 1  # the poison alone not survived
    poison = [f for f in figures["faults"] if f["kind"] == "poison"]
    assert len(poison) == 1 and not poison[0]["survived"] and "merged" in poison[0]["detail"]
    assert any(d.startswith(f"global/round_{poison[0]['round'] + 1:05d}") for d in figures["differences"])
