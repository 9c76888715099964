"""Replays (`orchestrate submit --replay RUN`, core/replay.py): the schedule's format and checks,
what cannot be replayed, and whole overlapped runs, with a slow worker, a killed merge service and
a dropped worker, replayed bit for bit on the local executor.

A replay follows the steps the source run recorded (steps per round, adoption steps, merge
order), so "the replay equals the run, byte for byte" also says the record is the truth: a step
lost or counted twice by the run (at a restart, a requeue, an adoption) and not recorded so would
make the bytes differ.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from core import replay
from core.checkpoint import load_checkpoint
from core.checkpoint_writer import write_checkpoint
from core.progress import human
from core.config import load_config
from core.errors import ConfigError, RunError
from core.layout import RunLayout
from core.storage import Storage
from orchestrator.cli import main

ROOT = Path(__file__).resolve().parent.parent
TINY = ["--executor", "local", "--set", "model.n_layer=1", "--set", "model.n_embd=32", "--set", "model.n_head=2",
        "--set", "model.block_size=32", "--set", "inner.batch_size=4", "--set", "inner.warmup_steps=2",
        "--set", "data.eval_batches=1", "--set", "round.poll_s=0.1"]
# three workers, so that the merge order matters; worker 1 slow; each trains ~1 s a round and
# trains ahead while its round is merged
OVERLAPPED = ["--workers", "3", "--rounds", "3", "--inner-steps", "5000", "--set", "round.budget=seconds",
              "--set", "round.budget_seconds=1.0"]


@st.composite
def schedules(draw):
    k, t, h = draw(st.integers(1, 4)), draw(st.integers(1, 4)), draw(st.integers(1, 50))
    steps = {(r, w): draw(st.integers(1, h)) for r in range(t) for w in range(k)}
    adopted = {(r, w): None if r == 0 else draw(st.none() | st.integers(0, steps[r, w])) for (r, w) in steps}
    order = {r: draw(st.permutations(range(k))) for r in range(t)}
    threads = draw(st.none() | st.integers(1, 64))
    return replay.Schedule("src", steps, adopted, order, threads), k, t, h


@settings(max_examples=50, deadline=None)
@given(schedules())
def test_a_schedule_reads_back_as_written(tmp_path_factory, drawn):
    schedule, k, t, h = drawn
    s = Storage(str(tmp_path_factory.mktemp("run")))
    schedule.save(s)
    assert replay.load(s, k, t, h) == schedule
    assert replay.check(schedule, k, t, h) == []


@pytest.mark.parametrize("change, says", [
    (lambda d: d["rounds"][1]["workers"]["0"].update(steps=0), "round 1 worker 0: 0 steps, not a whole number in [1"),
    (lambda d: d["rounds"][1]["workers"]["0"].update(steps=11), "11 steps"),
    (lambda d: d["rounds"][1]["workers"]["0"].update(steps="5"), "'5' steps"),
    (lambda d: d["rounds"][1]["workers"]["1"].update(adopted_at_step=6), "adopted its base at step 6, not a step in [0, 5]"),
    (lambda d: d["rounds"][0]["workers"]["1"].update(adopted_at_step=2), "no worker trains ahead into round 0"),
    (lambda d: d["rounds"][1].update(order=[0, 0]), "merge order [0, 0] is not an order of the 2 workers"),
    (lambda d: d["rounds"][1]["workers"].pop("1"), "no steps for (round, worker) [(1, 1)]"),
    (lambda d: d["rounds"].pop(), "it schedules rounds [0], not 0..1"),
    (lambda d: d.pop("rounds"), "is not a replay schedule islands wrote (KeyError"),
    (lambda d: d["rounds"][0].update(round=[1]), "is not a replay schedule islands wrote (TypeError"),
])
def test_a_damaged_schedule_is_refused_with_what_is_wrong(tmp_path, change, says):
    s = Storage(str(tmp_path))
    good = replay.Schedule("src", {(r, w): 5 for r in range(2) for w in range(2)},
                           {(0, 0): None, (0, 1): None, (1, 0): 3, (1, 1): None}, {0: [1, 0], 1: [0, 1]})
    raw = good.to_json()
    change(raw)
    s.write_json(RunLayout.REPLAY, raw)
    with pytest.raises(RunError) as exc:
        replay.load(s, 2, 2, 10)
    assert says in str(exc.value) and "replay.json" in str(exc.value)


def test_a_missing_or_unparsable_schedule_says_how_to_make_one(tmp_path):
    s = Storage(str(tmp_path))
    with pytest.raises(RunError, match="replay.json is missing.*orchestrate submit --replay RUN"):
        replay.load(s, 2, 2, 10)
    s.write_bytes(RunLayout.REPLAY, b"{not json")
    with pytest.raises(RunError, match="replay.json is not a replay schedule islands wrote \\(JSONDecodeError"):
        replay.load(s, 2, 2, 10)


def _contribution(s: Storage, r: int, w: int, manifest: dict) -> None:
    write_checkpoint(s, f"rounds/{r:05d}/contrib/worker_{w:03d}.safetensors", {"w": torch.ones(2)},
                     manifest={"round": r, "worker": w, **manifest})


def test_only_finished_runs_that_merged_every_worker_can_be_replayed(tmp_path, round_record):
    s = Storage(str(tmp_path))
    s.write_json("rounds/00000/record.json", round_record(0, merged=[0, 1], merge_order=[1, 0]))
    s.write_json("rounds/00001/record.json", round_record(1, merged=[0], merge_order=[0]))
    s.write_json("rounds/00002/record.json", round_record(2, merged=[0, 1], merge_order=[0, 1], folded=[{"key": "x"}]))
    for w in (0, 1):
        _contribution(s, 0, w, {"steps": 4 + w, "threads": 3})
    with pytest.raises(RunError) as exc:
        replay.from_run(s, workers=2, rounds=4, max_steps=10)
    msg = str(exc.value)
    assert "round 1 merged workers [0] and 0 late fold(s), not all 2 workers" in msg
    assert "round 2 merged workers [0, 1] and 1 late fold(s)" in msg
    assert "round 3 is not committed" in msg
    schedule = replay.from_run(s, workers=2, rounds=1, max_steps=10)
    assert schedule.steps == {(0, 0): 4, (0, 1): 5} and schedule.order == {0: [1, 0]} and schedule.threads == 3
    _contribution(s, 0, 1, {"steps": 40})  # a manifest the config could not have produced
    with pytest.raises(RunError, match="round 0 worker 1: 40 steps"):
        replay.from_run(s, workers=2, rounds=1, max_steps=10)
    _contribution(s, 0, 1, {"steps": 5, "overlap": {"adopted_at_step": "3"}})  # not what a worker writes
    with pytest.raises(RunError, match="overlap .* has adopted_at_step that is not an integer"):
        replay.from_run(s, workers=2, rounds=1, max_steps=10)
    _contribution(s, 0, 1, {"steps": 5, "overlap": {"adopted_at_step": 3, "ahead_s": 0.5}})
    with pytest.raises(RunError, match="round 0 worker 1: adopted at step 3, but no worker trains ahead into round 0"):
        replay.from_run(s, workers=2, rounds=1, max_steps=10)  # well-formed, and still checked against the run
    s.write_json("rounds/00000/record.json", round_record(0, merged=[0, 1], merge_order=["1", 0]))
    with pytest.raises(RunError, match=r"00000/record.json is not a record islands wrote: 'merge_order' is \['1', 0\], "
                                       r"not list\[int\]"):
        replay.from_run(s, workers=2, rounds=1, max_steps=10)


def test_a_replay_takes_only_where_it_runs_from_the_command_line(tmp_path, capsys):
    code = main(["submit", "--replay", str(tmp_path / "src"), "--workers", "3", "--set", "inner.lr=1e-3",
                 "--set", "executor.partition=debug"])
    out = capsys.readouterr().out
    assert code == 2 and "--workers: a replay takes its source run's config" in out and "--set inner.lr=1e-3" in out
    assert "executor.partition" not in out  # where it runs may change
    with pytest.raises(ConfigError, match="round.replay .* needs every worker in every round"):
        load_config(None, {"round.replay": "src"})


# -- whole runs ---------------------------------------------------------------------------------

def _bytes_of(run: Path, rounds: int, workers: int) -> dict[str, str]:
    """Digests of everything a run's maths produced: globals, outer states, contributions."""
    s = Storage(str(run))
    out = {f"global {r + 1}": s.read_json(f"global/round_{r + 1:05d}.json")["digest"] for r in range(rounds)}
    out |= {f"outer {r + 1}": s.read_json(f"outer/state_{r + 1:05d}.json")["digest"] for r in range(rounds)}
    out |= {f"round {r} worker {w}": s.read_json(f"rounds/{r:05d}/contrib/worker_{w:03d}.json")["digest"]
            for r in range(rounds) for w in range(workers)}
    out["final"] = s.read_json("final/model.json")["digest"]
    return out


