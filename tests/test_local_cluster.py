"""Smoke test of the Slurm cluster itself (slurm_templates/local-cluster.sh), with plain sbatch."""

from __future__ import annotations

import subprocess

try:
    from slurm_support import slurm_test, wait_for_sacct_state
except ImportError:  # tests/ collected as a package
    from tests.slurm_support import slurm_test, wait_for_sacct_state

pytestmark = slurm_test


def test_job_array_completes_and_is_accounted(tmp_path):
    # -N 1: without it a multi-CPU "single-node" job may be spread over several emulated nodes.
    # -t 1: a time limit lets backfill start it next to longer jobs that are already queued.
    submitted = subprocess.run(
        [
            "sbatch", "--parsable", "-N", "1", "-t", "1", "--array=0-1", "--job-name=islands-smoke",
            f"--chdir={tmp_path}", f"--output={tmp_path}/%A_%a.out",
            "--wrap", "echo task=$SLURM_ARRAY_TASK_ID",
        ],
        capture_output=True, text=True, timeout=30, check=True,
    )
    job_id = submitted.stdout.strip().split(";")[0]

    states = wait_for_sacct_state(job_id, "COMPLETED", timeout_s=25, array_tasks=range(2))

    assert states == {f"{job_id}_0": "COMPLETED", f"{job_id}_1": "COMPLETED"}
    for task in (0, 1):
        assert (tmp_path / f"{job_id}_{task}.out").read_text().strip() == f"task={task}"


def test_auto_sizes_the_default_request_to_the_local_clusters_nodes(capsys):
    """The README's command on this cluster: its nodes claim 4000 MB, the default request asks for
    4096 MB and Slurm refuses it; `auto` asks for what the default partition's largest node has and
    the workers go to Slurm (before, they ran on this machine). A request the user wrote stays:
    refused, one error."""
    import pytest

    from core.config import config_from_dict
    from core.errors import IslandsError
    from orchestrator.cli import _with_executor

    cfg = _with_executor(config_from_dict({}))
    assert cfg.executor.kind == "slurm" and round(cfg.executor.mem_gb * 1024) <= 4000
    assert "instead, what partition debug's largest node" in " ".join(capsys.readouterr().out.split())
    with pytest.raises(IslandsError, match="workers never run on this machine"):
        _with_executor(config_from_dict({"executor": {"mem_gb": 64}}))
