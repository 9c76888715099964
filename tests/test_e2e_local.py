"""Whole runs through submitit's local executor on a tiny model: real processes, real files."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from core.storage import Storage
from orchestrator.cli import main
from runs import DENSE, submit_tiny
from worker.weights import load_model

pytestmark = pytest.mark.slow


def _status(run_dir: Path, capsys) -> dict:
    capsys.readouterr()
    assert main(["status", str(run_dir), "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_two_workers_two_rounds(tmp_path, corpus_cache, capsys):
    run = tmp_path / "run"
    assert main(submit_tiny(run, corpus_cache, "--workers", "2", "--rounds", "2", "--inner-steps", "4")) == 0
    st = _status(run, capsys)
    assert st["state"] == "done" and st["rounds_done"] == 2 and st["algorithm"] == "diloco"
    assert [r["merged"] for r in st["rounds"]] == [[0, 1], [0, 1]]
    assert all(r["dropped"] == [] and r["rejected"] == [] and r["bytes_read"] > 0 for r in st["rounds"])
    # after the run, status says how each local job ended, from its files (not RUNNING as at each
    # commit); a persistent worker ends just after its last contribution, once its state is written
    deadline = time.time() + 30
    while True:
        later = _status(run, capsys)
        jobs = [j for r in later["rounds"] for j in r["jobs"].values()]
        if not any(j["state"] == "RUNNING" for j in jobs):
            break
        assert time.time() < deadline, jobs
        time.sleep(0.2)
    assert later["scheduler"].startswith("reachable") and all(j["state"] == "COMPLETED" and j["run_s"] > 0 for j in jobs), jobs
    assert all(r["wall_s"] > 0 for r in later["rounds"])  # each round's first submission to its commit
    # persistent workers (the default): busy and idle seconds per worker, and their share
    assert all(set(r["worker_train_s"]) == set(r["worker_idle_s"]) == {"0", "1"} for r in st["rounds"])
    assert all(0 < r["utilization"] <= 1 for r in st["rounds"]) and 0 < st["utilization"] <= 1
    busy = sum(s for r in st["rounds"] for s in r["worker_train_s"].values())
    idle = sum(s for r in st["rounds"] for s in r["worker_idle_s"].values())
    assert st["utilization"] == round(busy / (busy + idle), 4)
    assert main(["cancel", str(run)]) == 0 and "nothing to cancel: the run is done" in capsys.readouterr().out
    assert not Storage(str(run)).exists("CANCEL")
    losses = [st["initial_eval_loss"]] + [r["eval_loss"] for r in st["rounds"]]
    assert losses[1] < losses[0]
    # the export loads back into the built-in model with one call
    model = load_model(st["final_model"])
    assert model.transformer.wte.weight.shape == (256, 32)
    # workers kept their own inner optimizer state across rounds, in memory: a snapshot reaches storage
    # every round.state_every rounds (20) or when a job ends before the run, so this run wrote none
    s = Storage(str(run))
    assert s.list("workers/worker_000") == ["progress.json"]
    assert s.read_json("workers/worker_000/progress.json")["step"] == 4
    manifest = s.read_json("rounds/00001/contrib/worker_001.json")
    assert manifest["steps"] == 4 and manifest["tokens"] == 4 * 4 * 32 and manifest["round"] == 1


def test_lofi_one_round_average(tmp_path, corpus_cache, capsys):
    run = tmp_path / "run"
    assert main(submit_tiny(run, corpus_cache, "--algorithm", "lofi", "--workers", "2", "--inner-steps", "3", executor="inline")) == 0
    st = _status(run, capsys)
    assert st["rounds_total"] == 1 and st["rounds"][0]["merged"] == [0, 1]
    s = Storage(str(run))
    manifest = s.read_json("rounds/00000/contrib/worker_000.json")
    assert manifest["tokens"] == 3 * 2 * 32  # batch 4 split over 2 workers
    # lo-fi's merge is the plain (token-weighted, equal tokens) average of the two workers
    from core.checkpoint import load_checkpoint
    a = load_checkpoint(s, "rounds/00000/contrib/worker_000.safetensors")[0]
    b = load_checkpoint(s, "rounds/00000/contrib/worker_001.safetensors")[0]
    g = load_checkpoint(s, "global/round_00001.safetensors")[0]
    for k in g:
        assert torch.allclose(g[k], (a[k] + b[k]) / 2, atol=1e-6), k


def test_same_seed_same_result(tmp_path, corpus_cache, dense_run):
    """The session's dense run made again: every round's global the same, bit for bit."""
    run = tmp_path / "run"
    assert main(submit_tiny(run, corpus_cache, *DENSE, executor="inline")) == 0
    shas = [[Storage(str(r)).read_json(f"rounds/{q:05d}/record.json")["global_digest"] for q in range(2)] for r in (run, dense_run)]
    assert shas[0] == shas[1]


def test_existing_run_dir_is_refused(corpus_cache, capsys, dense_run):
    before = (dense_run / "config.yaml").read_bytes()
    capsys.readouterr()
    assert main(submit_tiny(dense_run, corpus_cache, "--workers", "1", "--rounds", "1", executor="inline")) == 2
    assert "already holds a run" in capsys.readouterr().out
    assert (dense_run / "config.yaml").read_bytes() == before  # nothing of it changed


def _until_round_0(run: Path, args: list[str], **popen) -> subprocess.Popen:
    """`orchestrate` started as a process of its own, returned once round 0 is committed."""
    proc = subprocess.Popen([sys.executable, "-m", "orchestrator.cli", *args], cwd=Path(__file__).parent.parent,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **popen)
    deadline = time.time() + 120
    while not (run / "rounds/00000/record.json").exists():
        assert proc.poll() is None and time.time() < deadline, proc.stdout.read()[-3000:]
        time.sleep(0.1)
    return proc


def test_resume_after_the_orchestrator_is_killed(tmp_path, corpus_cache):
    run = tmp_path / "run"
    args = submit_tiny(run, corpus_cache, "--workers", "2", "--rounds", "3", "--inner-steps", "3")
    proc = _until_round_0(run, args, start_new_session=True)
    s = Storage(str(run))
    os.kill(proc.pid, signal.SIGKILL)  # the orchestrator dies; its workers may live on
    proc.wait()
    first = s.read_json("rounds/00000/record.json")
    assert s.read_json("lock.json")["pid"] == proc.pid  # left behind by the dead process
    assert main(["resume", str(run)]) == 0  # the stale lock is taken over
    after = s.read_json("rounds/00000/record.json")
    # a committed round is never redone (only an eval loss the dead service had not added is filled in)
    assert {k: v for k, v in after.items() if k != "eval_loss"} == {k: v for k, v in first.items() if k != "eval_loss"}
    assert after["eval_loss"] is not None
    records = [s.read_json(f"rounds/{r:05d}/record.json") for r in range(3)]
    assert [r["round"] for r in records] == [0, 1, 2]
    assert s.exists("final/model.safetensors") and not s.exists("lock.json")


def test_a_second_service_forced_onto_a_live_run_fences_the_first(tmp_path, corpus_cache):
    """`resume` while the first service lives is refused; `resume --force` takes the run, and the
    first stops before its next commit, naming who took it: no round submitted or merged twice."""
    run = tmp_path / "run"
    # per-round jobs: each round's submissions are then countable (one batch, one job per worker)
    args = submit_tiny(run, corpus_cache, "--workers", "2", "--rounds", "3", "--inner-steps", "3", "--set", "round.worker_mode=per_round")
    first = _until_round_0(run, args)
    s = Storage(str(run))
    refused = subprocess.run([sys.executable, "-m", "orchestrator.cli", "resume", str(run)], capture_output=True,
                             text=True, cwd=Path(__file__).parent.parent, timeout=120)
    assert refused.returncode == 2 and f"another merge service (pid {first.pid}" in refused.stdout, refused.stdout
    second = subprocess.run([sys.executable, "-m", "orchestrator.cli", "resume", str(run), "--force"],
                            capture_output=True, text=True, cwd=Path(__file__).parent.parent, timeout=300)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    out, _ = first.communicate(timeout=120)
    assert first.returncode == 2 and "was taken over by pid" in out and "(epoch 2, forced with --force)" in out, out[-3000:]
    assert "this merge service (epoch 1) stops" in out
    for r in range(3):
        jobs = s.read_json(f"rounds/{r:05d}/jobs.json")
        assert jobs["sbatch_calls"] == 1 and all(len(e["job_ids"]) == 1 for e in jobs["workers"].values()), jobs
        assert s.read_json(f"rounds/{r:05d}/record.json")["merged"] == [0, 1]
    assert s.list("lease") == ["epoch_00001.json", "epoch_00002.json"] and not s.exists("lock.json")


def test_cancel_stops_the_run(tmp_path, corpus_cache):
    run = tmp_path / "run"
    args = submit_tiny(run, corpus_cache, "--workers", "2", "--rounds", "50", "--inner-steps", "200")
    proc = subprocess.Popen([sys.executable, "-m", "orchestrator.cli", *args], cwd=Path(__file__).parent.parent,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    s = Storage(str(run))
    deadline = time.time() + 60
    while not s.exists("rounds/00000/jobs.json"):
        assert time.time() < deadline
        time.sleep(0.1)
    assert main(["cancel", str(run)]) == 0
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 3, out.decode()[-2000:]
    assert b"cancelled during round 0" in out
    assert json.loads(subprocess.run([sys.executable, "-m", "orchestrator.cli", "status", str(run), "--json"],
                                     capture_output=True, cwd=Path(__file__).parent.parent).stdout)["state"] == "cancelled"


def test_detached_service_local(tmp_path, corpus_cache, capsys):
    from orchestrator.runstate import run_status

    run = tmp_path / "run"
    assert main(submit_tiny(run, corpus_cache, "--workers", "1", "--rounds", "2", "--inner-steps", "2", "--detach")) == 0
    assert "merge service started as process" in capsys.readouterr().out
    s = Storage(str(run))
    deadline = time.time() + 120
    while run_status(s)["state"] != "done":
        assert time.time() < deadline, (run / "jobs" / "service.log").read_text()[-2000:]
        time.sleep(0.2)
    assert (run / "jobs" / "service.log").exists()


def test_int8_delta_contributions_two_workers_two_rounds(tmp_path, corpus_cache, capsys):
    from core import codec
    from core.checkpoint import load_checkpoint, open_checkpoint

    run = tmp_path / "run"
    assert main(submit_tiny(run, corpus_cache, "--workers", "2", "--rounds", "2", "--inner-steps", "4",
                      "--set", "round.contribution=delta", "--set", "round.codec=int8",
                      "--set", "round.keep_last=0", executor="inline")) == 0  # round 0's tensors kept: the oracle below reads them
    st = _status(run, capsys)
    assert st["state"] == "done" and [r["merged"] for r in st["rounds"]] == [[0, 1], [0, 1]]
    assert st["rounds"][0]["eval_loss"] < st["initial_eval_loss"]
    s = Storage(str(run))
    g0, _, g0_manifest = load_checkpoint(s, "global/round_00000.safetensors")
    deltas = []
    for w in (0, 1):
        key = f"rounds/00000/contrib/worker_{w:03d}.safetensors"
        with open_checkpoint(s, key) as ck:
            enc = codec.encoding_of(ck.metadata, key)
            assert enc == codec.Encoding("int8", 1.0, g0_manifest["digest"])
            assert ck.specs["lm_head.weight"].dtype == "I8" and ck.specs["lm_head.weight::scale"].shape == (256,)
            # int8 + one fp32 scale per row (on this tiny model the header and scales weigh ~5%)
            assert ck.manifest["bytes"] < 0.32 * g0_manifest["bytes"]
            deltas.append({n: codec.decode_tensor(n, tuple(t.shape), enc, ck.get) for n, t in g0.items()})
    # round 0 against torch.optim stepped directly on the decoded deltas (equal tokens: plain mean)
    params = {n: torch.nn.Parameter(t.clone()) for n, t in g0.items()}
    opt = torch.optim.SGD(list(params.values()), lr=0.7, momentum=0.9, nesterov=True)
    for n, p in params.items():
        p.grad = (deltas[0][n] + deltas[1][n]) / 2
    opt.step()
    g1 = load_checkpoint(s, "global/round_00001.safetensors")[0]
    assert all(torch.allclose(g1[n], params[n].detach(), atol=1e-6) for n in g0)
    assert sorted(s.read_json("rounds/00001/record.json")["merge_order"]) == [0, 1]


def test_a_median_round_is_not_dragged_by_a_planted_outlier(tmp_path, corpus_cache, capsys):
    """round.aggregate=median, live (#28): worker 2 is held before it publishes (ISLANDS_SLOWPOINT,
    12 s) while a well-formed contribution with its manifest and weights off by up to 3x
    round.max_update per entry is planted in its place (bench.chaos.plant: nothing in it tells it
    from a real one, the bound of what a round can move an entry included). The round
    merges it, yet the new global stays within the honest workers' spread, where a mean would move
    every entry by about a third of the plant's offset, and the run still learns."""
    from types import SimpleNamespace

    from bench.chaos import plant
    from core.checkpoint import load_checkpoint, read_manifest
    run, steps = tmp_path / "run", 3
    args = submit_tiny(run, corpus_cache, "--workers", "3", "--rounds", "1", "--inner-steps", str(steps),
                 "--set", "round.aggregate=median", "--set", "round.worker_mode=per_round", executor="inline")
    proc = subprocess.Popen([sys.executable, "-m", "orchestrator.cli", *args], cwd=Path(__file__).parent.parent,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "ISLANDS_SLOWPOINT": "worker_002.publish=12"})
    s = Storage(str(run))
    deadline = time.time() + 120
    while not all(s.exists(f"rounds/00000/contrib/worker_{w:03d}.json") for w in (0, 1)):
        assert proc.poll() is None and time.time() < deadline, proc.stdout.read()[-3000:]
        time.sleep(0.05)
    assert not s.exists("rounds/00000/contrib/worker_002.json")  # still held: the plant goes first
    digest = plant(s, 0, 2, "poison", SimpleNamespace(inner_steps=steps))
    out, _ = proc.communicate(timeout=180)
    assert proc.returncode == 0, out[-3000:]
    record = s.read_json("rounds/00000/record.json")
    assert record["merged"] == [0, 1, 2] and record["contrib_digest"]["2"] == digest  # merged: undetectable
    g0, g1 = (load_checkpoint(s, f"global/round_{r:05d}.safetensors")[0] for r in (0, 1))
    assert read_manifest(s, "global/round_00001.safetensors")["aggregate"] == "median"
    honest = [load_checkpoint(s, f"rounds/00000/contrib/worker_{w:03d}.safetensors")[0] for w in (0, 1)]
    step = 0.7 * 1.9  # nesterov's first step: global - lr (1 + momentum) grad
    for n, t in g0.items():
        if t.is_floating_point():
            spread = (honest[0][n] - honest[1][n]).abs().max() + (torch.stack([h[n] for h in honest]) - t).abs().max()
            assert float((g1[n] - t).abs().max()) <= step * float(spread) + 1e-5, n  # a mean moves it ~0.4+
    st = _status(run, capsys)
    assert st["state"] == "done" and st["rounds"][-1]["eval_loss"] < st["initial_eval_loss"]


