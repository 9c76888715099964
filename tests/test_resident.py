"""A persistent worker keeps its model and AdamW state in memory between rounds.

The oracle is the per-round path: a fresh trainer per round that reads its base weights and its
own state file. A resident worker (worker.train.serve_round with `carry`) must publish the same
bytes round after round, write the same state files (in the background, after its contribution),
and never lose a state write to preemption. Real files, the real merge (merge_round), a tiny model.
"""
from __future__ import annotations

import logging
import threading
import time

import pytest

import worker.learner as learner
import worker.params as params
import worker.publish as publish
import worker.train as train
from core.checkpoint import read_manifest
from core.config import config_from_dict
from core.errors import StorageError
from core.layout import RunLayout
from core.storage import Storage
from core.assignment import Assignment
from merge.rounds import Contribution, merge_round
from merge.round_spec import RoundSpec
from orchestrator.run_models import create_run

L = RunLayout()
ROUNDS = 3


def _run(tmp_path, corpus_cache, name: str, **cfg) -> Storage:
    """A run whose persistent workers write their state every round (round.state_every 1, unless
    `round` says otherwise): what a per-round job writes, to compare with."""
    rounds = {"state_every": 1, **cfg.pop("round", {})}
    c = config_from_dict({"workers": 2, "rounds": ROUNDS, "model": {"n_layer": 1, "n_embd": 32, "n_head": 2, "block_size": 32},
                          "inner": {"steps": 3, "batch_size": 2, "warmup_steps": 1}, "data": {"cache_dir": corpus_cache},
                          "run_dir": str(tmp_path / name), "round": rounds, **cfg})
    storage = Storage(c.run_dir)
    create_run(storage, c)
    return storage


def _task(storage: Storage, r: int) -> Assignment:
    return Assignment(storage.url, r, 0, L.global_weights(r), threads=1)


def _merge(storage: Storage, r: int) -> None:
    cfg = train.load_run_config(storage)
    spec = RoundSpec(base=L.global_weights(r), out=L.global_weights(r + 1), outer=cfg.outer,
                     state_in=L.outer_state(r) if r else None, state_out=L.outer_state(r + 1))
    merge_round(storage, spec, [Contribution(0, L.contribution(r, 0), 1.0)])


def _digest(storage: Storage, key: str) -> str:
    return read_manifest(storage, key)["digest"]


@pytest.mark.parametrize("contribution", [{"contribution": "weights"}, {"contribution": "delta"},
                                          {"contribution": "delta", "codec": "topk", "topk": 0.1}])
def test_resident_worker_publishes_what_per_round_jobs_publish(tmp_path, corpus_cache, contribution):
    """topk: the error-feedback buffer, carried in memory, equals the one read from the state file."""
    fresh = _run(tmp_path, corpus_cache, "fresh", round=contribution)
    resident = _run(tmp_path, corpus_cache, "resident", round=contribution)
    carry = None
    for r in range(ROUNDS):
        train.run_worker(_task(fresh, r))
        _, trainer = train.serve_round(_task(resident, r), 0.0, carry, persistent=True)
        assert carry is None or trainer is carry  # the same model and optimizer, carried on
        carry = trainer
        trainer.settle()
        assert _digest(resident, L.contribution(r, 0)) == _digest(fresh, L.contribution(r, 0)), r
        assert _digest(resident, L.worker_state(0, r)) == _digest(fresh, L.worker_state(0, r)), r
        _merge(fresh, r)
        _merge(resident, r)
        assert _digest(resident, L.global_weights(r + 1)) == _digest(fresh, L.global_weights(r + 1)), r


