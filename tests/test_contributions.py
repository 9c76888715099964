"""Contributions the merge service must not take at face value: a duplicate from a requeued job,
one from the wrong round or the wrong base (stale). Each is merged once or rejected with the reason
recorded, and the round goes on. (Corrupt, NaN/Inf, missing/extra tensor, wrong shape or dtype and
missing manifest are rejected by the merge engine: tests/test_merge.py; a killed writer:
tests/test_faults.py.) Hand-made tensors, outer SGD at lr 1: the new global is the mean of the inputs.
"""
from __future__ import annotations

import time

import pytest
import torch

from core.checkpoint import load_checkpoint, read_manifest
from core.layout import RunLayout
from core.storage import Storage
from orchestrator.jobstatus import JobStatus
from service_support import G0, Scripted, ThreadExecutor, publish, scripted_run

L = RunLayout()
pytestmark = pytest.mark.slow


def _run(tmp_path, ex: ThreadExecutor, rounds: int = 1, policy: str = "continue") -> Storage:
    return scripted_run(tmp_path, ex, [
        "round.min_workers=1", "round.worker_mode=per_round", "round.poll_s=0.05", "round.max_retries=0",
        f"round.late_policy={policy}", "outer.optimizer=sgd", "outer.lr=1.0", "outer.weighting=uniform"], rounds=rounds)


def test_duplicate_from_a_requeued_job_is_merged_once(tmp_path):
    def twice(s, t):  # a requeued job publishes the same (round, worker) again
        publish(s, t.round, t.worker, t.base_key, -0.25)
        publish(s, t.round, t.worker, t.base_key, -0.25, attempt=1)
    s = _run(tmp_path, Scripted({0: twice}))
    rec = s.read_json(L.round_record(0))
    assert rec["merged"] == [0, 1] and rec["weights"] == {"0": 1.0, "1": 1.0}
    # once: (-0.25 - 0.5) / 2 = -0.375; twice would be (2 * -0.25 - 0.5) / 3
    assert torch.equal(load_checkpoint(s, L.global_weights(1))[0]["w"], G0["w"] - 0.375)
    assert [n for n in s.list(L.contributions_dir(0)) if n.startswith("worker_000")] == ["worker_000.json", "worker_000.safetensors"]


def test_jobs_islands_stopped_itself_spend_no_retry(tmp_path):
    """Ctrl-C or `orchestrate cancel`, then `resume`, as often as a user likes: a job islands stopped
    itself is resubmitted without counting against round.max_retries (0 here); a job that ends
    without a contribution on its own still counts (the tests of max_retries=0 here)."""
    class StoppedThrice(Scripted):
        def _work(self, job_id, t):
            if t.worker == 1 and sum(w == 1 for _, w, _ in self.submitted) <= 3:
                self.cancelled.add(job_id)  # as islands' own stop leaves a job: marked, no contribution
                return
            super()._work(job_id, t)
    s = _run(tmp_path, StoppedThrice({}))
    rec = s.read_json(L.round_record(0))
    assert rec["merged"] == [0, 1] and rec["jobs"]["1"]["attempts"] == 4, rec


def test_duplicate_published_after_the_merge_is_not_merged_again(tmp_path):
    def again_later(s, t):
        publish(s, t.round, t.worker, t.base_key, -0.25)
        if t.round == 0:  # the requeued copy lands while round 1 runs: merged already, never folded
            while not s.exists(L.round_record(0)):
                time.sleep(0.05)
            publish(s, 0, t.worker, L.global_weights(0), -0.25, attempt=1)
    ex = Scripted({0: again_later})
    s = _run(tmp_path, ex, rounds=2, policy="fold")
    rec1 = s.read_json(L.round_record(1))
    assert rec1["merged"] == [0, 1] and rec1["folded"] == [] and rec1["fold_rejected"] == []
    assert torch.equal(load_checkpoint(s, L.global_weights(2))[0]["w"], G0["w"] - 0.75)


@pytest.mark.parametrize("wrong, why", [
    ({"round": 7}, "manifest says round 7 worker 1"),
    ({"worker": 0}, "manifest says round 0 worker 0"),
    ({"base_digest": "f" * 64}, "base ffffffffffff, expected round 0 worker 1 base"),
])
def test_stale_contribution_is_rejected_with_the_reason_recorded(tmp_path, wrong, why):
    s = _run(tmp_path, Scripted({1: lambda s, t: publish(s, t.round, t.worker, t.base_key, -0.5, **wrong)}))
    rec = s.read_json(L.round_record(0))
    assert rec["merged"] == [0] and rec["rejected"] == [1]
    assert rec["rejected_reasons"]["1"].startswith("stale contribution") and why in rec["rejected_reasons"]["1"]
    assert torch.equal(load_checkpoint(s, L.global_weights(1))[0]["w"], G0["w"] - 0.5)  # worker 0 alone


class FinishesWhileAsked(Scripted):
    """Worker 1's job publishes and ends exactly while the service asks the scheduler about it:
    after the service listed the round's contributions, before the scheduler answers."""

    def __init__(self) -> None:
        super().__init__({1: lambda s, t: None})  # worker 1's job thread itself does nothing
        self.tasks = {}

    def submit(self, tasks) -> list[str]:
        ids = super().submit(tasks)
        self.tasks.update(zip(ids, tasks))
        return ids

    def status(self, ids):
        for j in ids:
            t = self.tasks[j]
            if t.worker == 1 and not read_manifest(Storage(t.run_url), L.contribution(t.round, 1)):
                self.jobs[j].join()
                publish(Storage(t.run_url), t.round, 1, t.base_key, -0.5)
        return {j: JobStatus(j, "RUNNING" if self.jobs[j].is_alive() else "COMPLETED") for j in ids}


def test_a_job_that_publishes_and_ends_while_the_scheduler_is_asked_is_merged(tmp_path):
    s = _run(tmp_path, FinishesWhileAsked())
    rec = s.read_json(L.round_record(0))
    assert rec["merged"] == [0, 1] and rec["dropped"] == []