def _manifests(run: Path, rounds: int, workers: int) -> list[list[dict]]:
    s = Storage(str(run))
    return [[s.read_json(f"rounds/{r:05d}/contrib/worker_{w:03d}.json") for w in range(workers)] for r in range(rounds)]


def _submit(run: Path, cache: str, *extra: str, env: dict | None = None, code: int = 0) -> str:
    """`orchestrate submit` in a process of its own (its workers inherit `env`), output in a file:
    persistent workers outlive a killed service and hold what they inherit."""
    out = run.parent / f"{run.name}.out"
    with open(out, "wb") as f:
        proc = subprocess.run([sys.executable, "-m", "orchestrator.cli", "submit", "--run-dir", str(run),
                               "--set", f"data.cache_dir={cache}", *extra], cwd=ROOT, env={**os.environ, **(env or {})},
                              stdout=f, stderr=subprocess.STDOUT, timeout=300)
    text = out.read_text()
    assert proc.returncode == code, text[-3000:]
    return text


def _replay_equals(src: Path, cache: str, rounds: int, workers: int) -> None:
    again = src.parent / "replay"
    # the replay's workers are threads of this process (orchestrator/inline.py): the same bytes as processes
    assert main(["submit", "--replay", str(src), "--run-dir", str(again), "--executor", "inline",
                 "--set", "executor.timeout_min=30"]) == 0
    assert _bytes_of(again, rounds, workers) == _bytes_of(src, rounds, workers)
    got = [[(m["steps"], (m.get("overlap") or {}).get("adopted_at_step")) for m in ms] for ms in _manifests(again, rounds, workers)]
    want = [[(m["steps"], (m.get("overlap") or {}).get("adopted_at_step")) for m in ms] for ms in _manifests(src, rounds, workers)]
    assert got == want
    assert json.loads((again / "replay.json").read_text())["source"] == str(src)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["rebase", "mix"])
