"""Stragglers: a worker 10x slower than the others, rounds closed at the deadline with the quorum,
its late contribution dropped or folded into a later round with a staleness weight.

The merge service runs for real (RoundService, merge engine, storage) against a fake executor whose
"jobs" are threads writing hand-made contributions: global + a constant delta per worker, so every
expected global value is worked out by hand below. Outer SGD at lr 1.0 makes the new global the
weighted mean of the merge inputs.
"""
from __future__ import annotations

import pytest
import torch

from core.checkpoint import load_checkpoint, read_manifest
from core.checkpoint_writer import write_checkpoint
from core.config import load_config
from core.layout import RunLayout
from core.storage import Storage
from merge.late import rebase
from orchestrator.late import prepare_folds
from orchestrator.plan import Fold, fold_plan, next_bases
from service_support import G0, ThreadExecutor, scripted_run

L = RunLayout()
DEADLINE = 2.0


def _run(tmp_path, policy: str) -> tuple[Storage, ThreadExecutor]:
    ex = ThreadExecutor()
    s = scripted_run(tmp_path, ex, [
        "round.min_workers=2", "round.worker_mode=per_round", f"round.deadline_s={DEADLINE}", f"round.late_policy={policy}",
        "round.poll_s=0.05", "round.staleness_decay=0.5", "outer.optimizer=sgd", "outer.lr=1.0", "outer.weighting=uniform"],
        workers=3, rounds=3)
    return s, ex


def _global(s: Storage, r: int) -> dict[str, torch.Tensor]:
    return load_checkpoint(s, L.global_weights(r))[0]


@pytest.mark.slow
def test_straggler_dropped_at_the_deadline(tmp_path):
    s, ex = _run(tmp_path, "drop")
    for r in range(3):
        rec = s.read_json(L.round_record(r))
        assert rec["merged"] == [0, 1] and rec["dropped"] == [2] and rec["folded"] == []
        assert "straggler" in rec["dropped_reasons"]["2"] and "cancelled" in rec["dropped_reasons"]["2"]
    # each round: mean of the two on-time deltas, (-0.25 - 0.5) / 2 = -0.375; three rounds: -1.125
    g3 = _global(s, 3)
    assert torch.equal(g3["w"], G0["w"] - 1.125) and torch.equal(g3["b"], G0["b"] - 1.125)
    assert len(ex.cancelled) == 3  # worker 2's job, every round
    assert not s.exists(L.contribution(0, 2))  # its work never published
    assert {b for r, w, b in ex.submitted if w == 2} == {L.global_weights(r) for r in range(3)}


@pytest.mark.slow
def test_straggler_folded_into_the_next_round_with_a_staleness_weight(tmp_path):
    s, ex = _run(tmp_path, "fold")
    rec0, rec1, rec2 = (s.read_json(L.round_record(r)) for r in range(3))
    assert rec0["merged"] == [0, 1] and rec0["folded"] == [] and "folded in later" in rec0["dropped_reasons"]["2"]
    # round 1 folds worker 2's round-0 work, one round late: weight 1 * 0.5 ** 1
    assert [(f["worker"], f["from_round"], f["staleness"], f["weight"]) for f in rec1["folded"]] == [(2, 0, 1, 0.5)]
    assert [(f["worker"], f["from_round"]) for f in rec2["folded"]] == [(2, 1)]
    # round 0: -0.375 (as dropped). Rounds 1 and 2: worker 2's pseudo-gradient -1.0 relative to ITS base
    # joins at weight 0.5: (-0.25 - 0.5 + 0.5 * -1.0) / (1 + 1 + 0.5) = -0.5 each. Total -1.375.
    g1, g2, g3 = _global(s, 1), _global(s, 2), _global(s, 3)
    assert torch.equal(g1["w"], G0["w"] - 0.375)
    assert torch.allclose(g2["w"], G0["w"] - 0.875, atol=1e-6)
    assert torch.allclose(g3["w"], G0["w"] - 1.375, atol=1e-6) and torch.allclose(g3["b"], G0["b"] - 1.375, atol=1e-6)
    # the virtual input is kept: G_1 + (W - B), W trained from G_0
    v = load_checkpoint(s, L.folded_contribution(1, 2, 0))[0]
    assert torch.allclose(v["w"], g1["w"] - 1.0)
    # stragglers ran on (not cancelled) except in the last round, where nothing could fold them
    assert len(ex.cancelled) == 1


