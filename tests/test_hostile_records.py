"""The service's own JSON records in a run directory, planted or damaged: each read through a checked
loader (orchestrator/lease.py `_read` for lock.json and the lease epochs, core/records.py for jobs.json
and record.json), never a hang or a traceback.
Real files, the real lease."""
from __future__ import annotations

import dataclasses
import json
import math
import posixpath
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from core.errors import RunError
from core.layout import RunLayout
from core.records import RoundJobs, RoundRecord
from core.storage import Storage
from orchestrator.lease import acquire

L = RunLayout()


def _acquire_within(s: Storage, seconds: float):
    """The lease, or a failure if taking it blocks longer than `seconds` (a NaN heartbeat made it wait for ever)."""
    got: list = []
    t = threading.Thread(target=lambda: got.append(acquire(s)), daemon=True)
    t.start()
    t.join(seconds)
    assert got, f"acquire() still waiting after {seconds}s"
    return got[0]


@pytest.mark.parametrize("lock", [
    b'{"pid": 1, "host": "elsewhere", "epoch": 1, "heartbeat_at": NaN}',
    b'{"pid": 1, "host": "elsewhere", "epoch": 1, "heartbeat_at": Infinity}',
    b'{"pid": 1, "host": "elsewhere", "epoch": 1, "heartbeat_at": 1e300}',
    b'{"pid": 1, "host": "elsewhere", "epoch": 1, "heartbeat_at": "now"}',
    b'{"pid": 1, "host": "elsewhere", "epoch": 1, "heartbeat_at": [1, 2]}',
    b'{"pid": "1", "host": ["x"], "epoch": "one", "heartbeat_at": null}',
    b'[1, 2, 3]',
    b'{"epoch": 1' + b"[" * 5000,
])
def test_a_damaged_lock_is_no_live_holder(tmp_path, lock):
    s = Storage(str(tmp_path / "run"))
    s.write_bytes(L.LOCK, lock)
    lease = _acquire_within(s, 20)
    assert lease.epoch >= 1
    lease.release()


def test_a_damaged_epoch_claim_is_no_live_holder(tmp_path):
    s = Storage(str(tmp_path / "run"))
    s.write_bytes(L.lease_epoch(3), json.dumps({"pid": 1, "host": "elsewhere", "at": float("nan")}).encode())
    lease = _acquire_within(s, 20)
    assert lease.epoch == 4
    lease.release()


def test_a_live_holder_is_named_without_its_planted_escape_sequences(tmp_path):
    from core.errors import RunError
    s = Storage(str(tmp_path / "run"))
    held = acquire(s)
    raw = s.read_json(L.LOCK)
    s.write_bytes(L.LOCK, json.dumps({**raw, "host": "evil\x1b]0;pwned\x07\x1b[2J"}).encode())
    with pytest.raises(RunError) as info:
        acquire(s)
    assert "\x1b" not in str(info.value) and "\x07" not in str(info.value) and "evil]0;pwned[2J" in str(info.value)
    held.release()


BOMB = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join([f'*{chr(97 + i)}'] * 9)}]\n" for i in range(8))  # 9^9 values expanded


@pytest.mark.parametrize("yaml_text, says", [
    (BOMB, "aliases are expanded"),
    ("inner: !!python/object/apply:os.system [echo hi]\n", "a config takes no tags"),
    ("inner: !custom 1\n", "a config takes no tags"),
    ("inner: " + "[" * 200 + "]" * 200 + "\n", "nested deeper"),
])
def test_hostile_yaml_is_one_config_error_everywhere_it_is_read(tmp_path, capsys, yaml_text, says):
    from orchestrator.cli import main
    (tmp_path / "c.yaml").write_text(yaml_text)
    assert main(["submit", "--config", str(tmp_path / "c.yaml"), "--run-dir", str(tmp_path / "r1")]) == 2
    assert says in capsys.readouterr().out and not (tmp_path / "r1").exists()
    value = yaml_text.split(":", 1)[1].strip() if not yaml_text.startswith("a:") else "&a [1, 1]"
    assert main(["submit", "--set", f"inner.lr={value}", "--run-dir", str(tmp_path / "r2")]) == 2
    assert "Traceback" not in capsys.readouterr().out
    run = tmp_path / "planted"
    run.mkdir(mode=0o700)
    (run / "config.yaml").write_text(yaml_text)
    for command in (["status", str(run)], ["resume", str(run)]):
        assert main(command) == 2
        out = capsys.readouterr().out
        assert says in out and "Traceback" not in out


