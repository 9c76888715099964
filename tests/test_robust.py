"""round.aggregate (#28): the median and trimmed mean of a round's contributions, by hand, against
a numpy float64 oracle (Flower's FedMedian / FedTrimmedAvg definitions), through real merges of
weights, coded deltas and a late delta against another base; and one outlier that a mean follows
and they do not. The live run with a planted outlier is in tests/test_e2e_local.py."""
from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from core import codec
from core.checkpoint import load_checkpoint, read_manifest
from core.checkpoint_writer import write_checkpoint
from core.config import OuterConfig, load_config
from core.errors import ConfigError
from merge.methods import sorted_elementwise, sorting_network
from merge.robust import aggregate, trimmed_mean
from merge.rounds import Contribution, merge_round
from merge.round_spec import QuorumError, RoundSpec

FEDAVG = OuterConfig(optimizer="sgd", lr=1.0)  # the new global is the aggregate itself


def _np_trimmed(x: np.ndarray, trim: float) -> np.ndarray:
    k = x.shape[0]
    cut = int(trim * k)
    return np.sort(x, axis=0)[cut:k - cut].mean(axis=0)


def test_by_hand():
    # Prepare: one element, values 1, 2, 3, 100
    vals = [torch.tensor([1.0]), torch.tensor([2.0]), torch.tensor([3.0]), torch.tensor([100.0])]
    # Execute / Assert: median of four = mean of the middle two; trim 0.25 drops 1 and 100
    assert aggregate(vals, "median", 0.0).item() == 2.5
    assert aggregate(vals, "trimmed_mean", 0.25).item() == 2.5
    assert aggregate(vals, "trimmed_mean", 0.2).item() == 26.5  # int(0.2 * 4) = 0: the plain mean
    assert aggregate(vals[:3], "median", 0.0).item() == 2.0
    with pytest.raises(ValueError, match="leaves nothing"):
        trimmed_mean(torch.stack(vals[:2]), 0.5)


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 7).flatmap(lambda k: st.tuples(
    st.lists(st.lists(st.floats(-1e3, 1e3, width=32), min_size=4, max_size=4), min_size=k, max_size=k),
    st.floats(0, 0.49))))
def test_property_equals_numpy_float64(data):
    rows, trim = data
    x = np.array(rows, dtype=np.float64)
    vals = [torch.tensor(r, dtype=torch.float32) for r in rows]
    assert np.allclose(aggregate(vals, "median", trim).double().numpy(), np.median(x, axis=0), rtol=1e-6, atol=1e-4)
    assert np.allclose(aggregate(vals, "trimmed_mean", trim).double().numpy(), _np_trimmed(x, trim), rtol=1e-6, atol=1e-4)


def test_the_sorting_network_sorts_every_zero_one_input():
    """By the 0-1 principle a compare-exchange network sorts every input iff it sorts every input
    of 0s and 1s: checked exhaustively for 1..12 inputs (the pairs past n dropped for n not a power of 2)."""
    for n in range(1, 13):
        net = sorting_network(n)
        assert all(0 <= i < j < n for i, j in net)
        for bits in itertools.product((0, 1), repeat=n):
            x = list(bits)
            for i, j in net:
                x[i], x[j] = min(x[i], x[j]), max(x[i], x[j])
            assert x == sorted(bits), (n, bits)
    assert [len(sorting_network(n)) for n in (1, 2, 4, 8, 16)] == [0, 1, 5, 19, 63]  # Batcher's counts


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 20).flatmap(lambda k: st.lists(
    st.lists(st.sampled_from([-2.5, -1.0, 0.0, 1.0, 3.0]) | st.floats(allow_nan=False, allow_infinity=False, width=32), min_size=3, max_size=3),
    min_size=k, max_size=k)))
def test_sorted_elementwise_equals_torch_sort(rows):
    """Ties and wide values included: the same values as torch.sort along the stacked dimension."""
    x = torch.tensor(rows, dtype=torch.float32)
    got = sorted_elementwise(list(x.unbind(0)))
    assert torch.equal(torch.stack(got), x.sort(dim=0).values)