def test_fold_plan_orders_and_weights_late_contributions():
    unmerged = {0: [3, 1], 1: [2], 2: [1]}
    plan = fold_plan(3, unmerged, {(1, 2)}, decay=0.5, max_staleness=2)
    # round 0 is 3 rounds late (> max_staleness): dropped; (1, 2) was folded before
    assert plan == [Fold(2, 1, 1, 0.5)]
    plan = fold_plan(3, unmerged, set(), decay=0.5, max_staleness=4)
    assert [(f.from_round, f.worker, f.factor) for f in plan] == [(0, 1, 0.125), (0, 3, 0.125), (1, 2, 0.25), (2, 1, 0.5)]


def test_next_bases_fold_and_drop_restart_from_the_global():
    late = {2: "rounds/00000/contrib/worker_002.safetensors"}
    for policy in ("drop", "fold", "restart"):
        assert next_bases(3, [0, 1], late, policy, "G") == {0: "G", 1: "G", 2: "G"}
    assert next_bases(3, [0, 1], late, "continue", "G")[2] == late[2]


def _late_round(s: Storage, record, base_sha: str | None = None) -> None:
    """Round 0 merged workers 0 and 1 at G1; worker 2's contribution (from G0) arrived after."""
    write_checkpoint(s, L.global_weights(0), G0, manifest={"round": 0})
    write_checkpoint(s, L.global_weights(1), {k: v - 0.375 for k, v in G0.items()}, manifest={"round": 1})
    sha = read_manifest(s, L.global_weights(0))["digest"]
    s.write_json(L.round_jobs(0), {"round": 0, "workers": {"2": {"base": L.global_weights(0), "base_digest": sha,
                                                                  "job_ids": ["7"], "attempts": 1}}})
    s.write_json(L.round_record(0), record(0, merged=[0, 1], rejected=[], dropped=[2]))
    write_checkpoint(s, L.contribution(0, 2), {k: v - 1.0 for k, v in G0.items()},
                     manifest={"round": 0, "worker": 2, "steps": 25, "tokens": 25 * 16 * 128, "base_digest": base_sha or sha})


def test_late_contribution_from_the_wrong_base_is_not_folded(mem, round_record):
    _late_round(mem, round_record, base_sha="0" * 64)
    cfg = load_config(None, {"workers": 3}, ["round.late_policy=fold"])
    folded, refused = prepare_folds(mem, cfg, 1)
    assert folded == [] and refused[0]["worker"] == 2 and "stale late contribution" in refused[0]["reason"]


def test_late_contribution_with_nan_is_not_folded_and_nothing_is_published(mem, round_record):
    _late_round(mem, round_record)
    bad = {"w": torch.tensor([1.0, float("nan"), 3.0]), "b": torch.tensor([0.5])}
    write_checkpoint(mem, L.contribution(0, 2), bad, manifest={"round": 0, "worker": 2, "steps": 25, "tokens": 25 * 16 * 128,
                     "base_digest": read_manifest(mem, L.global_weights(0))["digest"]})
    folded, refused = prepare_folds(mem, load_config(None, {"workers": 3}, ["round.late_policy=fold"]), 1)
    assert folded == [] and "NaN or Inf" in refused[0]["reason"]
    assert read_manifest(mem, L.folded_contribution(1, 2, 0)) is None


def test_rebase_is_global_plus_the_late_delta(mem, round_record):
    _late_round(mem, round_record)
    rebase(mem, L.global_weights(1), L.contribution(0, 2), L.global_weights(0), "v.safetensors")
    v = load_checkpoint(mem, "v.safetensors")[0]
    assert torch.equal(v["w"], G0["w"] - 0.375 - 1.0) and torch.equal(v["b"], G0["b"] - 1.375)


def test_a_late_contribution_whose_reads_stall_is_not_folded(mem, stall_reads, round_record):
    _late_round(mem, round_record)
    stall_reads(L.contribution(0, 2))
    folded, refused = prepare_folds(mem, load_config(None, {"workers": 3}, ["round.late_policy=fold"]), 1)
    assert folded == [] and "it stalls" in refused[0]["reason"], refused
    assert read_manifest(mem, L.folded_contribution(1, 2, 0)) is None