def test_a_time_budget_keeps_a_slow_worker_from_holding_the_round(tmp_path, corpus_cache, capsys, monkeypatch):
    """round.budget: seconds. Worker 1 is made slow (100 ms more per step, a fault-injection
    slowpoint: slower than worker 0 however loaded the machine); both train 1.5 s a round, worker 1
    fewer steps, and each is weighted by its tokens."""
    monkeypatch.setenv("ISLANDS_SLOWPOINT", "worker_001.step=0.1")
    run = tmp_path / "run"
    assert main(submit_tiny(run, corpus_cache, "--workers", "2", "--rounds", "2", "--inner-steps", "100000",
                      "--set", "round.budget=seconds", "--set", "round.budget_seconds=1.5", executor="inline")) == 0
    s = Storage(str(run))
    for r in range(2):
        m = [s.read_json(f"rounds/{r:05d}/contrib/worker_{w:03d}.json") for w in (0, 1)]
        assert all(1.5 <= x["trained_s"] < 1.5 + 5.0 for x in m), m  # the budget, and at most a step past it
        assert 1 <= m[1]["steps"] < m[0]["steps"] < 100000, [x["steps"] for x in m]
        rec = s.read_json(f"rounds/{r:05d}/record.json")
        assert rec["weights"] == {str(w): float(m[w]["tokens"]) for w in (0, 1)}
        assert rec["merged"] == [0, 1]
    st = _status(run, capsys)
    assert st["state"] == "done" and st["rounds"][1]["eval_loss"] < st["initial_eval_loss"]


