"""Finite but impossible values: a forged contribution or worker state whose numbers pass every
NaN/Inf check (a top-k chunk scale of 1e30, an error-feedback buffer of 1e30) is refused against the
bound of what a round can move an entry (core.codec.max_update), never merged or sent.

Live: the real merge service (orchestrator.loop) on local files, with tests/test_contributions.py's
Scripted executor (threads for jobs): worker 0 publishes an honest delta, worker 1 the forged one.
Worker state: the real worker (worker.train) on the built-in model, a planted state file.
"""
from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path

import pytest
import torch

import worker.train as train
from core import codec
from core.checkpoint import load_checkpoint, read_manifest
from core.checkpoint_writer import write_checkpoint
from core.config import config_from_dict, load_config
from core.layout import RunLayout
from core.records import RoundRecord
from core.storage import Storage
from merge.round_spec import Contribution, QuorumError, RoundSpec
from merge.rounds import RunningSum
from service_support import WORK, Scripted, scripted_run
from test_resident import _run as _worker_run, _task
from worker.params import FEEDBACK
from worker.state import usable_state

L = RunLayout()
G0 = {"b": torch.tensor([0.5]), "w": torch.linspace(-1, 1, 5000)}  # w: two top-k chunks, one padded
SETS = ["round.min_workers=1", "round.poll_s=0.05", "round.max_retries=0", "outer.optimizer=sgd", "outer.lr=1.0",
        "round.contribution=delta"]


def _delta(codec_name: str, forge=None):
    """A worker publishing base - 0.01 as a delta coded `codec_name`; `forge` edits the coded tensors."""
    def plant(s: Storage, t) -> None:
        base, _, m = load_checkpoint(s, t.base_key)
        topk = codec_name == "topk"
        enc = codec.Encoding(codec_name, 1.0, m["digest"], 0.0625 if topk else 0.0, 2 if topk else 0)
        tensors, metadata, _ = codec.encode(base, {n: v - 0.01 for n, v in base.items()}, enc)
        tensors = forge(tensors) if forge else tensors
        write_checkpoint(s, L.contribution(t.round, t.worker), tensors, metadata=metadata,
                         manifest={"round": t.round, "worker": t.worker, **WORK, "base_digest": m["digest"]})
    return plant


def _scales(value: float):
    def forge(tensors):
        out = {}
        for n, rows in tensors.items():
            rows = rows.clone()
            rows[:, :4] = torch.full((rows.shape[0],), value, dtype=torch.float32).view(torch.uint8).view(-1, 4)
            out[n] = rows
        return out
    return forge


FORGED = {  # name -> (codec, forge): finite values far past any round's reach
    "topk-scales-1e30": ("topk", _scales(1e30)),
    "topk-scales-1e6": ("topk", _scales(1e6)),
    "fp32-delta-1e30": ("fp32", lambda ts: {n: torch.full_like(v, 1e30) for n, v in ts.items()}),
    "bf16-delta-1e30": ("bf16", lambda ts: {n: torch.full_like(v, 1e30) for n, v in ts.items()}),
}


def _service_run(tmp_path, behaviour, sets=SETS) -> Storage:
    return scripted_run(tmp_path, Scripted(behaviour), list(sets), g0=G0)


@pytest.mark.parametrize("case", sorted(FORGED))
def test_a_forged_contribution_of_finite_values_is_refused_and_the_global_is_the_honest_workers(tmp_path, case):
    name, forge = FORGED[case]
    s = _service_run(tmp_path, {0: _delta(name), 1: _delta(name, forge)},
                     SETS + ([f"round.codec={name}"] + (["round.error_feedback=0"] if name == "topk" else [])))
    rec = RoundRecord.load(s, 0)
    assert rec.merged == [0] and rec.rejected == [1], rec
    assert "more than a round of inner training can" in rec.rejected_reasons["1"], rec.rejected_reasons
    assert rec.outer_grad_norm is not None and math.isfinite(rec.outer_grad_norm)
    got = load_checkpoint(s, L.global_weights(1))[0]
    assert float(got["w"].abs().max()) < 2.0 and float(got["b"].abs().max()) < 1.0  # not poisoned
    assert s.exists(L.rejected_contribution(0, 1, 1))  # set aside as evidence


