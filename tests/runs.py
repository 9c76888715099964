"""The suite's standard tiny run: its flags (TINY), and `submit_tiny`, the `orchestrate submit` of
one. tests/conftest.py makes `dense_run` of it once per session (pytest-xdist: once per worker)
for the tests that only read a run; a test that changes a run copies it first."""
from __future__ import annotations

from pathlib import Path

TINY = ["--set", "model.n_layer=1", "--set", "model.n_embd=32", "--set", "model.n_head=2",
        "--set", "model.block_size=32", "--set", "inner.batch_size=4", "--set", "inner.warmup_steps=2",
        "--set", "data.eval_batches=2", "--set", "round.poll_s=0.2"]
DENSE = ["--workers", "2", "--rounds", "2", "--inner-steps", "3", "--set", "round.keep_last=0"]
"""dense_run's shape: DiLoCo, dense contributions, every round's tensors kept."""


def submit_tiny(run_dir: Path, cache: str, *extra: str, executor: str = "local") -> list[str]:
    """`orchestrate submit` of a tiny run; `executor` inline where the worker processes are not the
    subject (orchestrator/inline.py)."""
    return ["submit", "--executor", executor, "--run-dir", str(run_dir), "--set", f"data.cache_dir={cache}", *TINY, *extra]
