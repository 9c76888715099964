"""Queue-wait benchmark: parsers and statistics on hand-written traces with hand-worked numbers,
the projection's sanity, the CLI, the real KTH trace when present, and live probes on real Slurm."""
from __future__ import annotations

import gzip
import json
import math
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator.queuewait import projection as qp
from orchestrator.queuewait import stats as qs
from orchestrator.queuewait import waits as qw
from orchestrator.cli import main
from orchestrator.queuewait.io import PROBE_NAME, read_sacct_file, read_swf, run_probes
from slurm_support import requires_slurm

ROOT = Path(__file__).resolve().parents[1]
KTH = "KTH-SP2-1996-2.1-cln.swf.gz"
TRACE_DIRS = [Path(__file__).resolve().parents[2] / "shared" / "traces", Path("/work/shared/traces")]

# 4 cores per node (MaxProcs / MaxNodes). Fields: id submit wait run alloc cpu mem req ... (18 in all)
SWF = """\
; Version: 2.2
; MaxNodes: 4
; MaxProcs: 16
; UnixStartTime: 0
 1      0    10 100  4 -1 -1  4 -1 -1 1 1 1 -1 -1 -1 -1 -1
 2      5    20 100  1 -1 -1  1 -1 -1 1 1 1 -1 -1 -1 -1 -1
 3  86400    30 100 -1 -1 -1  3 -1 -1 1 1 1 -1 -1 -1 -1 -1
 4  86500    80 100  2 -1 -1  2 -1 -1 1 1 1 -1 -1 -1 -1 -1
 5  86600    60 100  4 -1 -1  4 -1 -1 1 1 1 -1 -1 -1 -1 -1
 6      0   100 100  5 -1 -1  5 -1 -1 1 1 1 -1 -1 -1 -1 -1
 7      0   300 100 -1 -1 -1  8 -1 -1 1 1 1 -1 -1 -1 -1 -1
 8      0    -1 100  4 -1 -1  4 -1 -1 1 1 1 -1 -1 -1 -1 -1
 9      0    50 100 -1 -1 -1 -1 -1 -1 1 1 1 -1 -1 -1 -1 -1
10      0  1000 100 36 -1 -1 36 -1 -1 1 1 1 -1 -1 -1 -1 -1
11      0     0 100  0 -1 -1 16 -1 -1 1 1 1 -1 -1 -1 -1 -1
"""

SACCT = """\
JobID|Submit|Start|NNodes|State|Partition|User
10|2026-01-01T00:00:00|2026-01-01T00:01:00|1|COMPLETED|debug|alice
10.batch|2026-01-01T00:00:00|2026-01-01T00:01:00|1|COMPLETED||
10.extern|2026-01-01T00:00:00|2026-01-01T00:01:00|1|COMPLETED||
11|2026-01-01T00:00:00|2026-01-01T02:00:00|4|COMPLETED|debug|bob
12|2026-01-01T00:00:00|Unknown|2|PENDING|debug|alice
13_1|2026-01-02T10:00:00|2026-01-02T10:00:30|1|CANCELLED by 0|gpu|alice
14|2026-01-02T10:00:00|None|1|CANCELLED by 0|debug|bob
15_[0-3]|2026-01-02T10:00:00|Unknown|1|PENDING|debug|bob
16|2026-01-02T11:00:00|2026-01-02T11:00:00|8|RUNNING|debug|bob
"""


def _bucket(report: dict, label: str) -> dict:
    return next(b for b in report["buckets"] if b["nodes"] == label)


def _jobs(waits: dict[int, list[float]]) -> qw.WaitData:
    """WaitData with the given waits per node count, all on day 0."""
    return qw.WaitData("test", tuple(qw.JobWait(0.0, w, n) for n, ws in waits.items() for w in ws))


# ---------------------------------------------------------------- SWF


