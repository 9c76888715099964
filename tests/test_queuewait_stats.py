"""Queue-wait science (#29): censored waits and Kaplan-Meier, filters, day-bootstrap intervals, user
counts, an unambiguous cores-per-node, sacct from Eligible, and a projection from matched jobs.

Kaplan-Meier values are worked by hand here; scipy computes them in the code (stats.py).
"""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator.cli import main
from orchestrator.queuewait import projection as qp
from orchestrator.queuewait import stats as qs
from orchestrator.queuewait import waits as qw

DAY = 86400


def _job(wait, nodes=1, censored=False, day=0, **kw):
    return qw.JobWait(day * DAY + 1.0, float(wait), nodes, censored=censored, **kw)


def _data(jobs, cpn=None):
    return qw.WaitData("test", tuple(jobs), cores_per_node=cpn)


# ---------------------------------------------------------------- Kaplan-Meier by hand


def test_km_by_hand():
    """Events 10 20 30 40, one job censored at 25 (5 at risk): S(10) = 4/5, S(20) = 4/5 * 3/4 = 0.6,
    the censored job leaves 2 at risk, S(30) = 0.6 * 1/2 = 0.3, S(40) = 0. Median: the first wait
    with S <= 0.5 is 30 (the naive median of the five recorded waits is 25); p90: 40."""
    waits = np.array([10.0, 20, 25, 30, 40])
    assert qs.km_quantiles(waits, np.array([False, False, True, False, False])) == [30.0, 40.0]
    assert qs.km_quantiles(waits, np.zeros(5, bool)) == [25.0, 40.0]  # no censoring: the ECDF's own quantiles


def test_km_not_reached_when_the_tail_is_censored():
    """Events 1 2 3 5, censored 4 6: S = 5/6, 4/6, 3/6, (4: 3/6), 5: 3/6 * 1/2 = 1/4; never <= 0.1."""
    waits = np.array([1.0, 2, 3, 4, 5, 6])
    cens = np.array([False, False, False, True, False, True])
    assert qs.km_quantiles(waits, cens) == [3.0, None]
    assert qs.km_quantiles(waits, np.ones(6, bool)) == [None, None]


def test_censoring_moves_the_median_up_where_the_naive_one_does_not():
    """Half the jobs cancelled at 100 s while still queued, the others start at 10 s or 1000 s."""
    jobs = [_job(10)] * 4 + [_job(1000)] * 4 + [_job(100, censored=True)] * 8
    stats = qs.bucket_stats(_data(jobs), qs.parse_buckets("1"), n_boot=0)[0]
    assert stats["median_wait_s"] == 100 and stats["censored"] == 8  # naive: the cancellations count as waits
    assert stats["km_median_wait_s"] == 1000  # S(10) = 12/16 = 0.75, then 4 at risk after 100: S(1000) = 0


def test_km_draws_follow_the_estimate():
    rng = np.random.default_rng(0)
    waits, cens = np.array([10.0, 20, 25, 30, 40]), np.array([False, False, True, False, False])
    draws = qs.km_draws(waits, cens, (20000,), rng)
    assert set(np.unique(draws)) == {10.0, 20.0, 30.0, 40.0}  # never the censored 25
    freq = {v: float(np.mean(draws == v)) for v in (10, 20, 30, 40)}  # jumps: 0.2 0.2 0.3 0.3
    assert freq == pytest.approx({10: 0.2, 20: 0.2, 30: 0.3, 40: 0.3}, abs=0.015)
    tail = qs.km_draws(np.array([1.0, 2, 3, 4, 5, 6]), np.array([False, False, False, True, False, True]), (20000,), rng)
    assert np.mean(tail == 6) == pytest.approx(0.25, abs=0.015)  # S never reaches 0: the rest at the longest wait


# ---------------------------------------------------------------- day bootstrap, users, warnings


def test_median_ci_by_whole_days():
    same = [_job(60, day=d) for d in range(5) for _ in range(3)]
    assert qs.median_ci(same, np.random.default_rng(0), 200) == [60.0, 60.0]
    # day 0: all jobs wait 10 s, day 1: all wait 1000 s: resampling days gives medians of 10 or 1000 only
    split = [_job(10, day=0)] * 50 + [_job(1000, day=1)] * 50
    lo, hi = qs.median_ci(split, np.random.default_rng(0), 400)
    assert (lo, hi) == (10.0, 1000.0)
    assert qs.median_ci(split, np.random.default_rng(0), 400) == qs.median_ci(split, np.random.default_rng(0), 400)