def test_a_snapshot_of_the_models_own_state_holds_its_round_however_slow_the_write(tmp_path, corpus_cache,
                                                                                  monkeypatch):
    """On a CPU a persistent worker's snapshot is its optimizer's own tensors (and its feedback
    buffer, replaced in place while the next contribution is coded), written in the background:
    the next round's first step waits for the write, so a slow one still holds its round's state."""
    write, written = params.write_checkpoint, {}

    def slow(storage, key, *a, **kw):
        if threading.current_thread().name.startswith("state-"):
            time.sleep(0.4)
        entry = write(storage, key, *a, **kw)
        written[storage.url, key] = _digest(storage, key)  # each round's, before the next prunes it
        return entry

    monkeypatch.setattr(params, "write_checkpoint", slow)
    topk = {"contribution": "delta", "codec": "topk", "topk": 0.1}
    fresh, resident = _run(tmp_path, corpus_cache, "fresh", round=topk), _run(tmp_path, corpus_cache, "resident", round=topk)
    carry = None
    for r in range(ROUNDS):
        train.run_worker(_task(fresh, r))
        _merge(fresh, r)
        _, carry = train.serve_round(_task(resident, r), 0.0, carry, persistent=True)
        _merge(resident, r)  # no settle: the next round starts while the state is being written
    carry.settle()
    for r in range(ROUNDS):
        assert _digest(resident, L.contribution(r, 0)) == _digest(fresh, L.contribution(r, 0)), r
        key = L.worker_state(0, r)
        assert written[resident.url, key] == written[fresh.url, key], r


@pytest.mark.parametrize("codec", ["topk", "fp32"])
def test_a_preemption_while_the_feedback_is_replaced_keeps_no_in_flight_checkpoint(tmp_path, corpus_cache,
                                                                                   monkeypatch, caplog, codec):
    """Signalled during the contribution's write: with error feedback (topk) its buffer is already
    the next round's, so no in-flight checkpoint is saved and the log says why; a delta without
    feedback (fp32) saves one, as before."""
    caplog.set_level(logging.INFO)
    s = _run(tmp_path, corpus_cache, "run", round={"contribution": "delta", "codec": codec})
    trainer, write = None, publish.write_checkpoint

    def signalled(storage, key, *a, **kw):
        if key == L.contribution(0, 0):
            trainer.publisher.checkpoint(trainer.round)  # what submitit's handler calls
        return write(storage, key, *a, **kw)

    monkeypatch.setattr(publish, "write_checkpoint", signalled)
    real_init = train.InnerTrainer.__init__

    def keep(self, *a, **kw):
        nonlocal trainer
        trainer = self
        real_init(self, *a, **kw)

    monkeypatch.setattr(train.InnerTrainer, "__init__", keep)
    train.serve_round(_task(s, 0), 0.0, None, persistent=True)
    saved = [r.getMessage() for r in caplog.records if "in-flight checkpoint at step" in r.getMessage()]
    replaced = [r.getMessage() for r in caplog.records if "while its error feedback was being replaced" in r.getMessage()]
    assert (bool(saved), bool(replaced)) == ((False, True) if codec == "topk" else (True, False))


def test_resident_round_reads_no_state_file(tmp_path, corpus_cache, monkeypatch):
    s = _run(tmp_path, corpus_cache, "run")
    _, trainer = train.serve_round(_task(s, 0), 0.0, None, persistent=True)
    trainer.settle()
    _merge(s, 0)
    monkeypatch.setattr(learner, "usable_state", lambda *a: pytest.fail("a resident round read a state file"))
    _, again = train.serve_round(_task(s, 1), 0.0, trainer, persistent=True)
    assert again is trainer
    again.settle()


@pytest.mark.parametrize("device", ["cpu", "a GPU's copying path"])
def test_resident_rounds_reuse_their_host_buffers(tmp_path, corpus_cache, monkeypatch, device):
    """Base in, weights and optimizer state out: the same host memory every round (pinned on a
    GPU, where fresh pageable memory made each copy ~25x slower), holding that round's bytes. On a
    CPU the model's optimizer state (and a delta's weights) are host memory already and are written
    without a copy: those buffers stay empty. The GPU's copies are taken here by saying the model is
    not on a CPU (no GPU on this machine)."""
    if device != "cpu":
        monkeypatch.setattr(publish, "on_cpu", lambda d: False)
    s = _run(tmp_path, corpus_cache, "run", round={"contribution": "delta", "codec": "topk"})
    _, trainer = train.serve_round(_task(s, 0), 0.0, None, persistent=True)
    trainer.settle()
    _merge(s, 0)
    host = {"base": trainer.learner.host_base, "out": trainer.publisher.host_out, "state": trainer.publisher.host_state}
    before = {name: {k: t.data_ptr() for k, t in h._bufs.items()} for name, h in host.items()}
    assert {name: bool(b) for name, b in before.items()} == {"base": True, "out": device != "cpu", "state": device != "cpu"}
    first = _digest(s, L.worker_state(0, 0))  # one snapshot is kept on storage: round 1's replaces it
    _, again = train.serve_round(_task(s, 1), 0.0, trainer, persistent=True)
    again.settle()
    assert {name: {k: t.data_ptr() for k, t in h._bufs.items()} for name, h in host.items()} == before
    assert _digest(s, L.worker_state(0, 1)) != first