def test_swf_hand_worked_stats():
    # Prepare
    data = qw.parse_swf(SWF.splitlines())
    # Execute
    report = qs.summary(data, qs.parse_buckets())
    # Assert: job 3 uses requested procs (alloc -1), job 11 too (alloc 0); 8 and 9 skipped
    assert data.cores_per_node == 4
    assert (report["jobs"], report["skipped"]) == (9, 2)
    assert report["skipped_reasons"] == {"unknown wait (-1)": 1, "no processor count": 1}
    assert sorted(j.nodes for j in data.jobs) == [1, 1, 1, 1, 1, 2, 2, 4, 9]
    one = _bucket(report, "1")  # waits 10 20 30 60 80
    assert one["jobs"] == 5 and one["mean_wait_s"] == 40 and one["median_wait_s"] == 30
    assert one["p90_wait_s"] == pytest.approx(72)  # index 0.9*4 = 3.6: 60 + 0.6 * 20
    assert one["days"] == 2 and one["per_day_median_wait_s"] == pytest.approx((15 + 60) / 2)
    mid = _bucket(report, "2-4")  # waits 0 100 300
    assert mid["mean_wait_s"] == pytest.approx(400 / 3) and mid["median_wait_s"] == 100
    assert mid["p90_wait_s"] == pytest.approx(260)  # index 1.8: 100 + 0.8 * 200
    assert _bucket(report, "5-8") == {"nodes": "5-8", "jobs": 0, "mean_wait_s": None, "median_wait_s": None,
                                      "p90_wait_s": None, "censored": 0, "km_median_wait_s": None,
                                      "km_p90_wait_s": None, "median_ci_s": [None, None], "users": None, "days": 0,
                                      "per_day_median_wait_s": None}
    assert _bucket(report, "9+")["p90_wait_s"] == 1000


def test_swf_cores_per_node_argument_overrides_header():
    data = qw.parse_swf(SWF.splitlines(), cores_per_node=1)
    assert sorted(j.nodes for j in data.jobs) == [1, 2, 3, 4, 4, 5, 8, 16, 36]


def test_swf_without_header_needs_cores_per_node():
    body = [line for line in SWF.splitlines() if not line.startswith(";")]
    with pytest.raises(qw.QueueWaitError, match="--cores-per-node"):
        qw.parse_swf(body)
    assert len(qw.parse_swf(body, cores_per_node=2).jobs) == 9


def test_swf_malformed_lines_are_counted():
    data = qw.parse_swf(["1 0 5", "2 0 x 1 1 1 1 1", "3 0 7 1 1 -1 -1 1"], cores_per_node=1)
    assert [j.wait_s for j in data.jobs] == [7] and data.skipped == {"malformed line": 2}


def test_swf_gz_and_plain_files_read_the_same(tmp_path):
    plain, packed = tmp_path / "t.swf", tmp_path / "t.swf.gz"
    plain.write_text(SWF)
    packed.write_bytes(gzip.compress(SWF.encode()))
    assert read_swf(plain).jobs == read_swf(packed).jobs == qw.parse_swf(SWF.splitlines()).jobs


def test_missing_file_says_which(tmp_path):
    with pytest.raises(qw.QueueWaitError, match="nope.swf"):
        read_swf(tmp_path / "nope.swf")


# ---------------------------------------------------------------- sacct


def test_sacct_hand_worked_stats(tmp_path):
    data = qw.parse_sacct(SACCT)
    report = qs.summary(data, qs.parse_buckets())
    # steps ignored; 12, 14 and the pending array 15 never started
    assert (report["jobs"], report["skipped"]) == (4, 3)
    assert report["skipped_reasons"] == {"still pending": 2, "never started, no end time": 1}
    one = _bucket(report, "1")  # 60 s on Jan 1, 30 s on Jan 2
    assert (one["jobs"], one["mean_wait_s"], one["median_wait_s"]) == (2, 45, 45)
    assert one["p90_wait_s"] == pytest.approx(57) and one["days"] == 2
    assert _bucket(report, "2-4")["median_wait_s"] == 7200
    assert _bucket(report, "5-8")["median_wait_s"] == 0
    path = tmp_path / "sacct.txt"
    path.write_text(SACCT)
    assert read_sacct_file(path).jobs == data.jobs