def _round(mem, coding=None, outlier=50.0):
    torch.manual_seed(0)
    g = {"w": torch.randn(6, 8), "b": torch.randn(8), "step": torch.tensor(3)}
    write_checkpoint(mem, "g0.safetensors", g, manifest={"round": 0})
    sha = read_manifest(mem, "g0.safetensors")["digest"]
    workers = [{n: (v + 0.05 * torch.randn(v.shape)) if v.is_floating_point() else v for n, v in g.items()}
               for _ in range(4)]
    workers.append({n: (v + outlier) if v.is_floating_point() else v for n, v in g.items()})  # diverged
    cs = []
    for i, w in enumerate(workers):
        if coding is None:
            write_checkpoint(mem, f"c{i}.safetensors", w, manifest={"round": 0})
        else:
            tensors, meta, _ = codec.encode(g, w, codec.Encoding(coding, 1.0, sha))
            write_checkpoint(mem, f"c{i}.safetensors", tensors, metadata=meta, manifest={"round": 0, "base": "g0.safetensors"})
        cs.append(Contribution(i, f"c{i}.safetensors", float(i + 1)))
    return g, workers, cs


@pytest.mark.parametrize("coding", [None, "fp32"])
@pytest.mark.parametrize("how", ["median", "trimmed_mean"])
def test_a_round_follows_the_majority_not_the_outlier(mem, coding, how):
    g, workers, cs = _round(mem, coding)
    res = merge_round(mem,
                      RoundSpec(base="g0.safetensors", out="g1.safetensors", outer=FEDAVG, state_out="s1.safetensors",
                                aggregate=how, trim=0.2), cs)
    assert res.merged == [0, 1, 2, 3, 4] and res.rejected == {} and res.manifest["aggregate"] == how
    got = load_checkpoint(mem, "g1.safetensors")[0]
    for n in ("w", "b"):
        x = np.stack([w[n].double().numpy() for w in workers])
        want = np.median(x, axis=0) if how == "median" else _np_trimmed(x, 0.2)  # unweighted
        assert np.allclose(got[n].double().numpy(), want, atol=1e-5), n
        assert float((got[n] - g[n]).abs().max()) < 0.3  # the outlier moved every entry by 50
    assert torch.equal(got["step"], g["step"])
    mean = merge_round(mem,
                       RoundSpec(base="g0.safetensors", out="m1.safetensors", outer=FEDAVG,
                                 state_out="t1.safetensors"), cs)
    assert "aggregate" not in mean.manifest
    assert float((load_checkpoint(mem, "m1.safetensors")[0]["w"] - g["w"]).abs().min()) > 10  # weight 5/15 on +50


def _late(mem):
    """_round's, worker 1's a delta against its own weights B (b.safetensors): a worker that
    missed the last round (late_policy continue)."""
    g, workers, cs = _round(mem, "fp32")
    b = {n: (t + 0.2) if t.is_floating_point() else t for n, t in g.items()}
    write_checkpoint(mem, "b.safetensors", b, manifest={"round": 0})
    tensors, meta, _ = codec.encode(b, workers[1], codec.Encoding("fp32", 1.0, read_manifest(mem, "b.safetensors")["digest"]))
    write_checkpoint(mem, "late.safetensors", tensors, metadata=meta, manifest={"round": 0, "base": "b.safetensors"})
    cs[1] = Contribution(1, "late.safetensors", 2.0)
    return g, workers, cs


def test_a_late_delta_against_another_base_joins_the_median(mem):
    """A worker that missed a round sends a delta against its own weights B: decoded whole, its
    weights enter the median like anyone's."""
    g, workers, cs = _late(mem)
    merge_round(mem,
                RoundSpec(base="g0.safetensors", out="g1.safetensors", outer=FEDAVG, state_out="s1.safetensors",
                          aggregate="median"), cs)
    x = np.stack([w["w"].double().numpy() for w in workers])
    assert np.allclose(load_checkpoint(mem, "g1.safetensors")[0]["w"].double().numpy(), np.median(x, axis=0), atol=1e-5)


