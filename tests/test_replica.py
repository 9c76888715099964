"""A persistent worker's replica of the round's merge (worker/replica.py): the next global weights
made from the round's compressed contributions, used only when they hash to the published global.

The merges are the real service's (tests/service_support.py: a scripted scheduler whose jobs
publish top-k coded deltas); the replica's result is compared, bit for bit, with the global
weights the service wrote. The last test runs the real `orchestrate submit` (local executor)."""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from core import codec
from core.assignment import Assignment
from core.checkpoint import load_checkpoint, read_manifest
from core.checkpoint_writer import write_checkpoint
from core.config import load_config, replace
from core.layout import RunLayout, manifest_key
from core.storage import Storage
from tests.service_support import WORK, Scripted, scripted_run
from worker.replica import Replica

L = RunLayout()
ROUNDS = 4
G0 = {"w": torch.randn(3, 5000, generator=torch.Generator().manual_seed(0)) * 0.1,
      "b": torch.randn(7, generator=torch.Generator().manual_seed(1)), "n": torch.arange(5)}
TOPK = ["round.contribution=delta", "round.codec=topk", "round.keep_last=0"]


def _coded(s: Storage, t, rc) -> None:
    """A worker's job: base + a small seeded change, coded against the base as round config `rc`
    says, as a worker codes it."""
    base, _, _ = load_checkpoint(s, t.base_key)
    digest = read_manifest(s, t.base_key)["digest"]
    g = torch.Generator().manual_seed(100 * t.round + t.worker)
    weights = {k: v + 1e-3 * torch.randn(v.shape, generator=g) if v.is_floating_point() else v for k, v in base.items()}
    enc = codec.encoding_for(rc, digest, t.round)
    tensors, meta, _ = codec.encode(base, weights, enc)
    write_checkpoint(s, L.contribution(t.round, t.worker), tensors, metadata=meta,
                     manifest={"round": t.round, "worker": t.worker, **WORK, "base": t.base_key, "base_digest": digest})


def _run(tmp_path: Path, sets: list[str]) -> tuple[Storage, object]:
    cfg = load_config(None, {"workers": 3, "rounds": ROUNDS}, TOPK + sets)
    ex = Scripted({w: lambda s, t: _coded(s, t, cfg.round) for w in range(3)})
    return scripted_run(tmp_path, ex, TOPK + sets, workers=3, rounds=ROUNDS, g0=G0), cfg


def _task(s: Storage, r: int, worker: int = 0) -> Assignment:
    return Assignment(s.url, r, worker, L.global_weights(r), persistent=True)


def _global(s: Storage, r: int) -> tuple[dict[str, torch.Tensor], str]:
    return load_checkpoint(s, L.global_weights(r))[0], read_manifest(s, L.global_weights(r))["digest"]


@pytest.fixture(scope="module")
def nesterov_run(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("nesterov"), [])


@pytest.mark.parametrize("sets", [[], ["outer.optimizer=adam"], ["outer.optimizer=sgd"], ["round.codec=int8"],
                                  ["round.codec=fp32", "round.prune_keep=0.1"]])
def test_a_replica_makes_every_global_of_the_run_bit_for_bit(tmp_path, nesterov_run, sets):
    """From round 0 the outer state is carried by the replica; every replayed global is the
    published one (the digest matched, and the tensors are equal): top-k deltas with Nesterov,
    Adam and SGD, int8 deltas (3 x 1/4 of the weights) and pruned fp32 rows."""
    s, cfg = nesterov_run if not sets else _run(tmp_path, sets)
    rep = Replica.of(cfg, world=1, collective=False)
    assert rep.off is None
    weights, digest = _global(s, 0)
    rep.hold(_task(s, 0), weights, digest)
    for r in range(1, ROUNDS + 1):
        want, digest = _global(s, r)
        got = rep.next_global(s, _task(s, r), digest)
        assert got is not None, f"round {r} was not replayed"
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
        rep.hold(_task(s, r), got, digest)


def test_a_replica_started_mid_run_reads_the_outer_state_once(nesterov_run, caplog):
    s, cfg = nesterov_run
    rep = Replica.of(cfg, world=1, collective=False)
    weights, digest = _global(s, 2)
    rep.hold(_task(s, 2), weights, digest)  # a job (re)started at round 2: the momentum is not known
    assert rep.state is None
    with caplog.at_level(logging.INFO, logger="worker.replica"):
        for r in (3, 4):
            got = rep.next_global(s, _task(s, r), _global(s, r)[1])
            assert got is not None and all(torch.equal(got[k], v) for k, v in _global(s, r)[0].items())
            rep.hold(_task(s, r), got, _global(s, r)[1])
    assert sum("outer optimizer state of round" in m for m in caplog.messages) == 1