def test_users_and_small_bucket_warnings():
    jobs = [_job(5, user="alice")] * 200 + [_job(9, nodes=9, user=u) for u in ("bob", "carol")] * 6
    report = qs.summary(_data(jobs), qs.parse_buckets("1,9+"), n_boot=0)
    assert [b["users"] for b in report["buckets"]] == [1, 2]
    assert len(report["warnings"]) == 2
    assert report["warnings"][1].startswith("bucket 9+: 12 jobs from 2 user(s): under 100 jobs or 10 users")


# ---------------------------------------------------------------- SWF: censoring, fields, cores per node

SWF = """\
; MaxNodes: 4
; MaxProcs: 16
 1   0   50    0  4 -1 -1  4  3600 -1 5 7 1 -1 -1 2 -1 -1
 2   0   60  100  4 -1 -1  4  3600 -1 5 7 1 -1 -1 2 -1 -1
 3   0   70  100  6 -1 -1  6 86400 -1 1 8 1 -1 -1 1 -1 -1
 4   0   80  100  8 -1 -1  8    -1 -1 0 9 1 -1 -1 1 -1 -1
"""


def test_swf_censoring_requested_time_user_partition():
    jobs = qw.parse_swf(SWF.splitlines()).jobs
    assert [j.censored for j in jobs] == [True, False, False, False]  # status 5 and no run time: never started
    assert [j.requested_s for j in jobs] == [3600, 3600, 86400, None]
    assert [(j.user, j.partition, j.procs) for j in jobs] == [("7", "2", 4), ("7", "2", 4), ("8", "1", 6), ("9", "1", 8)]


@pytest.mark.parametrize("header, pattern", [
    ("; MaxNodes: 100\n; MaxProcs: 100", "MaxProcs = MaxNodes = 100"),
    ("; MaxNodes: 4\n; MaxProcs: 10", "not a multiple of MaxNodes 4"),
    ("; MaxNodes: 4", "lacks a numeric MaxProcs"),
])
def test_ambiguous_cores_per_node_is_an_error_not_a_guess(header, pattern):
    body = SWF.splitlines()[2:]
    with pytest.raises(qw.QueueWaitError, match=pattern):
        qw.parse_swf([*header.splitlines(), *body])
    assert len(qw.parse_swf([*header.splitlines(), *body], cores_per_node=2).jobs) == 4


def test_filters_whole_nodes_requested_time_partition():
    data = qw.parse_swf(SWF.splitlines())  # 4 cores per node: 6 processors is not whole nodes
    assert [j.wait_s for j in qw.select(data, qw.JobFilter(whole_nodes=True)).jobs] == [50, 60, 80]
    ranged = qw.select(data, qw.JobFilter(requested=(3600, 86400)))
    assert [j.wait_s for j in ranged.jobs] == [50, 60]
    assert ranged.filtered == {"requested time outside the range": 1, "requested time unknown": 1}
    assert [j.wait_s for j in qw.select(data, qw.JobFilter(requested=(86400, None))).jobs] == [70]
    assert [j.wait_s for j in qw.select(data, qw.JobFilter(partition="1")).jobs] == [70, 80]
    with pytest.raises(qw.QueueWaitError, match="--cores-per-node"):
        qw.select(_data([_job(1, procs=4)]), qw.JobFilter(whole_nodes=True))


# ---------------------------------------------------------------- sacct

SACCT = """\
JobID|Submit|Eligible|Start|End|NNodes|NCPUS|Timelimit|State|Partition|User|ReqTRES
1|2026-01-01T00:00:00|2026-01-01T01:00:00|2026-01-01T01:00:30|2026-01-01T02:00:00|1|4|1-00:00:00|COMPLETED|gpu|a|billing=4,cpu=4,gres/gpu:a100=2,node=1
2|2026-01-01T00:00:00|2026-01-01T00:00:00|None|2026-01-01T03:00:00|2|8|04:00:00|CANCELLED by 5|gpu|b|cpu=8,node=2
3|2026-01-01T00:00:00|Unknown|None|2026-01-01T03:00:00|1|4|30|CANCELLED by 5|cpu|c|cpu=4,node=1
4|2026-01-01T00:00:00|2026-01-01T00:00:00|Unknown|Unknown|1|4|UNLIMITED|PENDING|cpu|d|cpu=4,node=1
5|2026-01-01T00:00:00|2026-01-01T00:00:00|2026-01-01T00:00:10|2026-01-01T00:10:00|1|2|5:30|COMPLETED|cpu|a|cpu=2,node=1
"""