def test_sacct_filters_and_headerless_input():
    debug = qw.parse_sacct(SACCT, partition="debug")
    assert sorted(j.wait_s for j in debug.jobs) == [0, 60, 7200] and debug.n_skipped == 3
    alice = qw.parse_sacct(SACCT, user="alice")
    assert sorted(j.wait_s for j in alice.jobs) == [30, 60] and alice.n_skipped == 1
    headerless = "\n".join(SACCT.splitlines()[1:])
    old_fields = SACCT.splitlines()[0].split("|")
    assert qw.parse_sacct(headerless, fields=old_fields).jobs == qw.parse_sacct(SACCT).jobs
    trailing = "\n".join(line + "|" for line in SACCT.splitlines())  # sacct -p instead of -P
    assert qw.parse_sacct(trailing).jobs == qw.parse_sacct(SACCT).jobs


def test_sacct_without_needed_fields_is_an_error():
    with pytest.raises(qw.QueueWaitError, match="NNodes"):
        qw.parse_sacct("JobID|Submit|Start\n1|2026-01-01T00:00:00|2026-01-01T00:00:01\n")


# ---------------------------------------------------------------- buckets


def test_buckets_parse_and_assign():
    buckets = qs.parse_buckets("1,2-4,5-8,9+")
    assert [(b.lo, b.hi) for b in buckets] == [(1, 1), (2, 4), (5, 8), (9, None)]
    assert [qs.bucket_index(n, buckets) for n in (1, 2, 4, 5, 8, 9, 1000)] == [0, 1, 1, 2, 2, 3, 3]
    gaps = qs.parse_buckets("1,4")
    assert qs.bucket_index(2, gaps) is None
    report = qs.summary(_jobs({1: [1], 2: [2], 4: [4]}), gaps)
    assert report["outside_buckets"] == 1 and [b["jobs"] for b in report["buckets"]] == [1, 1]


@pytest.mark.parametrize("spec", ["2-1", "1,1-3", "9+,10", "x", "0", "1,,2"])
def test_bad_buckets_are_refused(spec):
    with pytest.raises(qw.QueueWaitError, match="bucket"):
        qs.parse_buckets(spec)


swf_jobs = st.lists(st.tuples(st.integers(-1, 10**6), st.integers(-1, 64), st.integers(-1, 64)), max_size=40)


@settings(max_examples=60, deadline=None)
@given(jobs=swf_jobs, cpn=st.integers(1, 8))
def test_property_swf_parse_and_bucketing(jobs, cpn):
    text = [f"{i} {i * 10} {w} 1 {a} -1 -1 {r} -1 -1 1 1 1 -1 -1 -1 -1 -1" for i, (w, a, r) in enumerate(jobs)]
    data = qw.parse_swf(text, cores_per_node=cpn)
    expected = [(w, a if a > 0 else r) for w, a, r in jobs if w >= 0 and (a > 0 or r > 0)]
    assert len(data.jobs) + data.n_skipped == len(jobs)
    assert [(j.wait_s, j.nodes) for j in data.jobs] == [(w, math.ceil(p / cpn)) for w, p in expected]
    buckets = qs.parse_buckets()
    stats = qs.summary(data, buckets, n_boot=0)
    assert stats["outside_buckets"] == 0 and sum(b["jobs"] for b in stats["buckets"]) == len(expected)
    for b, waits in zip(buckets, qs.waits_by_bucket(data.jobs, buckets)):
        assert sorted(waits) == sorted(w for w, p in expected if math.ceil(p / cpn) in b)


# ---------------------------------------------------------------- projection

SPEC = qp.ProjectionSpec(rounds=10, round_seconds=60, workers=4, job_time_limit_s=300, samples=500, seed=1)


def _models(projection: dict) -> dict[str, dict]:
    return {m["model"]: m for m in projection["models"]}


