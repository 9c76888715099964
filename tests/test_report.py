"""Seeing a run: metrics lines, `orchestrate report` and `orchestrate eval` (docs/observability.md)."""
from __future__ import annotations

import base64
import contextlib
import io
import json
import math
import re
import stat
import sys
from pathlib import Path

import pytest
import torch

from core.checkpoint_writer import write_checkpoint
from core.errors import RunError, StorageError
from core.layout import RunLayout
from core.storage import Storage
from orchestrator.observe.checkpoint_eval import ensemble_losses, evaluate_checkpoints, nll
from orchestrator.cli import main
from orchestrator.observe.metrics import FIELDS, parse_jsonl, read_metrics, tensorboard_scalars, to_jsonl
from orchestrator.observe.report import FIGURES, stats_cache, write_report
from orchestrator.observe.report_data import (contribution_size, outer_grad_stats, outer_stats_cached, time_budget, timeline,
                                              worker_io, worker_utilization)
from orchestrator.runstate import load_run
from terminal_support import in_a_terminal

L = RunLayout()
ROOT = Path(__file__).resolve().parent.parent
PNG = b"\x89PNG\r\n\x1a\n"
slow = pytest.mark.slow  # the tests that read the tiny run (one ~20 s run per session)
TINY = ["--set", "model.n_layer=1", "--set", "model.n_embd=16", "--set", "model.n_head=2",
        "--set", "model.block_size=16", "--set", "inner.batch_size=2", "--set", "data.eval_batches=2",
        "--set", "round.poll_s=0.2"]


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory, corpus_cache) -> Path:
    """One real 2-worker x 2-round run for the whole module (local executor, a tiny model)."""
    run = tmp_path_factory.mktemp("obs") / "run"
    argv = ["submit", "--executor", "local", "--run-dir", str(run), "--workers", "2", "--rounds", "2",
            "--inner-steps", "3", "--set", f"data.cache_dir={corpus_cache}", *TINY,
            "--set", "round.keep_last=0"]  # every round's tensors kept: the tests read old globals and their statistics
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):  # what the user saw: its round lines (test_one_round_time...)
        assert main(argv) == 0
    (run.parent / "submit.txt").write_text(printed.getvalue())
    return run


def as_if_a_service_held_it(storage: Storage) -> None:
    """lock.json as a live merge service writes it (this process, beating now): a run in progress."""
    import os
    import socket
    import time
    storage.write_json(L.LOCK, {"pid": os.getpid(), "host": socket.gethostname(), "epoch": 0, "heartbeat_at": time.time()})


def _pngs_ok(result: dict, out: Path) -> str:
    html = (out / "report.html").read_text()
    assert [Path(p).stem for p in result["images"]] == list(FIGURES)
    for p in result["images"]:
        data = Path(p).read_bytes()
        assert data.startswith(PNG) and len(data) > 5000, p
        assert base64.b64encode(data).decode() in html, f"{p} is not embedded in the page"
    assert "<img" in html and "src='data:image/png;base64," in html and "src='http" not in html
    return html