def test_a_round_that_cannot_be_carried_waits_for_the_state_and_reads_it(tmp_path, corpus_cache, monkeypatch):
    """Round 0, then round 2 (round 1 went to another job): a fresh trainer, which reads state 0
    from storage, so the background write of state 0 must be finished first."""
    s = _run(tmp_path, corpus_cache, "run")
    write, latest = params.write_checkpoint, learner.usable_state
    wrote = threading.Event()

    def slow_state(storage, key, *a, **kw):  # the background state write takes a while
        if "state" in key:
            time.sleep(0.5)
            wrote.set()
        return write(storage, key, *a, **kw)

    found = []
    monkeypatch.setattr(params, "write_checkpoint", slow_state)
    def spy(*a):
        got = latest(*a)
        found.append(got[0] if got else None)
        return got
    monkeypatch.setattr(learner, "usable_state", spy)
    _, trainer = train.serve_round(_task(s, 0), 0.0, None, persistent=True)
    assert not wrote.is_set()  # the contribution is out while the state is still being written
    _merge(s, 0)
    skipped = Assignment(s.url, 2, 0, L.global_weights(1), threads=1)  # any published base will do
    _, other = train.serve_round(skipped, 0.0, trainer, persistent=True)
    assert other is not trainer
    assert found == [None, L.worker_state(0, 0)]  # round 0: none yet; round 2: round 0's, on storage by then
    other.settle()


def test_preemption_while_idle_waits_for_the_background_state_write(tmp_path, corpus_cache, monkeypatch):
    s = _run(tmp_path, corpus_cache, "run")
    write = params.write_checkpoint

    def slow_state(storage, key, *a, **kw):
        if "state" in key:
            time.sleep(0.5)
        return write(storage, key, *a, **kw)

    monkeypatch.setattr(params, "write_checkpoint", slow_state)
    train.serve_round(_task(s, 0), 0.0, None, persistent=True)
    assert read_manifest(s, L.worker_state(0, 0)) is None  # still being written
    assert train.checkpoint_active() is False  # idle: nothing in flight to save, but...
    assert read_manifest(s, L.worker_state(0, 0)) is not None  # ...the state reached storage first


def test_a_failed_background_state_write_does_not_fail_the_round(tmp_path, corpus_cache, monkeypatch, caplog):
    s = _run(tmp_path, corpus_cache, "run")
    write = params.write_checkpoint

    def no_space(storage, key, *a, **kw):
        if "state" in key:
            raise StorageError(f"write {key}: [Errno 28] No space left on device; free space and resume")
        return write(storage, key, *a, **kw)

    monkeypatch.setattr(params, "write_checkpoint", no_space)
    summary, trainer = train.serve_round(_task(s, 0), 0.0, None, persistent=True)
    trainer.settle()
    assert read_manifest(s, L.contribution(0, 0))["digest"] == summary["digest"]
    assert "optimizer state not saved" in caplog.text and "No space left" in caplog.text
    _merge(s, 0)
    monkeypatch.setattr(params, "write_checkpoint", write)
    _, again = train.serve_round(_task(s, 1), 0.0, trainer, persistent=True)  # carries on from memory
    assert again is trainer
    again.settle()
    assert read_manifest(s, L.worker_state(0, 1)) is not None


def test_lte_workers_are_not_carried_they_read_their_heads_from_storage(tmp_path, corpus_cache):
    """LTE resets B and may redraw A after each merge from its state file: a persistent LTE worker
    builds its trainer anew each round (worker/lora.py), so next_round declines."""
    s = _run(tmp_path, corpus_cache, "lte", algorithm="lte", lte={"rank": 4})
    _, trainer = train.serve_round(_task(s, 0), 0.0, None, persistent=True)
    _, other = train.serve_round(Assignment(s.url, 1, 0, L.global_weights(0), threads=1), 0.0, trainer, persistent=True)
    assert other is not trainer
    other.settle()
    assert read_manifest(s, L.worker_state(0, 1)) is not None