def test_projection_with_zero_waits_is_compute_time():
    projection = qp.project(_jobs({1: [0, 0], 4: [0]}), qs.parse_buckets(), SPEC)
    for m in projection["models"]:
        assert m["median_s"] == m["p90_s"] == 10 * 60 and m["idle_node_hours_median"] == 0


def test_projection_hand_worked_constant_waits():
    # 1-node jobs wait 100 s, 4-node jobs 1000 s; a job lives floor(300 / 60) = 5 rounds: 2 lifetimes
    projection = qp.project(_jobs({1: [100], 3: [1000]}), qs.parse_buckets(), SPEC)
    m = _models(projection)
    assert projection["lifetime_rounds"] == 5
    assert m["data_parallel"]["median_s"] == 2 * 1000 + 600 and m["data_parallel"]["job_submissions"] == 2
    assert m["per_round"]["median_s"] == 10 * 100 + 600 and m["per_round"]["job_submissions"] == 40
    assert m["persistent"]["median_s"] == 2 * 100 + 600 and m["persistent"]["job_submissions"] == 8
    assert m["elastic"]["median_s"] == 2 * 100 + 600  # all start at once: the quorum changes nothing


def test_projection_is_seeded_and_resubmitting_costs_more():
    data = _jobs({1: [5, 30, 60, 600, 3600], 4: [60, 7200]})
    first = qp.project(data, qs.parse_buckets(), SPEC)
    assert first == qp.project(data, qs.parse_buckets(), SPEC)
    m = _models(first)
    assert m["per_round"]["median_s"] >= m["persistent"]["median_s"] > 600
    assert m["per_round"]["p90_s"] >= m["persistent"]["p90_s"]
    assert m["persistent"]["idle_node_hours_median"] > 0 and m["per_round"]["idle_node_hours_median"] == 0
    one_round = qp.ProjectionSpec(rounds=1, round_seconds=60, workers=4, samples=200)
    m = _models(qp.project(data, qs.parse_buckets(), one_round))  # lo-fi: nobody waits for a merge
    assert m["persistent"]["idle_node_hours_median"] == 0
    assert m["persistent"]["median_s"] == pytest.approx(m["per_round"]["median_s"], rel=0.5)


def test_projection_errors_say_how_to_fix():
    with pytest.raises(qw.QueueWaitError, match="--buckets"):
        qp.project(_jobs({1: [1]}), qs.parse_buckets(), SPEC)  # no 4-node job measured
    short = qp.ProjectionSpec(rounds=2, round_seconds=600, workers=1, job_time_limit_s=60)
    with pytest.raises(qw.QueueWaitError, match="--job-time-limit"):
        qp.project(_jobs({1: [1]}), qs.parse_buckets(), short)


# ---------------------------------------------------------------- CLI


def test_cli_json_projection_and_plot(tmp_path, capsys):
    trace = tmp_path / "t.swf"
    trace.write_text(SWF)
    png = tmp_path / "img" / "waits.png"
    rc = main(["bench", "queue-wait", "--swf", str(trace), "--json", "--project", "--rounds", "4",
               "--round-seconds", "10m", "--workers", "2", "--job-time-limit", "0:20:00", "--plot", str(png)])
    assert rc == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["source"], report["jobs"], report["skipped"]) == ("swf:t.swf", 9, 2)
    assert [b["nodes"] for b in report["buckets"]] == ["1", "2-4", "5-8", "9+"]
    assert _bucket(report, "1")["p90_wait_s"] == pytest.approx(72)
    assert report["projection"]["lifetime_rounds"] == 2 and len(report["projection"]["models"]) == 4
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_plain_lines_and_errors(tmp_path, capsys):
    trace = tmp_path / "t.swf"
    trace.write_text(SWF)
    assert main(["bench", "queue-wait", "--swf", str(trace), "--buckets", "1,2+"]) == 0
    out = capsys.readouterr().out
    assert "9 jobs, 2 skipped" in out and "nodes 2+: 4 jobs" in out
    assert main(["bench", "queue-wait", "--swf", str(trace), "--project", "--rounds", "3"]) == 2
    assert "--round-seconds, --workers" in capsys.readouterr().out