@pytest.mark.parametrize("args, says", [
    (["--workers", "100000", "--executor", "local"], "workers must be at most 4096"),
    (["--workers", "400", "--executor", "local"], "400 local workers would start 400 processes"),
    (["--set", "round.poll_s=.inf"], "round.poll_s must be a finite number, got inf"),
    (["--set", "inner.lr=.nan"], "inner.lr must be a finite number"),
    (["--set", "model.block_size=1000000000000"], "more than any model this runs"),
    (["--set", f"outer.warmup_rounds={2**1100}"], "outer.warmup_rounds is a 332-digit number, past any count"),
    (["--set", f"inner.steps={2**60}"], "inner.steps is a 19-digit number"),
    (["--set", 'data.cache_dir="/tmp/a\\0b"'], "data.cache_dir holds a NUL byte (at character 6)"),  # YAML's escape
])
def test_numbers_that_would_exhaust_the_machine_are_refused_before_anything_is_made(tmp_path, capsys, args, says):
    from orchestrator.cli import main
    assert main(["submit", *args, "--run-dir", str(tmp_path / "run")]) == 2
    out = capsys.readouterr().out
    assert says in out and "Traceback" not in out and not (tmp_path / "run").exists()


def test_oversubscribe_lets_more_local_workers_through_that_check(tmp_path, capsys, corpus_cache):
    """--oversubscribe lifts the local process bound (and only it): the submission goes on to the next
    check, here a run directory others can write, so that no 400 processes are started by the test."""
    from orchestrator.cli import main
    run = tmp_path / "run"
    run.mkdir()
    run.chmod(0o777)
    assert main(["submit", "--workers", "400", "--executor", "local", "--oversubscribe", "--run-dir", str(run),
                 "--set", f"data.cache_dir={corpus_cache}"]) == 2
    out = capsys.readouterr().out
    assert "local workers would start" not in out and "writable" in out and not (run / "config.yaml").exists()


# -- jobs.json and record.json: one checked loader each (core/records.py) ----------------------------
GOOD_JOBS = {"round": 3, "submitted_at": 10.5, "sbatch_calls": 2,
             "workers": {"0": {"attempts": 1, "job_ids": ["12_0"], "base": "global/g.safetensors", "base_digest": "d",
                               "persistent": False, "submitted_at": 10.5, "failures": []}}}


def _jobs(**change):
    raw = json.loads(json.dumps(GOOD_JOBS))
    for path, v in change.items():
        *up, last = path.split("__")
        node = raw
        for k in up:
            node = node[k]
        node[last] = v
    return raw


def test_a_jobs_file_as_written_loads(tmp_path):
    s = Storage(str(tmp_path / "run"))
    s.write_bytes(L.round_jobs(3), json.dumps(GOOD_JOBS).encode())
    jobs = RoundJobs.load(s, 3)
    assert jobs.latest() == {0: "12_0"} and jobs.submitted_at == 10.5 and jobs.workers[0].base_digest == "d"
    assert RoundJobs.load(s, 3).to_json() == GOOD_JOBS  # what it writes, it reads back the same


@pytest.mark.parametrize("raw, field", [
    (_jobs(submitted_at=float("nan")), "'submitted_at'"),    # a NaN deadline: the round would never time out
    (_jobs(sbatch_calls=True), "'sbatch_calls'"),
    (_jobs(round="3"), "'round'"),
    (_jobs(workers=[1]), "'workers'"),
    (_jobs(workers__0__attempts=1.5), "'attempts'"),
    (_jobs(workers__0__job_ids=["1", 2]), "'job_ids'"),
    (_jobs(workers__0__job_ids=[]), "at least one job id"),
    (_jobs(workers__0__submitted_at=float("inf")), "'submitted_at'"),
    (_jobs(workers__0__failures={"a": 1}), "'failures'"),
    (_jobs(workers={"-1": GOOD_JOBS["workers"]["0"]}), "not a worker number"),
    (_jobs(round=4), "round 4's jobs file"),
    ([1, 2], "a JSON list"),
])
def test_a_damaged_jobs_file_is_refused_naming_the_field(tmp_path, raw, field):
    s = Storage(str(tmp_path / "run"))
    s.write_bytes(L.round_jobs(3), json.dumps(raw).encode())
    with pytest.raises(RunError, match="jobs.json") as err:
        RoundJobs.load(s, 3)
    assert field in str(err.value) and "orchestrate resume" in str(err.value)