def test_sacct_waits_from_eligible_and_keeps_cancellations_censored():
    data = qw.parse_sacct(SACCT)
    by_id = {j.wait_s: j for j in data.jobs}
    assert sorted(by_id) == [10, 30, 3 * 3600]
    held = by_id[30]  # held for an hour: its wait starts at Eligible, not Submit
    assert (held.requested_s, held.gpus, held.procs, held.user) == (86400, 2, 4, "a")
    cancelled = by_id[3 * 3600]  # cancelled while queued: censored at End - Eligible
    assert cancelled.censored and cancelled.nodes == 2 and cancelled.requested_s == 4 * 3600
    assert by_id[10].requested_s == 330  # Timelimit 5:30 is MM:SS
    assert data.skipped == {"never eligible": 1, "still pending": 1}
    gpu = qw.select(data, qw.JobFilter(gpus=True))
    assert [j.wait_s for j in gpu.jobs] == [30] and gpu.filtered == {"no GPUs": 2}
    whole = qw.select(qw.WaitData("s", data.jobs, cores_per_node=4), qw.JobFilter(whole_nodes=True))
    assert sorted(j.wait_s for j in whole.jobs) == [30, 3 * 3600]


@pytest.mark.parametrize("text, seconds", [("30", 1800), ("5:30", 330), ("01:00:00", 3600), ("1-00:00:00", 86400),
                                           ("2-12", 2 * 86400 + 12 * 3600), ("1-02:30", 86400 + 2 * 3600 + 1800),
                                           ("UNLIMITED", None), ("Partition_Limit", None), ("", None)])
def test_slurm_durations(text, seconds):
    assert qw.slurm_duration(text) == seconds


# ---------------------------------------------------------------- projection from matched jobs


def test_projection_draws_from_jobs_matched_on_nodes_and_requested_time():
    """Short 1-node jobs start at once, 24 h ones wait an hour; a 24 h worker is modelled by the latter."""
    jobs = ([_job(0, requested_s=60)] * 100 + [_job(3600, requested_s=86400)] * 40
            + [_job(7200, nodes=4, requested_s=86400)] * 40)
    spec = qp.ProjectionSpec(rounds=10, round_seconds=600, workers=4, samples=200)
    proj = qp.project(_data(jobs), qs.parse_buckets(), spec)
    m = {x["model"]: x for x in proj["models"]}
    assert m["persistent"]["median_s"] == 3600 + 6000 and m["data_parallel"]["median_s"] == 7200 + 6000
    assert proj["pools"]["single_node"] == {"jobs": 40, "censored": 0,
                                            "matched": "1 node(s), requested time 12h to 2d"}
    assert proj["fastest"] == "persistent"


def test_projection_widens_the_match_and_says_so():
    jobs = [_job(5)] * 40 + [_job(50, nodes=3)] * 5
    proj = qp.project(_data(jobs), qs.parse_buckets(), qp.ProjectionSpec(rounds=2, round_seconds=60, workers=4, samples=50))
    assert proj["pools"]["single_node"]["matched"].startswith("1 node(s), any requested time (only 0 asked")
    assert proj["pools"]["k_node"]["matched"] == "bucket 2-4 (only 0 jobs of exactly 4 node(s))"


def test_elastic_start_waits_for_the_quorum_not_the_slowest():
    """Per lifetime the workers' waits are 4 draws of {0, 0, 0, 1000}: (c) waits for the slowest,
    (d) with quorum 2 for the second fastest, and the early starters idle until then."""
    jobs = [_job(w) for w in (0, 0, 0, 1000)] * 10 + [_job(0, nodes=4)]
    spec = qp.ProjectionSpec(rounds=1, round_seconds=60, workers=4, samples=2000, min_workers=2)
    m = {x["model"]: x for x in qp.project(_data(jobs), qs.parse_buckets(), spec)["models"]}
    assert m["elastic"]["queue_median_s"] == 0  # P(2nd fastest of 4 waits 1000 s) = P(3+ of 4 slow) < 5%
    assert m["persistent"]["queue_median_s"] == 1000  # P(at least one slow) = 1 - 0.75^4 = 68%
    assert "2 have started" in m["elastic"]["label"]