# -- the report ---------------------------------------------------------------------------------
@slow
def test_report_of_a_finished_run(tiny_run, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("ISLANDS_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "report"
    assert main(["report", str(tiny_run), "--out", str(out)]) == 0
    assert "2 rounds committed" in capsys.readouterr().out
    result = write_report(Storage(str(tiny_run)), out)  # again: outer-gradient stats come from the cache
    html = _pngs_ok(result, out)
    assert result["state"] == "done" and result["rounds"] == 2 and result["problems"] == []
    assert "Round in progress" not in html and "<tr><td>0</td>" in html and "<tr><td>1</td>" in html  # rounds from 0
    assert sorted(p.name for p in out.iterdir()) == sorted(["report.html", "metrics.jsonl", *(f"{f}.png" for f in FIGURES)])
    cache = json.loads(stats_cache(Storage(str(tiny_run))).read_text())  # this machine's cache, not --out's
    assert stats_cache(Storage(str(tiny_run))).is_relative_to(tmp_path / "cache")
    assert sorted(cache) == ["0", "1"] and all(len(c["norms"]) == 2 for c in cache.values())
    # the merge's own outer-gradient norm (token-weighted mean) is what the streamed Gram matrix gives
    rounds = [ln for ln in read_metrics(Storage(str(tiny_run)), load_run(Storage(str(tiny_run)))) if ln["kind"] == "round"]
    for line in rounds:
        assert cache[str(line["round"])]["mean_grad_norm"] == pytest.approx(line["outer_grad_norm"], rel=1e-4)


@slow
def test_report_of_a_run_in_progress_on_memory_storage(tiny_run, tmp_path):
    mem = Storage(f"memory://obs-{tmp_path.name}")
    mem.fs.put(str(tiny_run), mem.root, recursive=True)
    for key in (L.round_record(1), L.round_metrics(1), L.FINAL, "final/model.json", L.global_weights(2),
                "global/round_00002.json", L.contribution(1, 1), "rounds/00001/contrib/worker_001.json"):
        mem.remove(key)  # round 2 not committed yet, worker 1 still training
    as_if_a_service_held_it(mem)
    try:
        out = tmp_path / "report"
        result = write_report(mem, out)
        html = _pngs_ok(result, out)
        assert result["state"] == "running" and result["rounds"] == 1
        assert "Round in progress" in html and "in flight" in html and "published" in html
        # eval of a run without its final model yet takes its latest global model, and says so
        row = evaluate_checkpoints([mem.url], batches=1)["models"][0]
        assert row["checkpoint"].endswith("(global/round_00001.safetensors)")
    finally:
        mem.fs.rm(mem.root, recursive=True)


def test_report_refuses_a_directory_that_is_not_a_run(tmp_path, capsys):
    with pytest.raises(RunError, match="is not a run directory"):
        write_report(Storage(str(tmp_path)), tmp_path / "out")
    assert main(["report", str(tmp_path), "--out", str(tmp_path / "out")]) == 2
    assert "not a run directory (no config.yaml)" in capsys.readouterr().out


# -- outer gradients against a direct computation -------------------------------------------------
def test_outer_gradient_norms_and_cosines_match_torch(storage, tmp_path):
    # Prepare: a global model and three hand-made contributions to round 0
    g = torch.Generator().manual_seed(0)
    glob = {"a": torch.randn(4, 3, generator=g), "b": torch.randn(5, generator=g)}
    contribs = [{k: v + torch.randn(v.shape, generator=g) * s for k, v in glob.items()} for s in (0.1, 0.5, 1.0)]
    write_checkpoint(storage, L.global_weights(0), glob, manifest={"round": 0})
    for w, c in enumerate(contribs):
        write_checkpoint(storage, L.contribution(0, w), c, manifest={"round": 0, "worker": w})
    # Execute
    stats = outer_grad_stats(storage, 0, [0, 1, 2], [1.0, 1.0, 2.0])
    # Assert: against flattened outer gradients computed directly
    flat = [torch.cat([(glob[k] - c[k]).reshape(-1) for k in sorted(glob)]).double() for c in contribs]
    assert stats["norms"] == pytest.approx([float(f.norm()) for f in flat], rel=1e-6)
    for i in range(3):
        for j in range(3):
            want = float(torch.nn.functional.cosine_similarity(flat[i], flat[j], dim=0))
            assert stats["cosine"][i][j] == pytest.approx(want, abs=1e-6)
    assert len(stats["pairwise"]) == 3
    mean = (flat[0] + flat[1] + 2 * flat[2]) / 4
    assert stats["mean_grad_norm"] == pytest.approx(float(mean.norm()), rel=1e-6)
    # cached by the round's commit: a second pass reads no checkpoint; another commit does
    line = {"round": 0, "merged": [0, 1, 2], "weights": {"0": 1.0, "1": 1.0, "2": 2.0}, "committed_at": 5.0}
    first = outer_stats_cached(storage, [line], tmp_path / "cache.json")
    assert first[0]["mean_grad_norm"] == pytest.approx(stats["mean_grad_norm"])
    storage.remove(L.contribution(0, 2))
    assert outer_stats_cached(storage, [line], tmp_path / "cache.json") == first
    again = outer_stats_cached(storage, [{**line, "committed_at": 6.0}], tmp_path / "cache.json")
    assert "checkpoint file is missing" in again[0]["error"]


# -- the timeline, pure ---------------------------------------------------------------------------
def test_timeline_uses_scheduler_timings_then_the_workers_clock():
    rounds = [{"round": 0, "merge_started_at": 110.0, "committed_at": 112.0, "evaluated_at": 115.0, "round_seconds": 12.0}]
    workers = [
        {"round": 0, "worker": 0, "submitted_at": 100.0, "queue_wait_s": 2.0, "run_s": 5.0, "written_at": 108.0, "seconds": 1.0},
        {"round": 0, "worker": 1, "submitted_at": 100.0, "queue_wait_s": None, "run_s": None, "written_at": 109.0, "seconds": 4.0},
        {"round": 0, "worker": 2, "submitted_at": 100.0, "queue_wait_s": None, "run_s": None, "written_at": None, "seconds": None},
    ]
    segs = {(s.row, s.kind): (s.start, s.end) for s in timeline(rounds, workers, None, now=200.0)}
    assert segs[("worker 0", "queued")] == (100.0, 102.0) and segs[("worker 0", "running")] == (102.0, 107.0)
    assert segs[("worker 1", "queued")] == (100.0, 105.0) and segs[("worker 1", "running")] == (105.0, 109.0)
    assert ("worker 1", "starting") not in segs  # no queue wait from the scheduler: all of the wait is queued
    assert segs[("worker 2", "no contribution")] == (100.0, 110.0)
    assert segs[("merge service", "merging")] == (110.0, 112.0)
    assert segs[("merge service", "evaluating")] == (112.0, 115.0)
    budget = time_budget(timeline(rounds, workers, None, 200.0), rounds)
    assert budget == [{"round": 0, "wall_s": 12.0, "queued": 7.0, "starting": None, "running": 9.0, "merging": 2.0,
                       "evaluating": 3.0, "no contribution": 10.0}]


def test_a_persistent_jobs_start_up_is_starting_not_queued():
    """A local persistent job: the scheduler says it queued 0 s (`status --json`'s queue_wait_s), its
    first step came 12 s after the submission (a process starting, loading its base): the report says
    queued 0 s and starting 12 s; in its next round, handed its global at 120, it queues no more."""
    job = {"worker": 0, "job_id": "4711", "persistent": True, "queue_wait_s": 0.0, "run_s": 40.0}
    workers = [{**job, "round": 0, "submitted_at": 100.0, "written_at": 118.0, "seconds": 6.0},
               {**job, "round": 1, "submitted_at": 120.0, "written_at": 127.0, "seconds": 5.0}]
    segs = {(s.round, s.kind): (s.start, s.end) for s in timeline([], workers, None, now=200.0)}
    assert (0, "queued") not in segs and segs[(0, "starting")] == (100.0, 112.0) and segs[(0, "running")] == (112.0, 118.0)
    assert (1, "queued") not in segs and segs[(1, "starting")] == (120.0, 122.0) and segs[(1, "running")] == (122.0, 127.0)


def test_timeline_shows_training_ahead_and_each_persistent_workers_utilization():
    """round.overlap: worker 0 trained 3 s of round 1 before the round was submitted (at 110) and
    published at 114 after 6 s in all; it waited 1 s before round 0 and 0 s before round 1."""
    workers = [
        {"round": 0, "worker": 0, "submitted_at": 100.0, "written_at": 108.0, "seconds": 6.0, "waited_s": 1.0},
        {"round": 1, "worker": 0, "submitted_at": 110.0, "written_at": 114.0, "seconds": 6.0, "waited_s": 0.0,
         "ahead_s": 3.0},
        {"round": 1, "worker": 1, "submitted_at": 110.0, "written_at": 115.0, "seconds": 4.0},  # per-round job
    ]
    segs = {(s.row, s.kind, s.round): (s.start, s.end) for s in timeline([], workers, None, now=200.0)}
    assert segs[("worker 0", "training ahead", 1)] == (108.0, 111.0) and segs[("worker 0", "running", 1)] == (111.0, 114.0)
    assert segs[("worker 0", "running", 0)] == (102.0, 108.0) and ("worker 0", "training ahead", 0) not in segs
    assert worker_utilization(workers) == {0: 12.0 / 13.0}  # worker 1 keeps no idle time: not measured


# -- metrics --------------------------------------------------------------------------------------
@slow
def test_a_contributions_size_is_the_last_merged_rounds_mean_beside_its_fp32_bytes():
    w = lambda r, b, merged=True, fp32=4000: {"round": r, "bytes": b, "merged": merged, "fp32_bytes": fp32}  # noqa: E731
    assert contribution_size([w(0, 90), w(1, 40), w(1, 60), w(1, 999, merged=False), w(2, 0)]) == (50.0, 4000)
    assert contribution_size([w(0, 40, fp32=None)]) == (40.0, None) and contribution_size([w(0, 5, merged=False)]) is None


def test_worker_io_is_the_last_merged_rounds_mean_and_its_replayed_bases():
    w = lambda r, rd, wr, rep, merged=True: {"round": r, "merged": merged, "io_read": rd, "io_written": wr,  # noqa: E731
                                             "replica": rep, "fp32_bytes": 1000}
    assert worker_io([w(0, 900, 10, False), w(1, 60, 30, True), w(1, 40, 10, False), w(1, 999, 9, True, merged=False),
                      {"round": 2, "merged": True}]) == (50.0, 20.0, 1000, 1, 2)
    assert worker_io([w(0, 1.5, 10, True)]) is None and worker_io([]) is None


def test_a_workers_byte_counts_are_taken_only_when_they_are_counts():
    from orchestrator.round_merge import _count
    assert _count({"bytes": 25662}, "bytes") == 25662
    assert [_count({"fp32_bytes": v}, "fp32_bytes") for v in ("1e9", -1, 1.5, True, 1 << 70, None)] == [None] * 6


def test_metrics_written_by_the_service_round_trip(tiny_run):
    s = Storage(str(tiny_run))
    assert s.list(L.METRICS) == ["round_00000.jsonl", "round_00001.jsonl"]
    lines = read_metrics(s, load_run(s))
    kinds = [ln["kind"] for ln in lines]
    assert kinds.count("run") == 1 and kinds.count("round") == 2 and kinds.count("worker") == 4
    assert kinds.count("step") == 2 * 2 * 3
    for ln in lines:
        assert set(ln) == set(FIELDS[ln["kind"]]), ln["kind"]
    rounds = [ln for ln in lines if ln["kind"] == "round"]
    assert [r["step"] for r in rounds] == [3, 6] and all(r["evaluated_at"] >= r["committed_at"] for r in rounds)
    assert rounds[-1]["eval_loss"] == s.read_json(L.round_record(1))["eval_loss"]
    assert parse_jsonl(to_jsonl(lines), "x") == lines
    assert all(tensorboard_scalars(ln) for ln in lines if ln["kind"] != "worker")


def test_metrics_schema_is_strict_and_documented():
    line = {"kind": "step", "schema": 1, "round": 0, "worker": 1, "step": 3, "loss": float("nan")}
    assert parse_jsonl(to_jsonl([line]), "x")[0]["loss"] is None  # strict JSON: a diverged loss is null
    with pytest.raises(StorageError, match="m.jsonl line 2"):
        parse_jsonl(to_jsonl([line]) + b'{"kind": "bogus", "schema": 1}\n', "m.jsonl")
    doc = (ROOT / "docs" / "observability.md").read_text()
    missing = [f"{k}.{f}" for k, fields in FIELDS.items() for f in fields if f"`{f}`" not in doc]
    assert not missing, f"docs/observability.md does not describe {missing}"


@slow
def test_missing_metrics_file_is_derived_from_the_record(tiny_run, tmp_path):
    mem = Storage(f"memory://obs-derive-{tmp_path.name}")
    mem.fs.put(str(tiny_run), mem.root, recursive=True)
    try:
        written = read_metrics(mem, load_run(mem))
        mem.remove(L.round_metrics(1))
        derived = read_metrics(mem, load_run(mem))
        strip = lambda lines: [{k: v for k, v in ln.items() if k not in ("t", "evaluated_at", "bytes_worker_states")}
                               for ln in lines]  # noqa: E731
        assert strip(derived) == strip(written)
    finally:
        mem.fs.rm(mem.root, recursive=True)


@slow
def test_tensorboard_events_when_available(tiny_run, tmp_path):
    pytest.importorskip("torch.utils.tensorboard")
    from orchestrator.observe.metrics import write_tensorboard
    s = Storage(str(tmp_path))
    assert write_tensorboard(s, read_metrics(Storage(str(tiny_run)), load_run(Storage(str(tiny_run)))))
    events_files = [p for p in (tmp_path / L.TENSORBOARD).iterdir() if p.name.startswith("events.out.tfevents")]
    assert events_files and all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in events_files)
    assert stat.S_IMODE((tmp_path / L.TENSORBOARD).stat().st_mode) == 0o700
    # read the events back with tensorboard's own reader: the eval losses are the run's, round by round
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(tmp_path / L.TENSORBOARD))
    events.Reload()
    expected = [ln["eval_loss"] for ln in read_metrics(Storage(str(tiny_run)), load_run(Storage(str(tiny_run))))
                if ln["kind"] in ("run", "round")]
    got = [e.value for e in events.Scalars("eval_loss")]
    assert got == pytest.approx(expected, rel=1e-6) and len(got) >= 2
    assert "round/outer_grad_norm" in events.Tags()["scalars"]