def test_auto_reads_while_its_last_replay_was_slower_than_its_last_read(nesterov_run, caplog):
    """round.replica auto (the default): a worker whose replay took longer than its read reads the
    next global (said once), and replays again once a read has become the slower way (a
    filesystem under load); `always` replays whatever the seconds say."""
    s, cfg = nesterov_run
    assert cfg.round.replica == "auto"
    rep = Replica.of(cfg, world=1, collective=False)
    rep.hold(_task(s, 0), *_global(s, 0))
    rep.took(False, 0.5)  # round 0's base: read
    got = rep.next_global(s, _task(s, 1), _global(s, 1)[1])
    assert got is not None  # never replayed yet: tried
    rep.took(True, 2.0)
    rep.hold(_task(s, 1), got, _global(s, 1)[1])
    with caplog.at_level(logging.INFO, logger="worker.replica"):
        for r in (2, 3):
            assert rep.next_global(s, _task(s, r), _global(s, r)[1]) is None
            rep.took(False, 0.5)
            rep.hold(_task(s, r), *_global(s, r))
    assert sum("while that is the faster way (replaying took 2.00s, reading 0.50s)" in m for m in caplog.messages) == 1
    rep.took(False, 2.5)  # the filesystem slowed down: the replica is back, the outer state read once
    got = rep.next_global(s, _task(s, 4), _global(s, 4)[1])
    assert got is not None and all(torch.equal(got[k], v) for k, v in _global(s, 4)[0].items())
    always = Replica.of(replace(cfg, round__replica="always"), world=1, collective=False)
    always.hold(_task(s, 1), *_global(s, 1))
    always.took(True, 9.0)
    assert always.next_global(s, _task(s, 2), _global(s, 2)[1]) is not None


def _replay_round(s: Storage, cfg, r: int = 2):
    rep = Replica.of(cfg, world=1, collective=False)
    weights, digest = _global(s, r - 1)
    rep.hold(_task(s, r - 1), weights, digest)
    return rep, rep.next_global(s, _task(s, r), _global(s, r)[1])


def test_a_replica_that_differs_is_not_used(nesterov_run, monkeypatch, caplog):
    """A failpoint adds 1 to one entry of worker 0's replayed global: the digest differs, so the
    worker reads the global instead, and from then on (its arithmetic is not the merge's)."""
    s, cfg = nesterov_run
    monkeypatch.setenv("ISLANDS_FAILPOINT", "worker_000.replica")
    with caplog.at_level(logging.INFO, logger="worker.replica"):
        rep, got = _replay_round(s, cfg)
    assert got is None and rep.round is None and rep.state is None and "digest" in rep.off
    assert any("worker 0 round 2: reading the global weights from now on: the replayed global's digest" in m
               for m in caplog.messages)


def _copy(s: Storage, tmp_path: Path) -> Storage:
    import shutil
    shutil.copytree(s.url, tmp_path / "run")
    return Storage(str(tmp_path / "run"))


def _alter(s: Storage, key: str) -> None:
    """The contribution at `key` rewritten whole (a valid file and manifest) with one value changed."""
    tensors, meta, manifest = load_checkpoint(s, key)
    tensors["b"] = tensors["b"] + 1
    write_checkpoint(s, key, tensors, metadata=meta, manifest={k: v for k, v in manifest.items() if k in ("round", "worker")})


def _plant(s: Storage, r: int, w: int, **tensors) -> None:
    """Worker w's contribution to round r rewritten with `tensors` in place of its own (a file whose
    entries do not decode), and the record forged to name it: what only a co-tenant writes."""
    old, meta, manifest = load_checkpoint(s, L.contribution(r, w))
    write_checkpoint(s, L.contribution(r, w), {**old, **tensors}, metadata=meta,
                     manifest={k: v for k, v in manifest.items() if k in ("round", "worker", "base", "base_digest")})
    rec, m = s.read_json(L.round_record(r)), read_manifest(s, L.contribution(r, w))
    _forge_record(s, r, contrib_digest={**rec["contrib_digest"], str(w): m["digest"]},
                  contribution_bytes={**rec["contribution_bytes"], str(w): m["bytes"]})


def _edit_manifest(s: Storage, key: str, **changes) -> None:
    m = s.read_json(manifest_key(key))
    s.write_json(manifest_key(key), {**m, **changes})


def _forge_record(s: Storage, r: int, **changes) -> None:
    rec = s.read_json(L.round_record(r))
    s.write_json(L.round_record(r), {**rec, **changes})


def test_a_worker_uses_its_own_contribution_as_it_wrote_it(nesterov_run, tmp_path):
    """The record names worker 0's digest: its own contribution is taken from memory, not read (here
    its file is gone); the others are read."""
    s, cfg = nesterov_run
    s = _copy(s, tmp_path)
    tensors, meta, manifest = load_checkpoint(s, L.contribution(1, 0))
    s.remove(L.contribution(1, 0))
    rep = Replica.of(cfg, world=1, collective=False)
    weights, digest = _global(s, 1)
    rep.hold(_task(s, 1), weights, digest)
    rep.mine = (manifest["digest"], tensors, meta)
    assert rep.next_global(s, _task(s, 2), _global(s, 2)[1]) is not None
    s.remove(L.contribution(1, 1))
    rep.hold(_task(s, 1), _global(s, 1)[0], digest)
    assert rep.next_global(s, _task(s, 2), _global(s, 2)[1]) is None  # worker 1's is not its own: read, and gone