# ---------------------------------------------------------------- the real trace


def _kth() -> Path:
    for d in TRACE_DIRS:
        if (d / KTH).exists():
            return d / KTH
    pytest.skip(f"{KTH} not found in {', '.join(map(str, TRACE_DIRS))}")


def test_real_kth_trace():
    with pytest.raises(qw.QueueWaitError, match="MaxProcs = MaxNodes = 100"):
        read_swf(_kth())  # one core per node, or nodes counted as processors: the header cannot say
    data = read_swf(_kth(), cores_per_node=1)
    report = qs.summary(data, qs.parse_buckets())
    assert data.cores_per_node == 1
    assert (report["jobs"], report["skipped"]) == (27992, 0)
    one = _bucket(report, "1")
    assert (one["jobs"], one["median_wait_s"]) == (9119, 180)  # checked with awk on the file
    big = _bucket(report, "9+")
    assert big["median_wait_s"] > one["median_wait_s"] and big["per_day_median_wait_s"] > one["per_day_median_wait_s"]


# ---------------------------------------------------------------- live, on a real Slurm


def _squeue(*args: str) -> list[str]:
    out = subprocess.run(["squeue", "-h", "-o", "%i", *args], capture_output=True, text=True, timeout=30)
    return out.stdout.split()


@pytest.fixture
def background_load():
    """Three whole-node sleep jobs: one of the 4 nodes stays free for a while. Yields whether some
    node still has free CPUs once the load runs (other people's jobs may take them)."""
    ids = []
    try:
        for _ in range(3):
            out = subprocess.run(["sbatch", "--parsable", "-N", "1", "--exclusive", "-t", "5", "-J", "islands-qw-load",
                                  "-o", "/dev/null", "--wrap", "sleep 12"], capture_output=True, text=True, timeout=30)
            assert out.returncode == 0, out.stderr
            ids.append(out.stdout.strip())
        deadline = time.monotonic() + 20
        while set(_squeue("-t", "R", "-j", ",".join(ids))) != set(ids) and time.monotonic() < deadline:
            time.sleep(0.5)
        nodes = subprocess.run(["sinfo", "-h", "-N", "-o", "%t"], capture_output=True, text=True, timeout=30)
        yield bool({"idle", "mix"} & set(nodes.stdout.split()))
    finally:
        subprocess.run(["scancel", *ids], timeout=30, check=False)


@pytest.mark.slurm
@requires_slurm
def test_live_probes_single_node_starts_first(background_load):
    data = run_probes([1, 2, 4], per_size=2, max_seconds=45, poll_s=0.5)
    waits = qs.waits_by_bucket(data.jobs, qs.parse_buckets("1,2,4"))
    print("probe waits (s) for 1, 2, 4 nodes:", [w.tolist() for w in waits])
    assert len(data.jobs) + data.n_skipped == 6 and len(data.jobs) >= 2
    assert not _squeue("-n", PROBE_NAME, "-t", "PD,R"), "probe jobs left behind"
    if background_load and all(w.size for w in waits):  # with no free node at all the order is moot
        assert np.median(waits[0]) <= min(np.median(waits[1]), np.median(waits[2]))


@pytest.mark.slurm
@requires_slurm
def test_live_estimate_asks_the_scheduler_and_submits_nothing(background_load, capsys):
    """sbatch --test-only for whole-node jobs of the worker's time limit: with 3 of 4 nodes held by
    5-minute jobs, one node starts now and two wait for those jobs' limits."""
    before = set(_squeue())
    rc = main(["bench", "queue-wait", "--live", "--probe-nodes", "1,2", "--job-time-limit", "10m", "--json"])
    assert rc == 0
    report = json.loads(capsys.readouterr().out)
    assert set(_squeue()) <= before, "--live without --submit submitted a job"
    est = {e["nodes"]: e for e in report["estimates"]}
    assert sorted(est) == [1, 2] and all(e["wait_s"] >= 0 and e["partition"] for e in est.values())
    if background_load:
        assert est[1]["wait_s"] < 60 < est[2]["wait_s"]