def test_an_overlapped_run_with_a_slow_worker_is_replayed_bit_for_bit(tmp_path, corpus_cache, mode):
    """Time budget + overlap, worker 1 slower per step (a slowpoint): how many steps each worker
    trains, and where each adopts its global, is timing; the replay repeats it exactly."""
    src = tmp_path / "run"
    _submit(src, corpus_cache, *TINY, *OVERLAPPED, "--set", f"round.overlap={mode}", "--executor", "inline",
            env={"ISLANDS_SLOWPOINT": "worker_001.step=0.05"})  # slower however loaded the machine
    manifests = _manifests(src, 3, 3)
    adopted = [m["overlap"]["adopted_at_step"] for ms in manifests[1:] for m in ms if "overlap" in m]
    assert adopted and any(0 < a < m["steps"] for ms in manifests[1:] for m in ms
                           for a in [(m.get("overlap") or {}).get("adopted_at_step")] if a is not None), manifests
    assert all(ms[1]["steps"] < ms[0]["steps"] for ms in manifests)  # the slow worker trains fewer steps
    _replay_equals(src, corpus_cache, 3, 3)


@pytest.mark.slow
def test_an_overlapped_run_whose_service_was_killed_is_replayed_bit_for_bit(tmp_path, corpus_cache):
    """The merge service dies right after committing round 0 (a failpoint: os._exit) while the
    persistent workers train ahead; `resume` finishes the run. Its replay, which knows nothing of
    the kill, equals it: no step was lost or counted twice across the restart."""
    src = tmp_path / "run"
    _submit(src, corpus_cache, *TINY, *OVERLAPPED, "--set", "round.overlap=rebase",
            env={"ISLANDS_FAILPOINT": "service.after_record"}, code=137)
    s = Storage(str(src))
    assert s.exists("rounds/00000/record.json") and not s.exists("rounds/00001/record.json")
    assert main(["resume", str(src)]) == 0
    assert all(s.read_json(f"rounds/{r:05d}/record.json")["merged"] == [0, 1, 2] for r in range(3))
    _replay_equals(src, corpus_cache, 3, 3)


@pytest.mark.slow
def test_an_overlapped_run_goes_on_without_a_dropped_worker(tmp_path, corpus_cache, capsys):
    """Worker 2 is a straggler every round (it sleeps 8 s before publishing: a loaded machine can
    start worker 1 seconds after it); with a quorum of 2 and a 1 s deadline each round is merged
    without it, and it trains on from its own weights (late policy continue). The others train
    ahead and adopt every global; every contribution that is merged names its round's global as
    its base, and the run is never replayable (a drop)."""
    src = tmp_path / "run"
    _submit(src, corpus_cache, *TINY, *OVERLAPPED, "--set", "round.overlap=rebase", "--set", "round.min_workers=2",
            "--set", "round.deadline_s=1.0", env={"ISLANDS_SLOWPOINT": "worker_002.publish=8"})
    s = Storage(str(src))
    records = [s.read_json(f"rounds/{r:05d}/record.json") for r in range(3)]
    assert all(rec["merged"] == [0, 1] and rec["dropped"] == [2] for rec in records), records
    for r in range(3):
        for w in (0, 1):
            m = s.read_json(f"rounds/{r:05d}/contrib/worker_{w:03d}.json")
            assert m["base"] == f"global/round_{r:05d}.safetensors" and m["steps"] >= 1
            assert (r == 0) == ("overlap" not in m)
    capsys.readouterr()
    assert main(["status", str(src), "--json"]) == 0
    status = json.loads(capsys.readouterr().out)
    assert status["state"] == "done" and status["rounds"][-1]["eval_loss"] < status["initial_eval_loss"]
    assert main(["submit", "--replay", str(src), "--run-dir", str(tmp_path / "again")]) == 2
    assert "round 0 merged workers [0, 1] and 0 late fold(s), not all 3 workers" in capsys.readouterr().out
    assert not (tmp_path / "again").exists()  # refused before anything was made