def test_the_default_bound_admits_what_adamw_can_do_and_refuses_1e30():
    cfg = config_from_dict({})
    bound = codec.max_update(cfg)
    h, lr = cfg.inner.steps, cfg.inner.lr
    assert h * lr < bound < 1e3  # every step at the peak rate, in one direction, is inside
    topk = config_from_dict({"round": {"contribution": "delta", "codec": "topk"}})
    assert codec.max_update(topk) == pytest.approx(bound * min(topk.rounds, 1 / (1 - 0.9)))  # what feedback carries
    assert codec.max_update(config_from_dict({"round": {"max_update": 5.0}})) == 5.0
    with pytest.raises(Exception, match="more than a round of inner training can"):
        codec.check_bound("f", "w", torch.tensor([0.0, -1e30]), bound)
    assert codec.check_bound("f", "w", torch.tensor([0.1, -0.2]), bound) == pytest.approx(0.2)


def test_adamw_never_moves_an_entry_past_the_bound_in_a_real_round(tmp_path):
    """The oracle: torch.optim.AdamW itself, H steps of adversarial gradients (a spike, then tiny
    ones, which maximise |m| / sqrt(v)), stays inside the derived bound with its margin."""
    cfg = config_from_dict({"inner": {"steps": 25, "lr": 3e-3, "beta2": 0.999}})
    p = torch.nn.Parameter(torch.zeros(4))
    opt = torch.optim.AdamW([p], lr=cfg.inner.lr, betas=(cfg.inner.beta1, cfg.inner.beta2),
                            weight_decay=cfg.inner.weight_decay)
    for i in range(cfg.inner.steps):
        p.grad = torch.full((4,), 1e3 if i == 0 else 1e-3)
        opt.step()
    assert float(p.detach().abs().max()) < codec.max_update(cfg) / 10  # within the bound before its x10 margin


def _overflowing(tmp_path):
    s = Storage(str(tmp_path))
    write_checkpoint(s, "g.safetensors", {"w": torch.ones(3)}, manifest={"round": 0})
    for w, v in enumerate((-9.0, 0.9)):
        write_checkpoint(s, f"c{w}.safetensors", {"w": torch.full((3,), v)}, manifest={"round": 0})
    return s


def test_a_round_whose_step_overflows_is_refused_whole_naming_the_input_farthest_out(tmp_path):
    from core.config import OuterConfig
    s = _overflowing(tmp_path)
    acc = RunningSum(s, "g.safetensors")
    spec = RoundSpec(base="g.safetensors", out="g1.safetensors", outer=OuterConfig(optimizer="sgd", lr=1e38, momentum=0.0),
                     state_out="s1.safetensors")
    with pytest.raises(QuorumError) as exc:  # worker 0 moves each entry by 10, worker 1 by 0.1
        acc.merge([Contribution(0, "c0.safetensors", 1.0, 10.0), Contribution(1, "c1.safetensors", 1.0, 10.0)], spec)
    assert list(exc.value.rejected) == [0] and "not finite" in exc.value.rejected[0]
    assert not s.exists("g1.safetensors")


# -- a worker's own state --------------------------------------------------------------------------

def _state(value) -> dict[str, torch.Tensor]:
    return {"w::exp_avg": torch.zeros(3), "w::exp_avg_sq": torch.ones(3), "w::step": torch.tensor(3.0),
            FEEDBACK + "w": value}