def test_overlapped_rounds_train_ahead_and_adopt_each_global(tmp_path, corpus_cache, capsys):
    """round.overlap: rebase. From round 1 on, each contribution records the step at which its
    worker adopted the round's global; it names that global as its base and took H steps in all."""
    run = tmp_path / "run"
    assert main(submit_tiny(run, corpus_cache, "--workers", "2", "--rounds", "3", "--inner-steps", "200",
                      "--set", "round.overlap=rebase", executor="inline")) == 0
    s = Storage(str(run))
    for r in range(3):
        for w in (0, 1):
            m = s.read_json(f"rounds/{r:05d}/contrib/worker_{w:03d}.json")
            assert m["steps"] == 200 and m["base"] == f"global/round_{r:05d}.safetensors"
            if r == 0:
                assert "overlap" not in m  # nothing to train ahead of
            else:
                assert m["overlap"]["mode"] == "rebase" and 0 <= m["overlap"]["adopted_at_step"] <= 200, m
                assert m["seconds"] >= m["trained_s"]  # the steps taken ahead count as this round's busy time
    st = _status(run, capsys)
    assert st["state"] == "done" and all(r["merged"] == [0, 1] for r in st["rounds"])
    assert all(r["eval_loss"] is not None for r in st["rounds"]) and st["utilization"] is not None
    assert "adopted its base at step" in (run / "orchestrator.log").read_text()  # inline: the workers' log is the run's