@pytest.mark.slow
def test_a_run_on_a_prepared_dataset_is_replayed_bit_for_bit(tmp_path, corpus_cache):
    """Workers read a prepared dataset's shards by position (non-iid shares by a record field): what
    each reads is a pure function of (dataset, seed, worker, step), so a replay (its workers threads of this process)
    publishes every global of its source bit for bit."""
    rows = [{"text": f"record {i}: " + " ".join(str(i * j % 97) for j in range(60)), "source": f"s{i % 3}"} for i in range(300)]
    (tmp_path / "c.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["data", "prepare", str(tmp_path / "c.jsonl"), "--out", str(tmp_path / "ds"), "--group-field", "source"]) == 0
    src = tmp_path / "run"
    _submit(src, corpus_cache, *TINY, "--workers", "2", "--rounds", "2", "--inner-steps", "4", "--executor", "inline",
            "--set", f"data.source={tmp_path / 'ds'}", "--set", "data.sharding=non-iid")
    _replay_equals(src, corpus_cache, 2, 2)


@pytest.mark.slow
def test_a_topk_run_whose_service_was_killed_is_replayed_bit_for_bit(tmp_path, corpus_cache, capsys):
    """Top-k contributions with error feedback (round.codec topk): each persistent worker carries
    its buffer in memory and writes it with its AdamW state. The service dies after round 0's
    commit and `resume` finishes the run; the replay (its workers threads of this process) publishes every global of
    its source bit for bit, so the buffers were neither lost nor applied twice."""
    src = tmp_path / "run"
    _submit(src, corpus_cache, *TINY, "--workers", "3", "--rounds", "3", "--inner-steps", "4",
            "--set", "round.contribution=delta", "--set", "round.codec=topk", "--set", "round.bits=4",
            "--set", "round.state_every=1",  # a snapshot every round: the buffer is checked in round 2's
            env={"ISLANDS_FAILPOINT": "service.after_record"}, code=137)
    assert main(["resume", str(src)]) == 0
    s = Storage(str(src))
    state = load_checkpoint(s, RunLayout().worker_state(1, 2))[0]
    assert any(k.startswith("error_feedback/") and t.abs().sum() > 0 for k, t in state.items())
    m = s.read_json("rounds/00002/contrib/worker_001.json")
    assert m["contribution"]["codec"] == "topk" and m["fp32_bytes"] > 20 * m["bytes"]
    capsys.readouterr()
    assert main(["status", str(src), "--json"]) == 0
    last = json.loads(capsys.readouterr().out)["rounds"][-1]
    assert last["contribution_bytes"]["1"] == m["bytes"] and last["fp32_bytes"] == m["fp32_bytes"]
    assert main(["status", str(src)]) == 0
    ratio = m["fp32_bytes"] / (sum(last["contribution_bytes"].values()) / 3)
    out = capsys.readouterr().out
    assert f"per worker-round (round 2), 1/{ratio:.0f} of the weights in fp32" in out
    read, replayed = sum(last["worker_read"].values()) / 3, len(last["replayed"])
    line = rf"worker I/O per worker-round \(round 2\): read {re.escape(human(read))}B \(\d+\.\d\d of the weights in fp32\), "
    said = " ".join(out.split())  # the line wraps at the terminal's width
    assert re.search(line + r"wrote \S+B \(\d+\.\d\d\)" + (f"; {replayed}/3 bases replayed" if replayed else ""), said), out
    from orchestrator.observe.metrics import read_metrics
    from orchestrator.runstate import load_run
    workers = [ln for ln in read_metrics(s, load_run(s)) if ln["kind"] == "worker" and ln["round"] == 2]
    assert {(ln["codec"], ln["fp32_bytes"]) for ln in workers} == {("topk", m["fp32_bytes"])}
    _replay_equals(src, corpus_cache, 3, 3)
