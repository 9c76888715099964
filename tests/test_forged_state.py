"""A forged or damaged optimizer-state snapshot whose digest matches its manifest is checked like a
contribution before any tensor reaches AdamW (worker/state.py): names, shapes and dtypes against
the live model, AdamW's three slots, the step count a whole number, the moments within what
training leaves (|exp_avg| <= C(t) sqrt(exp_avg_sq), exp_avg_sq <= grad_clip^2), and the
manifest's worker and round. A refused one is set aside and the job goes on from fresh state,
saying so in the log and in its contribution's manifest; it never crashes inside AdamW.

Oracle: torch.optim.AdamW's own moments after real steps pass the check (hypothesis).
Live: the real worker (worker.train) on the built-in model, its round-0 snapshot forged.
"""
from __future__ import annotations

import logging

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import worker.train as train
from core.checkpoint import load_checkpoint, read_manifest
from core.checkpoint_writer import write_checkpoint
from core.errors import CheckpointError
from core.layout import RunLayout
from core.shards import remove_checkpoint
from test_resident import _run as _worker_run, _task
from worker.state import Expect, check_state

L = RunLayout()


def _adamw_state(grads: list[torch.Tensor], betas: tuple[float, float], clip: float) -> dict[str, torch.Tensor]:
    p = torch.nn.Parameter(torch.zeros(grads[0].shape))
    opt = torch.optim.AdamW([p], lr=1e-3, betas=betas)
    for g in grads:
        p.grad = g.clone()
        if clip:
            torch.nn.utils.clip_grad_norm_([p], clip)
        opt.step()
    return {f"w::{slot}": t.clone() for slot, t in opt.state[p].items()}


def _expect(shape=(4,), betas=(0.9, 0.95), clip=0.0) -> Expect:
    return Expect(0, {"w": (shape, torch.float32)}, {"w": shape}, frozenset({"w"}), betas, 1e-8, clip)


@settings(max_examples=60, deadline=None)
@given(steps=st.integers(1, 12), b1=st.sampled_from([0.0, 0.5, 0.9, 0.95]), b2=st.sampled_from([0.9, 0.95, 0.999]),
       scale=st.sampled_from([1e-12, 1e-3, 1.0, 1e4]), constant=st.booleans(), clip=st.sampled_from([0.0, 1.0]),
       seed=st.integers(0, 2**16))
def test_honest_adamw_moments_pass_the_check(steps, b1, b2, scale, constant, clip, seed):
    """Constant gradients reach the bound's equality at the first step; random ones stay inside."""
    gen = torch.Generator().manual_seed(seed)
    g0 = torch.randn(4, generator=gen) * scale
    grads = [g0 if constant else torch.randn(4, generator=gen) * scale for _ in range(steps)]
    check_state(_adamw_state(grads, (b1, b2), clip), "honest", 1.0, _expect(betas=(b1, b2), clip=clip))


def test_moments_no_training_leaves_are_refused():
    honest = _adamw_state([torch.ones(4)], (0.9, 0.95), 0.0)  # m = 0.1, v = 0.05: at the bound
    for edit, clip, why in [({"w::exp_avg": honest["w::exp_avg"] * 1.2}, 0.0, "exp_avg exceeds"),
                            ({"w::exp_avg": torch.full((4,), 3e38), "w::exp_avg_sq": torch.full((4,), 3e38)}, 0.0,
                             "exp_avg exceeds"),
                            ({"w::exp_avg_sq": torch.full((4,), 2.0)}, 1.0, "inner.grad_clip")]:
        with pytest.raises(CheckpointError, match=why):
            check_state({**honest, **edit}, "forged", 1.0, _expect(clip=clip))


# what a forged round-0 snapshot of the 1-layer model holds -> what the refusal says
def _short(state):
    k = next(k for k in state if k.endswith("::exp_avg") and state[k].dim() == 2)
    return {**state, k: state[k][:-1]}, "has shape"


