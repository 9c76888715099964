"""What a round writes and keeps: a persistent worker's AdamW state is a snapshot every
round.state_every rounds (and when its job ends early or is preempted between rounds), and a run
deletes the tensors of committed rounds nothing needs any more (round.keep_last, keep_every), while
resume, the rebuild of a lost outer state and --replay still work. Real runs (local executor), real
files, the real worker in this process for the snapshots.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

import worker.train as train
from core.checkpoint import read_manifest
from core.config import config_from_dict
from core.layout import RunLayout
from core.storage import Storage
from orchestrator.cli import main
from orchestrator.observe.report import write_report
from orchestrator.retention import doomed, prune
from runs import TINY
from test_replay import _bytes_of
from test_resident import _merge, _run as _worker_run, _task

L = RunLayout()


def _cfg(**round_keys) -> object:
    return config_from_dict({"rounds": 40, "round": round_keys})


def test_the_plan_keeps_the_last_committed_round_and_what_it_is_told_to():
    assert doomed(_cfg(keep_last=0), 9) == []  # keep everything
    got = doomed(_cfg(keep_last=1), 5)
    assert sorted(q for w, q in got if w == "global") == [1, 2, 3, 4]  # global_5 and global_6 stay, and the base
    assert sorted(q for w, q in got if w == "state") == [1, 2, 3, 4]
    assert sorted(q for w, q in got if w == "contrib") == [0, 1, 2, 3, 4]  # round 5's: a rebuild of state 6 needs them
    assert sorted(q for w, q in doomed(_cfg(keep_last=2), 5) if w == "global") == [1, 2, 3]
    assert sorted(q for w, q in doomed(_cfg(keep_last=1, keep_every=2), 5) if w == "global") == [1, 3]
    fold = doomed(_cfg(keep_last=1, late_policy="fold", max_staleness=3), 5)  # a merge may fold rounds 3..5 in
    assert sorted(q for w, q in fold if w == "contrib") == [0, 1, 2] and max(q for w, q in fold if w == "global") == 2
    assert doomed(_cfg(keep_last=1), 5, first=4) == [("global", 4), ("state", 4), ("contrib", 4), ("folded", 4)]


def _tensors(run: Path) -> list[str]:
    return sorted(str(p.relative_to(run)) for p in run.rglob("*.safetensors") if p.parts[-2:-1] != ("jobs",)
                  and "jobs" not in p.relative_to(run).parts)


@pytest.mark.slow
def test_a_pruned_run_is_flat_and_still_resumes_rebuilds_and_replays(tmp_path, corpus_cache, capsys, monkeypatch):
    run = tmp_path / "run"
    args = ["submit", "--executor", "inline", "--run-dir", str(run), "--set", f"data.cache_dir={corpus_cache}", *TINY,
            "--workers", "2", "--rounds", "4", "--inner-steps", "2"]
    assert main(args) == 0
    assert _tensors(run) == ["final/model.safetensors", "global/round_00000.safetensors",  # the run's base
                             "global/round_00003.safetensors", "global/round_00004.safetensors",
                             "outer/state_00003.safetensors", "outer/state_00004.safetensors",
                             "rounds/00003/contrib/worker_000.safetensors", "rounds/00003/contrib/worker_001.safetensors"]
    assert (run / "global" / "round_00001.json").exists() and (run / "rounds" / "00000" / "record.json").exists()
    assert main(["status", str(run)]) == 0 and "run directory:" in capsys.readouterr().out
    monkeypatch.setenv("ISLANDS_CACHE", str(tmp_path / "cache"))
    report = write_report(Storage(str(run)), tmp_path / "report")  # statistics of the kept round; no problem
    assert report["problems"] == [] and report["rounds"] == 4
    s = Storage(str(run))
    published = read_manifest(s, L.outer_state(4))["digest"]
    for name in ("state_00004.safetensors", "state_00004.json"):  # a lost outer state: rebuilt from round 3's files
        (run / "outer" / name).unlink()
    assert main(["resume", str(run)]) == 0
    assert read_manifest(s, L.outer_state(4))["digest"] == published
    for name in ("record.json",):  # round 3 not committed after all: resume merges it again from what is kept
        (run / "rounds" / "00003" / name).unlink()
    assert main(["resume", str(run)]) == 0 and (run / "rounds" / "00003" / "record.json").exists()
    again = tmp_path / "replay"
    assert main(["submit", "--replay", str(run), "--run-dir", str(again), "--executor", "inline"]) == 0
    assert _bytes_of(again, 4, 2) == _bytes_of(run, 4, 2)  # every global, state and contribution, by digest


def test_retention_deletes_through_no_link(tmp_path):
    """A planted link where a round's folder or a contribution is: nothing outside the run is touched."""
    s = Storage(str(tmp_path / "run"))
    outside = tmp_path / "outside"
    (outside / "contrib").mkdir(parents=True)
    (outside / "contrib" / "worker_000.safetensors").write_bytes(b"theirs")
    (outside / "mine.safetensors").write_bytes(b"theirs too")
    (tmp_path / "run" / "rounds" / "00000").mkdir(parents=True)
    os.symlink(outside / "contrib", tmp_path / "run" / "rounds" / "00000" / "contrib")
    (tmp_path / "run" / "rounds" / "00001" / "contrib").mkdir(parents=True)
    os.symlink(outside / "mine.safetensors", tmp_path / "run" / "rounds" / "00001" / "contrib" / "worker_000.safetensors")
    prune(s, _cfg(keep_last=1), 5)
    assert (outside / "contrib" / "worker_000.safetensors").read_bytes() == b"theirs"
    assert (outside / "mine.safetensors").read_bytes() == b"theirs too"


def test_a_persistent_worker_writes_its_state_every_state_every_rounds(tmp_path, corpus_cache, caplog):
    """state_every 2 over rounds 0..4: snapshots after rounds 1 and 3 (one kept on storage); a job
    restarted after a hard loss (nothing flushed) takes the newest, round 3's, and its contribution's
    manifest and log say so."""
    s = _worker_run(tmp_path, corpus_cache, "run", rounds=6, round={"state_every": 2})
    carry = None
    for r in range(5):
        _, carry = train.serve_round(_task(s, r), 0.0, carry, persistent=True)
        carry.settle()
        _merge(s, r)
        states = sorted(n for n in s.list(L.worker_dir(0)) if n.endswith(".safetensors"))
        assert states == ([] if r < 1 else ["state_00001.safetensors"] if r < 3 else ["state_00003.safetensors"]), (r, states)
    with caplog.at_level("INFO"):
        train.run_worker(_task(s, 5))  # the persistent job died with its node after round 4
    assert read_manifest(s, L.contribution(5, 0))["state_from_round"] == 3
    assert "optimizer state from its snapshot of round 3" in caplog.text


def test_a_job_ending_before_the_run_writes_its_newest_state(tmp_path, corpus_cache):
    s = _worker_run(tmp_path, corpus_cache, "run", rounds=6, round={"state_every": 4})
    carry = None
    for r in range(2):
        _, carry = train.serve_round(_task(s, r), 0.0, carry, persistent=True)
        _merge(s, r)
    carry.settle()
    assert not [n for n in s.list(L.worker_dir(0)) if n.endswith(".safetensors")]  # in memory only
    carry.flush_state()  # handed over, cancelled, preempted between rounds
    assert sorted(n for n in s.list(L.worker_dir(0)) if n.endswith(".safetensors")) == ["state_00001.safetensors"]