@pytest.mark.parametrize("steps, ahead", [(200, 0.1), (20, 1.0)])
def test_a_worker_ahead_by_its_bound_waits_for_the_global(tmp_path, corpus_cache, monkeypatch, steps, ahead):
    """A worker trains at most round.overlap_ahead of a round before its round's global exists (0.1
    of H = 200, or the default, a whole round of H = 20: 20 steps either way), then waits. Worker 1
    is slow to publish (3 s), so worker 0 would otherwise train on past every global. How long it
    waited is a wall-clock figure that a loaded machine shrinks (its 20 steps take longer): not
    asserted; that it stopped at the bound is."""
    monkeypatch.setenv("ISLANDS_SLOWPOINT", "worker_001.publish=3")
    run = tmp_path / "run"
    assert main(submit_tiny(run, corpus_cache, "--workers", "2", "--rounds", "3", "--inner-steps", str(steps),
                      "--set", "round.overlap=rebase", "--set", f"round.overlap_ahead={ahead}", executor="inline")) == 0
    s = Storage(str(run))
    adopted = {(r, w): s.read_json(f"rounds/{r:05d}/contrib/worker_{w:03d}.json")["overlap"]["adopted_at_step"]
               for r in (1, 2) for w in (0, 1)}
    assert all(0 <= a <= 20 for a in adopted.values()), adopted  # never past the bound
    assert adopted[1, 0] == 20 or adopted[2, 0] == 20, adopted  # worker 0 reached it, so waited there

