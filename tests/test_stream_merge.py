"""The merge service folds contributions into the running sum as they land (round.stream_merge).

The real Service (orchestrator.loop) against a fake executor whose jobs are threads publishing hand-made
contributions (tests/test_contributions.py's Scripted): the order the contributions are summed in
is the order they landed, it is recorded, and the same inputs merged without streaming, in that
order, give the same bytes; with stream_merge off the order is the workers'. A corrupt
contribution that was folded while the service waited never counts.
"""
from __future__ import annotations

import time

import pytest
import torch

from core.checkpoint import load_checkpoint, read_manifest
from core.checkpoint_writer import write_checkpoint
from core.config import load_config
from core.layout import RunLayout, manifest_key
from core.storage import Storage
from merge.rounds import Contribution, merge_round
from merge.round_spec import RoundSpec
from service_support import WORK, Scripted, publish, scripted_run

L = RunLayout()
pytestmark = pytest.mark.slow
G0 = {"w": torch.tensor([1.0, 2.0, 3.0]), "b": torch.tensor([0.5])}


def _late(seconds: float, delta: float):
    def work(s, t):
        time.sleep(seconds)
        publish(s, t.round, t.worker, t.base_key, delta)
    return work


def _run(tmp_path, behaviour, stream: bool, quorum: int = 3) -> Storage:
    return scripted_run(tmp_path, Scripted(behaviour), [
        "round.poll_s=0.05", "round.max_retries=0", f"round.min_workers={quorum}", f"round.stream_merge={str(stream).lower()}",
        "outer.optimizer=nesterov", "outer.weighting=tokens"], workers=3, g0=G0)


def _same_as_replay(s: Storage, order: list[int]) -> bool:
    """The committed global equals, bit for bit, a non-streamed merge of the same inputs in `order`."""
    weights = s.read_json(L.round_record(0))["weights"]
    contribs = [Contribution(w, L.contribution(0, w), weights[str(w)]) for w in order]
    merge_round(s,
                RoundSpec(base=L.global_weights(0), out="replay.safetensors", outer=load_config().outer,
                          state_out="replay_state.safetensors"), contribs)
    got, again = load_checkpoint(s, L.global_weights(1))[0], load_checkpoint(s, "replay.safetensors")[0]
    return got.keys() == again.keys() and all(torch.equal(got[k].view(torch.int32), again[k].view(torch.int32))
                                              for k in got)


@pytest.mark.parametrize("stream", [True, False])
def test_sum_order_is_arrival_order_when_streaming_and_a_replay_gives_the_same_bytes(tmp_path, stream):
    s = _run(tmp_path, {0: _late(1.0, 0.3), 1: _late(0.5, -0.7)}, stream)  # worker 2 lands first, 0 last
    rec = s.read_json(L.round_record(0))
    assert rec["merged"] == [0, 1, 2]
    assert rec["merge_order"] == ([2, 1, 0] if stream else [0, 1, 2])
    assert _same_as_replay(s, rec["merge_order"])
    mean = (G0["w"] + 0.3 + G0["w"] - 0.7 + G0["w"] - 0.5) / 3  # equal tokens
    # first Nesterov step (lr .7, momentum .9): g - 1.33 (g - mean)
    assert torch.allclose(load_checkpoint(s, L.global_weights(1))[0]["w"], G0["w"] - 1.33 * (G0["w"] - mean), atol=1e-6)


def test_a_corrupt_contribution_folded_while_waiting_never_counts(tmp_path):
    def corrupt(s, t):  # published with a manifest whose digest is that of the bytes before damage
        tmp = Storage(str(tmp_path / "scratch"))
        key = L.contribution(t.round, t.worker)
        write_checkpoint(tmp, key, {k: v + 5.0 for k, v in load_checkpoint(s, t.base_key)[0].items()},
                         manifest={"round": t.round, "worker": t.worker, **WORK,
                                   "base_digest": read_manifest(s, t.base_key)["digest"]})
        raw = bytearray(tmp.read_bytes(key))
        raw[-2] ^= 0x55
        s.write_bytes(key, bytes(raw))
        s.write_json(manifest_key(key), tmp.read_json(manifest_key(key)))

    s = _run(tmp_path, {1: corrupt, 0: _late(1.0, 0.3)}, stream=True, quorum=2)
    rec = s.read_json(L.round_record(0))
    assert rec["merged"] == [0, 2] and rec["rejected"] == [1]
    assert "checksum does not match" in rec["rejected_reasons"]["1"]
    assert _same_as_replay(s, rec["merge_order"])