def test_config_refuses_what_a_robust_aggregate_cannot_do():
    with pytest.raises(ConfigError) as e:
        load_config(None, None, ["round.aggregate=median", "round.late_policy=fold", "round.trim=0.5"])
    text = str(e.value)
    assert "round.aggregate=median is unweighted" in text and "round.trim must be in [0, 0.5)" in text
    with pytest.raises(ConfigError, match="does not apply to lte"):
        load_config(None, None, ["round.aggregate=trimmed_mean", "algorithm=lte"])
    assert load_config(None, None, ["round.aggregate=trimmed_mean", "round.trim=0.1"]).round.trim == 0.1


def _folded(mem):
    """A median round whose five contributions are folded already (a RunningSum, as the service
    streams them), and its spec."""
    from merge.rounds import RunningSum
    _, _, cs = _round(mem, "fp32")
    acc = RunningSum(mem, "g0.safetensors")
    assert all(acc.add(c) for c in cs)
    spec = RoundSpec(base="g0.safetensors", out="g1.safetensors", outer=FEDAVG, state_out="s1.safetensors",
                     aggregate="median", min_inputs=1)
    return acc, cs, spec


def test_a_contribution_whose_reads_stall_at_the_aggregate_refuses_the_round_naming_it(mem, stall_reads):
    """The aggregate reads every contribution again: a read that stalls there (a hung NFS server)
    fails after merge.reading.STALL_S with the worker named, as a fold's does, instead of holding
    the service; nothing is published and the run goes on (QuorumError: the worker runs again)."""
    acc, cs, spec = _folded(mem)
    stall_reads("c2.safetensors")
    with pytest.raises(QuorumError) as e:
        merge_round(mem, spec, cs, acc)
    assert list(e.value.rejected) == [2] and "stalls" in e.value.rejected[2] and "c2.safetensors" in e.value.rejected[2]
    assert not mem.exists("g1.safetensors") and not mem.exists("g1.json")


@pytest.mark.parametrize("stalled", ["late.safetensors", "b.safetensors"])
@pytest.mark.parametrize("when", ["fold", "aggregate"])
def test_a_late_delta_whose_reads_stall_is_refused_naming_its_worker(mem, stall_reads, stalled, when):
    """A delta against another base is decoded whole with that base, at its fold and again at the
    aggregate: a read of either file that stalls fails after merge.reading.STALL_S naming the worker
    instead of holding the service (stall_reads fails the test if it is read on this thread)."""
    from merge.rounds import RunningSum
    _, _, cs = _late(mem)
    acc = RunningSum(mem, "g0.safetensors")
    spec = RoundSpec(base="g0.safetensors", out="g1.safetensors", outer=FEDAVG, state_out="s1.safetensors",
                     aggregate="median", min_inputs=1)
    if when == "fold":
        stall_reads(stalled)
        assert [acc.add(c) for c in cs] == [True, False, True, True, True]
        assert "worker 1" in acc.rejected[1][1] and "it stalls" in acc.rejected[1][1], acc.rejected
        assert merge_round(mem, spec, cs[:1] + cs[2:], acc).merged == [0, 2, 3, 4]
        return
    assert all(acc.add(c) for c in cs)
    stall_reads(stalled)
    with pytest.raises(QuorumError) as e:
        merge_round(mem, spec, cs, acc)
    assert list(e.value.rejected) == [1] and "it stalls" in e.value.rejected[1], e.value.rejected
    assert not mem.exists("g1.safetensors")


@pytest.mark.parametrize("last, why", [(b"\x00\x00\xc0\x7f", "not finite now though it was at its fold"),
                                       (b"\x00\x00\x80\x3f", "checksum")])
def test_a_contribution_altered_in_place_after_its_fold_refuses_the_round_naming_it(mem, last, why):
    """Its bytes change after it was folded, its manifest not (a co-tenant, a half-synced client):
    the round is refused with the worker named instead of stopping the service, and nothing is
    published. A NaN is named as its value is read (before it spreads through the aggregate to
    the global); a finite value (1.0) by the digest check once everything is read."""
    acc, cs, spec = _folded(mem)
    raw = bytearray(mem.read_bytes("c3.safetensors"))
    raw[-4:] = last  # the last float
    mem.write_bytes("c3.safetensors", bytes(raw))
    with pytest.raises(QuorumError) as e:
        merge_round(mem, spec, cs, acc)
    assert list(e.value.rejected) == [3] and why in e.value.rejected[3], e.value.rejected
    assert not mem.exists("g1.safetensors")