STATES = {  # what a damaged or forged state file holds -> what the refusal says
    "feedback-1e30": (_state(torch.full((3,), 1e30)), "error-feedback buffer"),
    "feedback-nan": (_state(torch.tensor([0.0, math.nan, 0.0])), "NaN or Inf"),
    "feedback-bool": (_state(torch.tensor([True, False, True])), "not floating point"),
    "negative-exp-avg-sq": ({**_state(torch.zeros(3)), "w::exp_avg_sq": -torch.ones(3)}, "negative"),
}


@pytest.mark.parametrize("case", sorted(STATES))
def test_a_damaged_state_snapshot_is_set_aside_and_the_one_before_is_used(tmp_path, case, caplog):
    s = Storage(str(tmp_path))
    write_checkpoint(s, L.worker_state(1, 0), _state(torch.full((3,), 0.01)), manifest={"round": 0, "worker": 1})
    bad, why = STATES[case]
    write_checkpoint(s, L.worker_state(1, 1), bad, manifest={"round": 1, "worker": 1})
    with caplog.at_level(logging.WARNING):
        key, tensors = usable_state(s, 1, 2, feedback_bound=1.0)
    assert key == L.worker_state(1, 0) and float(tensors[FEEDBACK + "w"][0]) == pytest.approx(0.01)
    assert why in caplog.text and "state_00001" in caplog.text and "round 0, an older snapshot" in caplog.text
    assert read_manifest(s, L.worker_state(1, 1)) is None  # set aside: never read again
    reasons = [n for n in s.list(f"{L.worker_dir(1)}/rejected") if n.endswith(".reason.json")]
    assert len(reasons) == 1 and why in s.read_json(f"{L.worker_dir(1)}/rejected/{reasons[0]}")["reason"]


def test_with_no_usable_snapshot_the_worker_says_it_starts_fresh(tmp_path, caplog):
    s = Storage(str(tmp_path))
    write_checkpoint(s, L.worker_state(1, 0), STATES["feedback-nan"][0], manifest={"round": 0, "worker": 1})
    with caplog.at_level(logging.WARNING):
        assert usable_state(s, 1, 1, feedback_bound=1.0) is None
    assert "fresh AdamW state" in caplog.text


def test_a_real_worker_with_a_forged_feedback_buffer_trains_its_round_from_fresh_state(tmp_path, corpus_cache, caplog):
    """The worker's one entry point (worker.train) goes through the check: round 1 of a top-k run
    whose round-0 state file carries a 1e30 buffer trains and publishes a bounded contribution."""
    s = _worker_run(tmp_path, corpus_cache, "run", round={"contribution": "delta", "codec": "topk", "topk": 0.1})
    train.run_worker(_task(s, 0))
    state, _, m = load_checkpoint(s, L.worker_state(0, 0))
    forged = {k: torch.full_like(v, 1e30) if k.startswith(FEEDBACK) else v for k, v in state.items()}
    write_checkpoint(s, L.worker_state(0, 0), forged, manifest={k: v for k, v in m.items() if k in ("round", "worker")})
    write_checkpoint(s, L.global_weights(1), load_checkpoint(s, L.global_weights(0))[0], manifest={"round": 1})
    with caplog.at_level(logging.WARNING):
        train.run_worker(_task(s, 1))
    assert "error-feedback buffer" in caplog.text and "fresh AdamW state" in caplog.text
    cfg = train.load_run_config(s)
    acc = RunningSum(s, L.global_weights(1))
    assert acc.add(Contribution(0, L.contribution(1, 0), 1.0, codec.max_update(cfg))), acc.rejected