def test_a_record_with_a_wrong_field_is_refused_naming_it(tmp_path):
    s = Storage(str(tmp_path / "run"))
    base = {f.name: None for f in dataclasses.fields(RoundRecord)}
    s.write_bytes(L.round_record(0), json.dumps({**base, "round": 0}).encode())
    with pytest.raises(RunError, match=r"record.json is not a record islands wrote: 'merged' is None, not list\[int\]"):
        RoundRecord.load(s, 0)
    s.write_bytes(L.round_record(0), json.dumps({"round": 0}).encode())
    with pytest.raises(RunError, match="no 'merged'"):
        RoundRecord.load(s, 0)


@given(st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3),
                    max_leaves=12))
@settings(max_examples=200, deadline=None)
def test_any_json_in_a_jobs_field_is_loaded_typed_or_refused(value):
    """Whatever a co-tenant writes into any field: a RunError, or values of exactly the declared types."""
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        s = Storage(d)
        for key in ("submitted_at", "sbatch_calls", "workers"):
            s.write_bytes(L.round_jobs(3), json.dumps(_jobs(**{key: value})).encode())
            try:
                jobs = RoundJobs.load(s, 3)
            except RunError:
                continue
            assert jobs.submitted_at is None or math.isfinite(jobs.submitted_at)
            assert isinstance(jobs.sbatch_calls, int)
            assert all(isinstance(w, int) and e.job_ids and all(isinstance(j, str) for j in e.job_ids)
                       for w, e in jobs.workers.items())


PLANTED_JOBS = [_jobs(workers__0__job_ids=[]), _jobs(workers__0__attempts="1"), b"\xff{"]


@pytest.mark.parametrize("raw", PLANTED_JOBS)
def test_a_waiting_persistent_worker_reads_a_planted_jobs_file_through_its_loader_and_waits_on(tmp_path, raw, caplog):
    """worker/persistent.py's wait: a planted jobs.json is one warning, then the honest file (the
    service's rewrite) assigns the round."""
    from worker.persistent import wait_for_assignment
    s = Storage(str(tmp_path / "run"))
    s.write_bytes(L.round_jobs(3), raw if isinstance(raw, bytes) else json.dumps(raw).encode())
    timer = threading.Timer(1.0, lambda: s.write_bytes(L.round_jobs(3), json.dumps(GOOD_JOBS).encode()))
    timer.start()
    with caplog.at_level("WARNING"):
        entry = wait_for_assignment(s, 3, 0, "12_0")
    timer.join()
    assert entry.latest == "12_0" and entry.base == GOOD_JOBS["workers"]["0"]["base"]
    said = [r.getMessage() for r in caplog.records if "jobs.json" in r.getMessage()]
    assert len(said) == 1 and "waiting on as if round 3 were not assigned yet" in said[0]


def test_the_service_keeps_the_jobs_it_saved_and_sets_a_damaged_file_aside(tmp_path, caplog):
    """The service never reads back a file planted over the one it saved; after a restart a
    damaged one is set aside (named, kept) and the round's jobs start over: never a stopped run."""
    from core.config import config_from_dict
    from orchestrator.submission import Submitter
    s = Storage(str(tmp_path / "run"))
    cfg = config_from_dict({"workers": 1, "rounds": 5, "run_dir": s.url})
    s.write_bytes(L.round_jobs(3), json.dumps(GOOD_JOBS).encode())
    service = Submitter(s, cfg, executor=None)
    assert service.jobs(3).latest() == {0: "12_0"}
    s.write_bytes(L.round_jobs(3), json.dumps(PLANTED_JOBS[0]).encode())
    assert service.jobs(3).latest() == {0: "12_0"}  # what it saved
    with caplog.at_level("WARNING"):
        assert Submitter(s, cfg, executor=None).jobs(3).workers == {}  # a restarted service
    assert "at least one job id" in caplog.text and "Set aside to" in caplog.text and not s.exists(L.round_jobs(3))
    (aside,) = [n for n in s.list(posixpath.dirname(L.round_jobs(3))) if ".rejected-" in n]
    assert json.loads(s.read_bytes(f"{posixpath.dirname(L.round_jobs(3))}/{aside}")) == PLANTED_JOBS[0]


def test_a_run_dir_under_a_file_is_one_clear_error_for_every_command(tmp_path, capsys):
    from orchestrator.cli import main
    (tmp_path / "file").write_text("not a folder")
    run = str(tmp_path / "file" / "run")
    assert main(["submit", "--executor", "inline", "--run-dir", run]) == 2
    out = capsys.readouterr().out
    assert f"{tmp_path / 'file'} is a file, not a folder" in out and "Traceback" not in out, out
    for command in (["status", run], ["resume", run], ["cancel", run]):
        assert main(command) != 0
        out = capsys.readouterr().out
        assert "not a run directory" in out and "Traceback" not in out, (command, out)