@slow
def test_resume_of_a_finished_run_says_it_is_already_done(tiny_run, tmp_path, capsys):
    """Nothing to resume: the service only checks what the run keeps (it would rebuild a lost outer
    state: tests/test_round_footprint.py), and the last line says the run was already done, in its unit."""
    import shutil
    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)
    assert main(["resume", str(run)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "(it is done: checking what it keeps)" in out and "done in" not in out, out
    assert "already done: " in out and "rounds, final eval loss (nats/byte) " in out
    assert f"final model: {run / L.FINAL}" in out


# -- eval -------------------------------------------------------------------------------------------
@slow
def test_eval_identical_checkpoints_and_their_ensemble(tiny_run, capsys):
    final = str(tiny_run / L.FINAL)
    assert main(["eval", str(tiny_run), final, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    a, b = result["models"]
    assert a["loss"] == b["loss"] and a["perplexity"] == pytest.approx(math.exp(a["loss"]), rel=1e-4)
    assert result["data"]["loss_per"] == "byte" and a["bits_per_byte"] == pytest.approx(a["loss"] / math.log(2), rel=1e-4)
    assert result["ensemble"]["loss"] == pytest.approx(a["loss"], abs=1e-9)  # two copies of one model
    record = Storage(str(tiny_run)).read_json(L.round_record(1))
    assert a["loss"] == pytest.approx(record["eval_loss"], abs=1e-4)  # the merge service's own batches
    one = evaluate_checkpoints([final], batches=1)
    assert one["ensemble"] is None and one["data"]["batches"] == 1


@slow
def test_eval_of_different_models_and_the_ensemble_of_one(tiny_run, capsys):
    from worker.weights import load_model
    models = [load_model(str(tiny_run / L.global_weights(r))) for r in (0, 2)]
    x = torch.randint(0, 256, (2, 8))
    batches = [(x, torch.roll(x, -1, 1))]
    singles, mixed = ensemble_losses(models[:1], batches)
    assert mixed == singles[0]
    assert singles[0] == pytest.approx(models[0](*batches[0])[1].item(), rel=1e-5)  # as the service's eval computes it
    singles, mixed = ensemble_losses(models, batches)
    assert mixed <= sum(singles) / 2 + 1e-9  # Jensen: mixing probabilities never hurts on average
    assert mixed <= min(singles) + math.log(2) + 1e-9  # and costs at most log K against the best model
    lp = torch.log_softmax(torch.randn(1, 2, 5), -1)
    assert nll([lp, lp], torch.tensor([[1, 3]])) == pytest.approx(nll([lp], torch.tensor([[1, 3]])))
    # a contribution carries no model description: its run's config rebuilds the model
    contrib = str(tiny_run / L.contribution(1, 0))
    assert main(["eval", contrib, str(tiny_run)]) == 0
    out = capsys.readouterr().out
    assert "ensemble of 2" in out and "worker_000.safetensors" in out


@slow
def test_eval_of_a_manual_merge_of_the_runs_own_contributions_takes_the_model_from_run(tiny_run, tmp_path, capsys):
    merged = str(tmp_path / "soup.safetensors")  # outside the run: only --run says which model it is
    assert main(["merge", *(str(tiny_run / L.contribution(1, w)) for w in (0, 1)), "--out", merged]) == 0
    assert main(["eval", merged, "--json"]) == 2  # nothing names the model: refused, with the fix
    assert "carries no model description" in capsys.readouterr().out
    assert main(["eval", merged, "--run", str(tiny_run), "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["data"]["config"].endswith("config.yaml") and 0 < got["models"][0]["loss"] < 6


def test_eval_refuses_what_is_not_a_checkpoint(tmp_path, capsys):
    with pytest.raises(RunError, match="neither a run directory"):
        evaluate_checkpoints([str(tmp_path)])
    (tmp_path / "notes.txt").write_text("not a model")  # there, but neither (a missing path: test_first_hour.py)
    assert main(["eval", str(tmp_path / "notes.txt")]) == 2
    assert "neither a run directory (no config.yaml) nor a checkpoint file" in capsys.readouterr().out


# -- damaged or planted records (#40): status and report read them through checked views ----------
@slow
@pytest.mark.parametrize("damage", [
    {"merged": 3, "dropped": "all", "rejected": None},
    {"eval_loss": "low", "merge_seconds": None, "bytes_read": None, "submitted_at": "x"},
    {"rejected_reasons": {"1": "\x1b]0;pwned\x07\x1b[2Jbad file"}, "jobs": {"0": {"job_id": "\x1b[31m7", "run_s": "x"}},
     "worker_train_s": {"0": "busy"}, "worker_idle_s": [1]},
    [1, 2, 3],
])
def test_status_shows_a_damaged_record_without_a_traceback_or_raw_escapes(tiny_run, tmp_path, capsys, damage):
    import shutil
    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)
    rec = json.loads((run / "rounds/00000/record.json").read_text())
    (run / "rounds/00000/record.json").write_text(json.dumps({**rec, **damage} if isinstance(damage, dict) else damage))
    (run / "failed.json").write_text(json.dumps("\x1b[2J a string"))
    (run / "run.json").write_text(json.dumps({"initial_eval_loss": "\x1b]0;pwned\x07", "params": [1]}))
    capsys.readouterr()
    for args in (["status", str(run)], ["status", str(run), "--json"]):
        assert main(args) == 0
        out = capsys.readouterr().out
        assert "\x1b" not in out and "\x07" not in out and "Traceback" not in out
    st = json.loads(out)
    assert st["failure"]["reason"].startswith("failed.json is not a record") and st["rounds"][1]["merged"] == [0, 1]
    assert "rounds/00000/record.json is not a record islands wrote" in st["rounds"][0]["damaged"]  # one checked loader
    assert st["initial_eval_loss"] is None  # run.json too: core/records.py RunInfo


@slow
def test_a_planted_metrics_line_is_one_clear_error_in_the_report(tiny_run, tmp_path, capsys):
    import shutil
    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)
    path = run / "metrics" / "round_00000.jsonl"
    lines = path.read_text().splitlines()
    first = json.loads(lines[-1])
    path.write_text("\n".join(lines + [json.dumps({**first, "round": "<script>alert(1)</script>"})]) + "\n")
    assert main(["report", str(run), "--out", str(tmp_path / "report")]) == 2
    out = capsys.readouterr().out
    assert "round_00000.jsonl line" in out and "not a whole number" in out and "Traceback" not in out
    assert not (tmp_path / "report" / "report.html").exists()


@slow
def test_tensorboard_files_are_private_and_never_written_through_a_link(tiny_run, tmp_path):
    pytest.importorskip("torch.utils.tensorboard")
    import os
    import stat

    from orchestrator.observe.metrics import write_tensorboard
    lines = read_metrics(Storage(str(tiny_run)), load_run(Storage(str(tiny_run))))
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    assert write_tensorboard(Storage(str(run)), lines)
    assert stat.S_IMODE(os.stat(run / L.TENSORBOARD).st_mode) == 0o700
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in (run / L.TENSORBOARD).iterdir())
    linked = tmp_path / "linked"
    linked.mkdir(mode=0o700)
    (tmp_path / "outside").mkdir()
    os.symlink(tmp_path / "outside", linked / L.TENSORBOARD)
    assert not write_tensorboard(Storage(str(linked)), lines)  # a dashboard is never worth a write outside
    assert list((tmp_path / "outside").iterdir()) == []


def test_a_run_is_done_only_once_its_final_model_is_written(tiny_run, tmp_path, capsys):
    """Every round committed is not the end: the service then evaluates the last round and exports
    the final model, and `status` says `finishing` meanwhile (not `done` with no final model, which
    ended `status --watch` on that frame), `done` once run.json records the finish."""
    import shutil
    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)
    info = json.loads((run / "run.json").read_text())
    assert info["finished_at"] is not None and main(["status", str(run), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["state"] == "done"
    (run / "run.json").write_text(json.dumps({**info, "finished_at": None}))  # the service is exporting
    (run / "final" / "model.safetensors").unlink()
    (run / "final" / "model.json").unlink()
    as_if_a_service_held_it(Storage(str(run)))
    assert main(["status", str(run), "--json"]) == 0
    st = json.loads(capsys.readouterr().out)
    assert st["state"] == "finishing" and st["rounds_done"] == 2 and st["final_model"] is None
    (run / L.LOCK).unlink()  # the service died exporting: nothing holds the run now
    assert main(["status", str(run), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["state"] == "stopped"
    assert main(["resume", str(run)]) == 0  # resume finishes the run
    capsys.readouterr()
    assert main(["status", str(run), "--json"]) == 0
    st = json.loads(capsys.readouterr().out)
    assert st["state"] == "done" and st["final_model"].endswith("final/model.safetensors")


def test_status_watch_takes_its_flag_before_or_after_the_run(tiny_run, capsys):
    from orchestrator.cli import _watch_before_run
    assert _watch_before_run(["status", "--watch", "runs/r1"]) == ["status", "--watch=2.0", "runs/r1"]
    assert _watch_before_run(["status", "--watch", "5", "runs/r1"]) == ["status", "--watch", "5", "runs/r1"]
    assert _watch_before_run(["status", "runs/r1", "--watch"]) == ["status", "runs/r1", "--watch"]
    for args in (["status", "--watch", str(tiny_run)], ["status", str(tiny_run), "--watch"]):
        assert main(args) == 0  # a finished run: one frame, then back
        assert "2/2 rounds done" in " ".join(capsys.readouterr().out.split())  # a long tmp path wraps the line


def test_a_finished_local_run_leaves_no_empty_job_folder_and_status_shows_no_none(tiny_run, tmp_path, capsys):
    """submitit's local jobs each make `jobs/%j` (the pattern, literally): removed once the run is
    over. A run.json without the initial loss shows it as `-` in `status`, not `None`."""
    import shutil
    assert not (tiny_run / "jobs" / "%j").exists() and any((tiny_run / "jobs").iterdir())
    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)
    info = json.loads((run / "run.json").read_text())
    (run / "run.json").write_text(json.dumps({**info, "initial_eval_loss": None}))
    assert main(["status", str(run)]) == 0
    out = capsys.readouterr().out
    assert "initial eval loss (nats/byte) -" in " ".join(out.split()) and "None" not in out


def test_status_of_a_run_in_progress_fits_80_columns_and_says_how_jobs_ended(tiny_run, tmp_path_factory):
    """The real command, as a pipe gives it 80 columns: the rounds' table, then the round in progress
    in a table of its own (a worker's job, state and step under their own headings), then how the
    merged rounds' jobs ended, the one that did not complete by name."""
    import shutil
    run = tmp_path_factory.mktemp("st") / "run"  # a short path: the first line holds it whole in 80 columns
    shutil.copytree(tiny_run, run)
    for p in (run / "rounds/00001/record.json", run / "final"):
        shutil.rmtree(p) if p.is_dir() else p.unlink()
    (run / "run.json").write_text(json.dumps({**json.loads((run / "run.json").read_text()), "finished_at": None}))
    rec = json.loads((run / "rounds/00000/record.json").read_text())
    rec["jobs"]["1"]["job_id"] = "999999"  # a job the scheduler no longer knows: as recorded at the commit
    (run / "rounds/00000/record.json").write_text(json.dumps(rec))
    as_if_a_service_held_it(Storage(str(run)))
    raw, lines = in_a_terminal([sys.executable, "-m", "orchestrator.cli", "status", str(run)], cols=80, rows=40)
    written = [re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", x) for x in raw.decode().split("\r\n")]
    assert max(map(len, written)) <= 80, written  # the terminal never had to wrap a line mid-word
    assert lines[0].startswith(f"{run}: running,") and "1/2 rounds done" in " ".join(lines[:2])
    at = lines.index("round 1 (2/2) in progress")
    assert lines[at + 1].split() == ["worker", "job", "state", "queued", "ran", "progress"], lines
    for w in (0, 1):
        assert re.fullmatch(rf" {w}\s+\d+\s+COMPLETED\s+\w+\s+\w+\s+published", lines[at + 3 + w]), lines
    assert lines[-1] == "jobs: 1 COMPLETED, 1 FAILED; worker 1 job 999999 FAILED (submitted in round 0)", lines


@slow
def test_a_run_stopped_before_its_last_evaluation_is_stopped_not_evaluating(tiny_run, tmp_path, capsys):
    """Ctrl-C between a round's commit and its evaluation: no service holds the run, so status says
    stopped and the round's evaluation pending (resume does it), never running / evaluating for ever."""
    import shutil
    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)
    for p in (run / "final", run / "metrics" / "round_00001.jsonl"):
        shutil.rmtree(p) if p.is_dir() else p.unlink()
    (run / "run.json").write_text(json.dumps({**json.loads((run / "run.json").read_text()), "finished_at": None}))
    rec = json.loads((run / "rounds/00001/record.json").read_text())
    (run / "rounds/00001/record.json").write_text(json.dumps({**rec, "eval_loss": None, "eval_metrics": {}}))
    assert main(["status", str(run), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["state"] == "stopped"
    assert main(["status", str(run)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert f"{run}: stopped," in out and " 1 pending " in out and "evaluating" not in out, out
    assert f"`orchestrate resume {run}` continues it" in out
    as_if_a_service_held_it(Storage(str(run)))  # while a service holds it, the same round is being evaluated
    assert main(["status", str(run)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert f"{run}: finishing," in out and "evaluating" in out and "resume" not in out, out


def test_eval_on_an_80_column_terminal_keeps_checkpoint_names_apart(tiny_run, tmp_path):
    """Two checkpoints deep in one folder: their common folder is said once, and each name is shown
    whole (cut to the column, `.../worker_000.safetensors` and `.../worker_001...` read the same);
    a label longer than its column breaks after a `/`, never inside a name."""
    from safetensors.torch import load_file
    deep = tmp_path / "experiments-of-the-week" / "a-long-folder-name-for-this-sweep" / "contributions"
    for w, r in ((0, 1), (1, 2)):
        write_checkpoint(Storage(str(deep)), f"worker_{w:03d}.safetensors", load_file(tiny_run / f"global/round_{r:05d}.safetensors"))
    cmd = [sys.executable, "-m", "orchestrator.cli", "eval", str(deep / "worker_000.safetensors"),
           str(deep / "worker_001.safetensors"), "--run", str(tiny_run), "--batches", "1"]
    raw, lines = in_a_terminal(cmd, cols=80, rows=40)
    screen = "\n".join(lines)
    assert f"checkpoints under {deep}/" in "".join(x.strip() for x in lines).replace("│", ""), screen
    rows = [x for x in lines if "worker_00" in x]
    assert len(rows) == 2 and "worker_000.safetensors" in rows[0] and "worker_001.safetensors" in rows[1], screen
    # a run's final model and a checkpoint elsewhere: their labels are long paths, each name on one line
    final = tiny_run / "final" / "model.safetensors"
    raw, lines = in_a_terminal([*cmd[:4], str(final), str(deep / "worker_000.safetensors"), *cmd[6:]], cols=80, rows=40)
    body = lines[[i for i, x in enumerate(lines) if x.lstrip().startswith("checkpoint")][0]:]
    cells = [x.split()[0] for x in body[2:] if x.split()]
    for name in (*final.parts[-4:], *deep.parts[-3:], "worker_000.safetensors"):
        assert any(name in c for c in cells), (name, "\n".join(lines))


def test_report_on_an_80_column_terminal_breaks_lines_between_words(tiny_run, tmp_path):
    out = tmp_path / "a-report-folder-with-a-name-long-enough-to-wrap-the-line"
    raw, lines = in_a_terminal([sys.executable, "-m", "orchestrator.cli", "report", str(tiny_run), "--out", str(out)],
                               cols=80, rows=40)
    assert "committed):" in " ".join(lines).split(), "\n".join(lines)  # a word broken by the terminal is not
    assert f"{out / 'report.html'}\r\n" in raw.decode(), "\n".join(lines)  # a path is written whole, for the terminal to wrap


@slow
def test_one_round_time_in_the_round_line_status_json_metrics_and_the_report(tiny_run, capsys):
    """The round's time is measured once (RoundRecord.round_s, commit to commit) and every view shows
    that number: the line the user saw, status's table and --json, the metrics the report reads."""
    from orchestrator.run_view import duration
    printed = (tiny_run.parent / "submit.txt").read_text().splitlines()
    assert main(["status", str(tiny_run), "--json"]) == 0
    status = json.loads(capsys.readouterr().out)
    assert main(["status", str(tiny_run)]) == 0
    table = capsys.readouterr().out.splitlines()
    metrics = {ln["round"]: ln for ln in read_metrics(Storage(str(tiny_run)), load_run(Storage(str(tiny_run))))
               if ln["kind"] == "round"}
    for r in (0, 1):
        rec = json.loads((tiny_run / f"rounds/{r:05d}/record.json").read_text())
        assert rec["round_s"] > 0 and status["rounds"][r]["round_s"] == rec["round_s"]
        line = next(x for x in printed if x.startswith(f"round {r} ({r + 1}/2)"))
        assert f", round {duration(rec['round_s'])}" in line, (line, rec["round_s"])
        row = next(x.split() for x in table if x.split()[:1] == [str(r)])
        assert row[6] == f"{rec['round_s']:.1f}", (row, rec["round_s"])  # the "round s" column
        assert metrics[r]["round_seconds"] == rec["round_s"]


def test_the_jobs_line_counts_each_job_once_and_names_a_few_that_did_not_complete():
    from orchestrator.status_cli import jobs_line
    persistent = {"0": {"job_id": "7", "state": "RUNNING"}}  # one job serving every round
    rounds = [{"round": r, "jobs": {**persistent, "1": {"job_id": str(100 + r), "state": "FAILED"}}} for r in range(6)]
    assert jobs_line(rounds, most=2) == ("jobs: 6 FAILED, 1 RUNNING; worker 1 job 100 FAILED (submitted in round 0); "
                                         "worker 1 job 101 FAILED (submitted in round 1); and 4 more (--json)")
    assert jobs_line([{"round": 0, "jobs": {}}]) is None


def test_the_outer_gradient_plot_draws_every_recorded_round_and_says_which_it_measured(tmp_path, corpus_cache, monkeypatch):
    """Retention's defaults keep the last round's tensors only: the merged step's norm comes from
    every round's record; the workers' norms and cosines from the kept round, which the plot says."""
    from orchestrator.observe.report import plot_outer
    from orchestrator.observe.report_data import collect, outer_stats_cached
    from runs import submit_tiny
    run = tmp_path / "run"
    assert main(submit_tiny(run, corpus_cache, "--workers", "2", "--rounds", "3", "--inner-steps", "2",
                            executor="inline")) == 0
    data = collect(Storage(str(run)))
    data.outer = outer_stats_cached(Storage(str(run)), data.kind("round"), tmp_path / "cache.json")
    assert sorted(data.outer) == [2]  # rounds 0 and 1: pruned
    fig = plot_outer(data)
    norm_ax, cos_ax = fig.axes[:2]
    merged = next(line for line in norm_ax.get_lines() if line.get_label().startswith("merged"))
    assert list(merged.get_xdata()) == [0, 1, 2]
    assert list(merged.get_ydata()) == [line["outer_grad_norm"] for line in data.kind("round")]
    notes = [t.get_text() for ax in (norm_ax, cos_ax) for t in ax.texts]
    assert notes == ["each worker's norm: round 2 only, whose tensors are kept (round.keep_last; 0 keeps all)",
                     "cosines: round 2 only, whose tensors are kept (round.keep_last; 0 keeps all)"], notes