FORGERIES = {
    "a moment one row short": _short,
    "no exp_avg_sq": lambda s: ({k: v for k, v in s.items() if not k.endswith("::exp_avg_sq")}, "without exp_avg_sq"),
    "a parameter the model lacks": lambda s: ({**s, "nope.weight::exp_avg": torch.zeros(3)}, "does not train"),
    "a step of three elements": lambda s: ({**s, **{k: torch.ones(3) for k in s if k.endswith("::step")}},
                                           "step count"),
    "moments of 3e38": lambda s: ({k: torch.full_like(v, 3e38) if "::exp_avg" in k else v for k, v in s.items()},
                                  "more than inner.grad_clip 1 squared"),
    "an exp_avg of 3e38": lambda s: ({k: torch.full_like(v, 3e38) if k.endswith("::exp_avg") else v
                                      for k, v in s.items()}, "exp_avg exceeds"),
}


@pytest.fixture(scope="module")
def trained_round0(tmp_path_factory, corpus_cache):
    """A run whose worker 0 trained round 0 (its snapshot written), and round 1's global."""
    s = _worker_run(tmp_path_factory.mktemp("forged"), corpus_cache, "run")
    train.run_worker(_task(s, 0))
    write_checkpoint(s, L.global_weights(1), load_checkpoint(s, L.global_weights(0))[0], manifest={"round": 1})
    state, _, manifest = load_checkpoint(s, L.worker_state(0, 0))
    return s, state, manifest


def _round1_from(s, tensors, manifest, caplog) -> dict:
    """Worker 0's round 1 (a new job: its state from storage) from a planted round-0 snapshot."""
    remove_checkpoint(s, L.contribution(1, 0))
    write_checkpoint(s, L.worker_state(0, 0), tensors, manifest=manifest)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        train.run_worker(_task(s, 1))
    return read_manifest(s, L.contribution(1, 0))


@pytest.mark.parametrize("case", sorted(FORGERIES))
def test_a_forged_snapshot_is_refused_and_the_round_trains_from_fresh_state(trained_round0, case, caplog):
    s, state, manifest = trained_round0
    forged, why = FORGERIES[case](dict(state))
    got = _round1_from(s, forged, {k: manifest[k] for k in ("round", "worker")}, caplog)
    assert why in caplog.text and "fresh AdamW state" in caplog.text
    assert got["state_refused_rounds"] == [0] and "state_from_round" not in got and got["state_fresh"] is True
    assert read_manifest(s, L.worker_state(0, 0)) is None  # set aside with its reason, never read again
    reasons = [n for n in s.list(f"{L.worker_dir(0)}/rejected") if n.endswith(".reason.json")]
    assert any(why in s.read_json(f"{L.worker_dir(0)}/rejected/{n}")["reason"] for n in reasons)


def test_another_workers_snapshot_copied_in_is_refused_and_the_honest_one_is_taken(trained_round0, caplog):
    s, state, manifest = trained_round0
    got = _round1_from(s, state, {"round": 0, "worker": 1}, caplog)
    assert "names worker 1, not worker 0" in caplog.text and got["state_refused_rounds"] == [0]
    got = _round1_from(s, state, {"round": 0, "worker": 0}, caplog)  # the honest file: taken
    assert got["state_from_round"] == 0 and "state_refused_rounds" not in got


def test_the_record_and_status_say_where_a_workers_state_came_from_when_it_is_news():
    from orchestrator.round_merge import worker_state
    from orchestrator.status_cli import state_line
    manifests = {0: {"state_from_round": 3}, 1: {"state_fresh": True, "state_refused_rounds": [4, "x"]},
                 2: {}, 3: {"state_from_round": 2, "state_refused_rounds": [3]}, 4: {"state_from_round": "3\x1b[2J"}}
    said = worker_state(manifests, restart_only=True)
    assert said == {"0": "its snapshot of round 3", "1": "fresh AdamW state (refused: its snapshot of round 4)",
                    "3": "its snapshot of round 2 (refused: its snapshot of round 3)"}
    assert worker_state(manifests, restart_only=False) == {k: v for k, v in said.items() if k != "0"}  # per-round jobs
    assert state_line([{"round": 5, "worker_state": said}]) == (
        "optimizer state: round 5 worker 0: its snapshot of round 3; round 5 worker 1: fresh AdamW state (refused: its "
        "snapshot of round 4); round 5 worker 3: its snapshot of round 2 (refused: its snapshot of round 3)")