def test_inputs_not_fewer_bytes_than_the_global_are_not_replayed(tmp_path, caplog):
    """bf16 deltas from 3 workers are 1.5 x the global's bytes: every worker reads the global, and
    says so once."""
    s, cfg = _run(tmp_path, ["round.codec=bf16"])
    rep = Replica.of(cfg, world=1, collective=False)
    with caplog.at_level(logging.INFO, logger="worker.replica"):
        for r in range(1, ROUNDS):
            rep.hold(_task(s, r - 1), *_global(s, r - 1))
            assert rep.next_global(s, _task(s, r), _global(s, r)[1]) is None
    assert [m for m in caplog.messages if "reading the global" in m] == [
        "replica: worker 0 round 1: reading the global weights: the round's 3 contributions are not fewer bytes than "
        "the global weights"]


@pytest.mark.parametrize("damage, why", [
    (lambda s: s.remove(L.round_record(1)), "round 1 has no record"),
    (lambda s: _forge_record(s, 1, contribution_bytes={w: 10**9 for w in ("0", "1", "2")}),
     "not fewer bytes than the global weights"),
    (lambda s: _forge_record(s, 1, folded=[{"id": -1, "key": L.contribution(1, 0), "weight": 1.0}],
                             merge_order=[0, 1, 2, -1]), "round 1 folded late contributions"),
    (lambda s: _alter(s, L.contribution(1, 1)), "is not the file the round's record merged"),
    (lambda s: s.remove(L.contribution(1, 2)), "checkpoint file is missing"),
    (lambda s: _plant(s, 1, 1, b=torch.zeros(3)), "a recorded input could not be replayed (IndexError"),
    (lambda s: _edit_manifest(s, L.contribution(1, 1), bytes=2 << 30), "not the size the record says"),
    (lambda s: os.truncate(os.path.join(s.url, L.contribution(1, 2)), 2 << 30),  # sparse: nothing is written
     "the file has 2147483648 bytes, its manifest says"),
])
def test_anything_missing_or_altered_after_the_commit_reads_the_global(nesterov_run, tmp_path, caplog, damage, why):
    s, cfg = nesterov_run
    s = _copy(s, tmp_path)
    damage(s)
    with caplog.at_level(logging.INFO, logger="worker.replica"):
        rep, got = _replay_round(s, cfg)
    assert got is None
    assert any(why in m for m in caplog.messages), caplog.messages


@pytest.mark.parametrize("sets, why", [
    (["round.replica=never"], "round.replica=never"),
    (["round.contribution=weights"], "contributions are weights"),
    (["round.aggregate=median"], "round.aggregate median"),
    (["round.worker_mode=per_round"], "not persistent"),
    (["algorithm=lte", "round.contribution=weights"], "lte"),
])
def test_configurations_another_merge_serves_never_replay(sets, why):
    cfg = load_config(None, {}, ["round.contribution=delta", *sets])
    assert why in (Replica.of(cfg, world=1, collective=False).off or "")
    assert "ranks" in (Replica.of(load_config(None, {}, TOPK), world=2, collective=False).off or "")


def _submit(run: Path, *args: str) -> None:
    env = {**os.environ, "ISLANDS_FAILPOINT": "worker_001.replica"}
    subprocess.run([sys.executable, "-m", "orchestrator.cli", "submit", *args, "--run-dir", str(run)], check=True,
                   capture_output=True, env=env, timeout=600)


def test_a_run_with_replicas_publishes_the_same_globals_as_one_without(tmp_path):
    """The real command: 3 persistent workers, top-k deltas, 4 rounds; worker 1's replica is made to
    differ every round (a failpoint), so it reads the global, the others replay theirs. A replay of
    the run with round.replica never publishes the same bytes, round after round."""
    a, b = tmp_path / "a", tmp_path / "b"
    _submit(a, "--executor", "local", "--workers", "3", "--rounds", "4", "--inner-steps", "2",
            "--set", "inner.warmup_steps=1", "--set", "data.eval_batches=1", "--set", "round.replica=always",
            *(x for t in TOPK for x in ("--set", t)))
    _submit(b, "--replay", str(a), "--set", "round.replica=never")
    for r in range(1, 4):  # rounds 1..3 start from a global made by a merge
        seen = {w: json.loads((a / "rounds" / f"{r:05d}" / "contrib" / f"worker_{w:03d}.json").read_text())
                for w in range(3)}
        assert {w: m["replica"] for w, m in seen.items()} == {0: True, 1: False, 2: True}, r
        assert all(m["io_read"] < m["bytes"] * 10 for w, m in seen.items() if w != 1)  # not the 1.9 MB global
    for r in range(1, 5):
        da, db = (json.loads((run / "global" / f"round_{r:05d}.json").read_text())["digest"] for run in (a, b))
        assert da == db, f"global {r} differs"
    log = "".join(p.read_text() for p in (a / "jobs").rglob("*_log.err"))
    assert log.count("worker 1 round 1: reading the global weights from now on: the replayed global's digest") == 1
    assert log.count("reading the global weights") == 1  # said once: worker 1 stopped replaying