@settings(max_examples=40, deadline=None)
@given(st.lists(st.floats(0, 1e5), min_size=1, max_size=30), st.integers(1, 6), st.integers(1, 6), st.integers(1, 4))
def test_property_quorum_never_waits_longer_than_all(waits, k, m, lifetimes):
    """On the same draws, waiting for the m-th of k starts is never longer than for the k-th, and
    its queue time is the sum over lifetimes of that order statistic."""
    m = min(m, k)
    pool = np.asarray(waits)

    def draw(seed):
        rng = np.random.default_rng(seed)
        return lambda size: rng.choice(pool, size=size)
    q_m, idle_m = qp.queue_time(draw(7), lifetimes, k, 20, order=m, idle_waits=lifetimes)
    q_k, idle_k = qp.queue_time(draw(7), lifetimes, k, 20, idle_waits=lifetimes)
    assert (q_m <= q_k + 1e-9).all() and (idle_m <= idle_k + 1e-6).all() and (idle_m >= 0).all()
    d = draw(7)((20, lifetimes, k))
    assert np.allclose(q_m, np.sort(d, axis=2)[:, :, m - 1].sum(axis=1))


# ---------------------------------------------------------------- CLI


def test_cli_json_has_the_censoring_fields_and_filters(tmp_path, capsys):
    trace = tmp_path / "t.swf"
    trace.write_text(SWF)
    assert main(["bench", "queue-wait", "--swf", str(trace), "--json", "--whole-nodes", "--requested-time", "..2h",
                 "--bootstrap", "50"]) == 0
    report = json.loads(capsys.readouterr().out)
    b = report["buckets"][0]
    assert {k: b[k] for k in ("nodes", "jobs", "censored", "km_median_wait_s", "users")} == {
        "nodes": "1", "jobs": 2, "censored": 1, "km_median_wait_s": 60.0, "users": 1}
    assert b["median_ci_s"] == [60.0, 60.0]
    assert report["selection"] == "whole nodes, requested time < 2h"
    assert report["filtered_out"] == {"not whole nodes": 1, "requested time unknown": 1}
    assert report["warnings"] and report["bootstrap"]["unit"] == "day"


def test_cli_refuses_a_bad_range(tmp_path, capsys):
    trace = tmp_path / "t.swf"
    trace.write_text(SWF)
    with pytest.raises(SystemExit):
        main(["bench", "queue-wait", "--swf", str(trace), "--requested-time", "4h"])
    assert "LO..HI" in capsys.readouterr().err


def test_queue_wait_never_imports_torch(tmp_path):
    trace = tmp_path / "t.swf"
    trace.write_text(SWF)
    code = ("import sys; from orchestrator.cli import main; "
            f"rc = main(['bench', 'queue-wait', '--swf', {str(trace)!r}, '--json', '--bootstrap', '5']); "
            "assert rc == 0; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "False"


def test_live_sacct_censors_jobs_still_pending_at_now():
    now = qw._sacct_time("2026-01-01T05:00:00")
    data = qw.parse_sacct(SACCT, now=now)
    pending = [j for j in data.jobs if j.user == "d"]
    assert len(pending) == 1 and pending[0].censored and pending[0].wait_s == 5 * 3600
    assert data.skipped == {"never eligible": 1}  # still skipped: held, never eligible


@pytest.mark.parametrize("text, seconds", [("24h", 86400), ("90m", 5400), ("3600", 3600), ("0:20:00", 1200),
                                           ("5:30", 330), ("1-12:30", 86400 + 12 * 3600 + 1800), ("1-00:00:00", 86400)])
def test_cli_durations_read_slurm_times_as_slurm_does(text, seconds):
    from orchestrator.queuewait.cli import duration_s
    assert duration_s(text) == seconds


@pytest.mark.parametrize("args, pattern", [(["--swf", "T", "--gpus"], "only --sacct records which jobs asked"),
                                           (["--live", "--project", "--rounds", "2", "--round-seconds", "60",
                                             "--workers", "2"], "the projection needs a wait distribution")])
def test_cli_refuses_what_a_source_cannot_give(tmp_path, capsys, args, pattern):
    trace = tmp_path / "t.swf"
    trace.write_text(SWF)
    assert main(["bench", "queue-wait", *[str(trace) if a == "T" else a for a in args]]) == 2
    got = capsys.readouterr()
    assert pattern in got.out + got.err