@pytest.mark.slurm
@requires_slurm
def test_live_probes_cancelled_on_sigterm(background_load):
    proc = subprocess.Popen([sys.executable, "-m", "orchestrator.cli", "-v", "bench", "queue-wait", "--live",
                             "--submit", "--probe-nodes", "4", "--probes-per-size", "2", "--max-seconds", "60"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    ids: list[str] = []
    for line in proc.stderr:  # the log (-v) says which jobs it submitted
        if "submitted" in line and "probe jobs:" in line:
            ids = line.rsplit(":", 1)[1].strip().split(",")
            break
    assert ids, "the probe run never reported its jobs"
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130, err
    assert not set(_squeue("-t", "PD,R")) & set(ids), "probes still queued after SIGTERM"


def test_tables_on_an_80_column_terminal_have_one_unit_each_and_no_cut_number(tmp_path):
    """The real command in an 80-column pty: waits of a minute, 98 minutes and 3.1 hours in one table
    are all in the table's one unit, named in its title; no cell is cut ('…') and no line wraps."""
    import re
    import sys

    from terminal_support import in_a_terminal
    rows = [(1, 60, 1), (2, 5880, 1), (3, 11160, 1), (4, 20, 2), (5, 7200, 4), (6, 300, 8), (7, 90000, 12)]
    trace = tmp_path / "mixed.swf"
    trace.write_text("; MaxNodes: 16\n; MaxProcs: 64\n" + "".join(
        f"{i} {i * 100} {wait} 100 {4 * n} -1 -1 {4 * n} 43200 -1 1 1 1 -1 -1 -1 -1 -1\n" for i, wait, n in rows))
    raw, lines = in_a_terminal([sys.executable, "-m", "orchestrator.cli", "bench", "queue-wait", "--swf", str(trace),
                                "--project", "--rounds", "16", "--round-seconds", "5m", "--workers", "4"], cols=80, rows=60)
    written = [re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", x) for x in raw.decode().split("\r\n")]
    assert max(map(len, written)) <= 80 and "…" not in raw.decode(), "\n".join(lines)
    at = lines.index("queue wait (hours)")
    head = next(i for i in range(at + 1, at + 4) if lines[i].split()[:1] == ["nodes"])
    assert " ".join(lines[head].split()).startswith("nodes mean median p90 KM median 95% CI KM p90"), lines
    first = lines[head + 2].split()  # 1 node: waits 60 s, 98 min, 3.1 h
    assert first[:4] == ["1", "1.58", "1.63", "2.81"], lines  # mean 5700 s, median 5880 s, p90 10104 s: in hours
    assert not any(re.search(r"\d(s|min|h|d)\b", x) for x in lines[at:at + 8]), lines
    assert any(x.startswith("end to end and queue (") for x in lines), lines


def test_per_round_jobs_draw_waits_from_jobs_that_asked_for_a_round_not_a_day():
    """A per-round job asks for its round (10 min here), not the persistent jobs' 24 h: on the
    shipped KTH trace its waits come from 1-node jobs that asked for 5 to 20 minutes, and the
    projection says so beside the figure."""
    data = read_swf(_kth(), cores_per_node=1)
    spec = qp.ProjectionSpec(rounds=128, round_seconds=600, workers=8, job_time_limit_s=24 * 3600, samples=200)
    assert spec.round_job_limit_s == 600
    pool, how = qp.matched(data.jobs, qs.parse_buckets(), 1, spec.round_job_limit_s)
    assert len(pool) >= qp.MIN_MATCHED and all(300 <= j.requested_s < 1200 for j in pool)
    pools = qp.project(data, qs.parse_buckets(), spec)["pools"]
    assert pools["per_round"]["matched"] == "(b)'s 10min jobs: 1 node(s), requested time 5min to 20min", pools
    assert pools["per_round"]["jobs"] == len(pool) and pools["single_node"]["jobs"] != len(pool)
