"""The round loop's decisions, from plain values (no storage, no scheduler)."""
from __future__ import annotations

from orchestrator.plan import JobView, WorkerView, decide, dropped_workers, next_bases


def V(w, arrived=False, alive=False, attempts=1):
    return WorkerView(w, arrived, alive, attempts)


def D(views, quorum=3, elapsed=0.0, deadline=0.0, retries=2):
    return decide(views, quorum=quorum, elapsed_s=elapsed, deadline_s=deadline, max_retries=retries)


def test_all_in_merges():
    d = D([V(0, True), V(1, True), V(2, True)])
    assert (d.action, d.workers) == ("merge", (0, 1, 2))


def test_waits_for_running_workers_without_deadline():
    assert D([V(0, True), V(1, True), V(2, alive=True)], quorum=2).action == "wait"


def test_deadline_closes_the_round_once_the_quorum_is_in():
    d = D([V(0, True), V(1, True), V(2, alive=True)], quorum=2, elapsed=61, deadline=60)
    assert (d.action, d.workers) == ("merge", (0, 1)) and "deadline" in d.reason


def test_deadline_never_merges_below_quorum():
    assert D([V(0, True), V(1, alive=True), V(2, alive=True)], quorum=2, elapsed=999, deadline=60).action == "wait"


def test_lost_worker_is_resubmitted_while_retries_remain():
    d = D([V(0, True), V(1, True), V(2, attempts=1)])
    assert (d.action, d.workers) == ("resubmit", (2,))


def test_quorum_in_and_the_rest_dead_for_good_merges():
    d = D([V(0, True), V(1, True), V(2, attempts=3)], quorum=2)
    assert (d.action, d.workers) == ("merge", (0, 1))


def test_below_quorum_with_no_retries_left_fails():
    d = D([V(0, True), V(1, attempts=3), V(2, attempts=3)], quorum=2)
    assert d.action == "fail" and "only 1 of the quorum of 2" in d.reason


def test_below_quorum_waits_for_the_living():
    assert D([V(0, True), V(1, attempts=3), V(2, alive=True)], quorum=2).action == "wait"


def test_next_bases_continue_and_restart():
    late = {2: "rounds/00003/contrib/worker_002.safetensors"}
    assert next_bases(3, [0, 1], late, "continue", "G") == {0: "G", 1: "G", 2: late[2]}
    assert next_bases(3, [0, 1], late, "restart", "G") == {0: "G", 1: "G", 2: "G"}
    assert next_bases(3, [0, 1], {}, "continue", "G") == {0: "G", 1: "G", 2: "G"}  # nothing of its own to continue from


def test_a_contribution_weight_is_derived_from_the_config_not_taken_from_the_manifest():
    from core.config import load_config
    from orchestrator.plan import contribution_weight
    cfg = load_config(None, {"workers": 2}, [])  # inner.steps 25, batch 16, block 128
    assert contribution_weight({"steps": 25, "tokens": 25 * 16 * 128}, cfg) == 51200.0
    assert contribution_weight({"steps": 10}, cfg) == 10 * 16 * 128  # a manifest without tokens: still derived
    lofi = load_config(None, {"workers": 4, "algorithm": "lofi"}, [])  # batch 16 / 4 workers
    assert contribution_weight({"steps": 25, "tokens": 25 * 4 * 128}, lofi) == 12800.0
    for steps in (0, 26, -1, True, "25", 2.5, None):
        assert "not a whole number in [1, inner.steps = 25]" in contribution_weight({"steps": steps}, cfg)
    for tokens in (0, 1e30, -51200, float("nan"), "51200", 51201):
        assert "claims" in contribution_weight({"steps": 25, "tokens": tokens}, cfg)
    uniform = load_config(None, {"workers": 2}, ["outer.weighting=uniform"])
    assert contribution_weight({"steps": 0, "tokens": 1e30}, uniform) == 1.0


def test_dropped_workers_are_named_with_their_job_and_stragglers_cancelled():
    jobs = {0: JobView("11", "COMPLETED", False), 1: JobView("12", "RUNNING", True),
            2: JobView("13", "FAILED", False), 3: JobView("14", "PENDING", True)}
    out = dropped_workers(4, merged=[0], rejected=[], jobs=jobs, runs_on=False)
    assert out.workers == (1, 2, 3)
    assert out.reasons == {"1": "still RUNNING at the merge (straggler): job 12 cancelled",
                           "2": "job 13 ended FAILED without a contribution",
                           "3": "still PENDING at the merge (straggler): job 14 cancelled"}
    assert out.ended == (2,) and out.cancel == ("12", "14")


def test_a_rejected_worker_is_not_dropped_and_stragglers_run_on_under_fold():
    jobs = {0: JobView("11", "COMPLETED", False), 1: JobView("12", "COMPLETED", False), 2: JobView("13", "RUNNING", True)}
    out = dropped_workers(3, merged=[0], rejected=[1], jobs=jobs, runs_on=True)
    assert out.workers == (2,) and out.cancel == () and out.ended == ()
    assert out.reasons == {"2": "still RUNNING at the merge (straggler): job 13 runs on, to be folded in later"}
    everyone = dropped_workers(3, merged=[0, 1, 2], rejected=[], jobs=jobs, runs_on=False)
    assert (everyone.workers, everyone.reasons, everyone.ended, everyone.cancel) == ((), {}, (), ())