def test_a_damaged_in_flight_checkpoint_is_set_aside_and_the_round_starts_from_its_base(tmp_path, caplog):
    from worker.state import inflight_tensors
    s = Storage(str(tmp_path))
    key = L.worker_inflight(1, 3)
    write_checkpoint(s, key, _state(torch.tensor([0.0, math.nan, 0.0])),
                     manifest={"round": 3, "worker": 1, "steps_done": 4, "base_digest": "a" * 32})
    assert inflight_tensors(s, key, "in-flight", "b" * 32, 25, 1.0) is None  # another base: not this round's, kept
    assert read_manifest(s, key) is not None
    with caplog.at_level(logging.WARNING):
        assert inflight_tensors(s, key, "in-flight", "a" * 32, 25, 1.0) is None
    assert "NaN or Inf" in caplog.text and read_manifest(s, key) is None  # set aside: the requeue starts the round over
    write_checkpoint(s, key, _state(torch.zeros(3)), manifest={"round": 3, "worker": 1, "steps_done": 99,
                                                                 "base_digest": "a" * 32})
    assert inflight_tensors(s, key, "in-flight", "a" * 32, 25, 1.0) is None and read_manifest(s, key) is None
    write_checkpoint(s, key, _state(torch.zeros(3)), manifest={"round": 3, "worker": 1, "steps_done": 4,
                                                                 "base_digest": "a" * 32})
    assert set(inflight_tensors(s, key, "in-flight", "a" * 32, 25, 1.0)) == set(_state(torch.zeros(3)))


def test_a_round_whose_eval_is_not_finite_is_recorded_as_missing_and_the_record_loads(tmp_path):
    """A record never carries a non-finite figure (its loader would refuse the whole record)."""
    from orchestrator.lease import acquire
    from orchestrator.loop import Service
    s = Storage(str(tmp_path / "run"))
    cfg = load_config(None, {"workers": 2, "rounds": 1, "executor.kind": "local", "run_dir": s.url}, SETS[:-1])
    write_checkpoint(s, L.global_weights(0), G0, manifest={"round": 0})
    lease = acquire(s)
    try:
        service = Service(lease, cfg, Scripted({}))
        service.evaluator.metrics = lambda storage, key: {"loss": math.inf, "accuracy": math.nan, "kept": 0.5}
        service.run()
    finally:
        lease.release()
    rec = RoundRecord.load(s, 0)
    assert rec.eval_loss is None and rec.eval_metrics == {"kept": 0.5}


def test_the_outer_gradient_norm_is_finite_for_finite_gradients_past_float32s_square():
    """Entries of 1e20 square past float32's range; the norm is summed in float64."""
    from core.checkpoint_writer import OutputFile
    from core.config import OuterConfig
    from merge.outer import OuterStep
    s = Storage("memory://grad-norm")
    step = OuterStep([OutputFile(s, "g.safetensors", [("w", "F32", (4,), 16)], None, {})], None,
                     OuterConfig(optimizer="sgd", lr=1e-30, momentum=0.0))
    step.step("w", torch.zeros(4), torch.full((4,), 1e20), {})
    step.finish()
    step.commit()
    assert step.grad_sq ** 0.5 == pytest.approx(2e20)


def test_io_counters_are_reported_at_exit_only_when_asked(tmp_path):
    import subprocess
    import sys
    code = ("from core import iostat; iostat.report_at_exit('worker'); open('/proc/self/io').read(); "
            "held = b'1' * (200 << 20)")  # 200 MiB resident at its peak
    root = Path(__file__).resolve().parent.parent
    subprocess.run([sys.executable, "-c", code], cwd=root, check=True, env={**os.environ, "ISLANDS_IO_REPORT": str(tmp_path)})
    (report,) = tmp_path.glob("worker-*.json")
    got = json.loads(report.read_text())
    assert got["role"] == "worker" and got["rchar"] > 0 and got["wchar"] >= 0
    assert 200 << 20 < got["maxrss"] < 2 << 30  # the process's peak resident memory, in bytes
    subprocess.run([sys.executable, "-c", code], cwd=root, check=True, env={k: v for k, v in os.environ.items()
                                                                             if k != "ISLANDS_IO_REPORT"})
    assert len(list(tmp_path.glob("*.json"))) == 1
