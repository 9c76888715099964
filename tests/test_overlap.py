"""Overlapped rounds (round.overlap, worker/overlap.py): the adoption arithmetic by hand, the
configuration it needs, and a live run on the local executor."""
from __future__ import annotations

import pytest
import torch

from core.config import load_config
from core.errors import ConfigError
from worker.overlap import adopt


def test_rebase_keeps_the_steps_taken_since_publishing():
    p = {"w": torch.tensor([1.0, 2.0]), "n": torch.tensor([3])}  # published at the end of round r
    theta = {"w": torch.tensor([1.5, 1.0]), "n": torch.tensor([3])}  # after steps ahead: s1 = [0.5, -1]
    g = {"w": torch.tensor([0.0, 4.0]), "n": torch.tensor([7])}  # global_{r+1}
    out = adopt(theta, p, g, "rebase")
    assert torch.equal(out["w"], torch.tensor([0.5, 3.0])) and torch.equal(out["n"], torch.tensor([7]))


def test_mix_blends_with_the_global():
    theta, g = {"w": torch.tensor([2.0, 0.0])}, {"w": torch.tensor([0.0, 4.0])}
    assert torch.equal(adopt(theta, theta, g, "mix", 0.25)["w"], torch.tensor([0.5, 3.0]))  # 0.75 g + 0.25 theta
    assert torch.equal(adopt(theta, theta, g, "mix", 0.0)["w"], g["w"])


def test_a_step_taken_between_publishing_and_adopting_is_counted_once():
    """Round r's contribution is p (the step s1 after it is not in it); round r+1's, minus its base
    g, is s1 + s2 (the step before adopting and the one after): s1 in exactly one contribution."""
    p, s1, s2, g = torch.tensor([1.0]), torch.tensor([0.25]), torch.tensor([-0.5]), torch.tensor([3.0])
    contribution_r = p
    adopted = adopt({"w": p + s1}, {"w": p}, {"w": g}, "rebase")["w"]
    contribution_r1 = adopted + s2
    assert torch.equal(contribution_r, p)
    assert torch.equal(contribution_r1 - g, s1 + s2)


@pytest.mark.parametrize("overrides, pattern", [
    (["round.overlap=rebase", "round.worker_mode=per_round"], "needs persistent workers"),
    (["round.overlap=rebase", "algorithm=lte"], "not lte"),
    (["round.overlap=mix", "executor.tasks_per_node=2"], "2 rank"),
    (["round.overlap=mix", "round.overlap_mix=1.5"], "overlap_mix must be in"),
    (["round.overlap=mix", "round.overlap_ahead=0"], "overlap_ahead must be in"),
])
def test_what_overlap_needs_is_checked(overrides, pattern):
    with pytest.raises(ConfigError, match=pattern):
        load_config(None, None, overrides)


def test_the_live_view_says_when_a_published_worker_trains_ahead():
    from orchestrator.run_view import worker_state
    beat = {"round": 4, "step": 17, "steps": 30, "loss": 2.5, "ahead": True}
    assert worker_state(0, 3, {0}, beat) == "published; training ahead, step 17"
    assert worker_state(0, 3, {0}, {**beat, "ahead": False}) == "published"  # adopted round 4's global: its own row
    assert worker_state(0, 4, set(), beat) == "step 17/30, loss 2.500"
    assert worker_state(0, 3, {0}, None) == "published"
