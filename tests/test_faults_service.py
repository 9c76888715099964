"""The merge service killed at each step of a merge: `resume` finishes the round exactly once.

The service is stopped by a failpoint (core/failpoints.py: os._exit, as a kill -9 would) between
two writes no signal could be timed to hit. Training is deterministic, so "exactly once" is
checked by comparing every global checkpoint with a run that was never interrupted: an outer step
applied twice (or not at all) would change the bytes.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from core.storage import Storage
from orchestrator.cli import main

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parent.parent
TINY = ["--executor", "local", "--workers", "2", "--rounds", "3", "--inner-steps", "2",
        "--set", "model.n_layer=1", "--set", "model.n_embd=32", "--set", "model.n_head=2", "--set", "model.block_size=32",
        "--set", "inner.batch_size=4", "--set", "data.eval_batches=1", "--set", "round.poll_s=0.1"]
POINTS = ["merge.while_reading", "merge.after_global", "service.before_record", "service.after_record"]


def _shas(run: Path) -> list[str]:
    s = Storage(str(run))
    out = [s.read_json(f"rounds/{r:05d}/record.json")["global_digest"] for r in range(3)]
    out += [s.read_json(f"outer/state_{r:05d}.json")["digest"] for r in range(1, 4)]
    return out


@pytest.fixture(scope="module")
def clean_run(tmp_path_factory, corpus_cache) -> list[str]:
    """The oracle: the same run never interrupted, its workers threads of this process (the same
    bytes as processes: tests/test_inline.py)."""
    run = tmp_path_factory.mktemp("clean") / "run"
    assert main(["submit", "--run-dir", str(run), "--set", f"data.cache_dir={corpus_cache}", *TINY,
                 "--executor", "inline"]) == 0
    return _shas(run)


@pytest.mark.parametrize("point", POINTS)
def test_killed_service_resumes_round_exactly_once(point, tmp_path, corpus_cache, clean_run):
    run = tmp_path / "run"
    env = {**os.environ, "ISLANDS_FAILPOINT": point}
    out = tmp_path / "out.txt"  # a file, not a pipe: the persistent workers live on and hold what they inherit
    with open(out, "wb") as f:
        proc = subprocess.run([sys.executable, "-m", "orchestrator.cli", "submit", "--run-dir", str(run),
                               "--set", f"data.cache_dir={corpus_cache}", *TINY], cwd=ROOT, env=env,
                              stdout=f, stderr=subprocess.STDOUT, timeout=240)
    assert proc.returncode == 137, out.read_text()[-3000:]  # died at the failpoint
    s = Storage(str(run))
    assert not s.exists("rounds/00002/record.json")
    assert main(["resume", str(run)]) == 0
    assert _shas(run) == clean_run
