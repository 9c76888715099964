"""Compressed contributions (core/codec.py) and the running-sum merge (merge/rounds.py).

Codec maths on hand-worked tensors; round merges from coded deltas against an independent oracle:
plain torch on the full tensors and torch.optim.SGD(nesterov=True) stepped directly.
"""
from __future__ import annotations

import math
import re

import pytest
import torch

from core import codec
from core.checkpoint import load_checkpoint, read_manifest
from core.checkpoint_writer import write_checkpoint
from core.config import OuterConfig, load_config
from core.errors import CheckpointError, ConfigError
from merge.rounds import Contribution, merge_round
from merge.round_spec import QuorumError, RoundSpec
from merge import reading, rounds
from merge.rounds import RunningSum

from codec_support import NESTEROV, meta_changed, merge_g0, publish_delta


# -- the codec on hand-worked tensors ---------------------------------------------------------
def test_int8_row_by_hand():
    q, scale = codec.quantize_int8(torch.tensor([[1.0, -0.5, 0.25, 0.0], [0.0, 0.0, 0.0, 0.0]]))
    assert scale.tolist() == pytest.approx([1 / 127, 0.0])
    # -0.5 * 127 = -63.5 rounds half to even (-64); 0.25 * 127 = 31.75 -> 32; the zero row stays zero
    assert q.tolist() == [[127, -64, 32, 0], [0, 0, 0, 0]]
    back = codec.dequantize_int8(q, scale)
    assert torch.allclose(back[0], torch.tensor([1.0, -64 / 127, 32 / 127, 0.0]))
    assert back[1].abs().sum() == 0


def test_int8_error_is_at_most_half_a_step_per_row():
    torch.manual_seed(0)
    v = torch.randn(64, 200) * torch.logspace(-6, 2, 64)[:, None]  # rows of very different sizes
    q, scale = codec.quantize_int8(v)
    err = (codec.dequantize_int8(q, scale) - v).abs()
    step = v.abs().amax(dim=1) / 127
    assert torch.all(err <= step[:, None] / 2 * (1 + 1e-5))
    assert int(q.abs().max()) == 127


def test_prune_keeps_exactly_the_top_fraction_of_each_row():
    v = torch.tensor([[0.1, -3.0, 2.0, 0.5, -0.2], [1.0, 0.0, 0.0, 0.0, -1.5]])
    enc = codec.Encoding("fp32", 0.4, "x")
    assert enc.layout((2, 5)).k == 2  # each row a chunk of its own: 2 of its 5 kept
    pos, vals = codec.sparse_tensor("w", (2, 5), enc, codec.encode_tensor("w", v, enc).__getitem__)
    assert pos.tolist() == [1, 2, 5, 9] and vals.tolist() == [-3.0, 2.0, 1.0, -1.5]
    torch.manual_seed(1)
    big = torch.randn(16, 300)
    enc = codec.Encoding("fp32", 0.1, "x")
    k = enc.layout((16, 300)).k
    dense = codec.decode_tensor("w", (16, 300), enc, codec.encode_tensor("w", big, enc).__getitem__)
    assert k == 30 and all(int((row != 0).sum()) == k for row in dense)
    threshold = big.abs().sort(dim=1, descending=True).values[:, k - 1: k]  # the k-th largest magnitude
    assert torch.equal(dense != 0, big.abs() >= threshold)
    assert torch.equal(dense[dense != 0], big[dense != 0])  # kept entries are exact in fp32


@pytest.mark.parametrize("name", ["fp32", "bf16", "int8"])
@pytest.mark.parametrize("keep", [1.0, 0.25])
def test_stored_entries_match_their_specs_and_decode(name, keep):
    torch.manual_seed(2)
    base = {"w": torch.randn(6, 40), "b": torch.randn(40), "s": torch.randn(()), "n": torch.arange(3)}
    weights = {k: (v + 0.01 * torch.randn(v.shape) if v.is_floating_point() else v) for k, v in base.items()}
    tensors, meta, _ = codec.encode(base, weights, codec.Encoding(name, keep, "abc"))
    enc = codec.encoding_of(meta, "t")
    from core.checkpoint import DTYPES
    spec = codec.stored_specs({k: (DTYPES[v.dtype], tuple(v.shape)) for k, v in base.items()}, enc)
    assert {k: (DTYPES[t.dtype], tuple(t.shape)) for k, t in tensors.items()} == spec
    assert torch.equal(tensors["n"], base["n"])
    d = codec.decode_tensor("w", (6, 40), enc, tensors.__getitem__)
    if name == "fp32" and keep == 1.0:
        assert torch.equal(d, base["w"] - weights["w"])


# -- a round merged from coded deltas ----------------------------------------------------------
def _oracle(g: dict, workers: list[dict], weights: list[float], cfg: OuterConfig, deltas=None) -> dict:
    """torch.optim on the full tensors: grad = weighted mean of the deltas (default: g - w)."""
    params = {k: torch.nn.Parameter(v.clone()) for k, v in g.items()}
    opt = torch.optim.SGD(list(params.values()), lr=cfg.lr, momentum=cfg.momentum, nesterov=True)
    deltas = deltas or [{k: g[k] - w[k] for k in g} for w in workers]
    for k, p in params.items():
        p.grad = sum(wt * d[k] for wt, d in zip(weights, deltas)) / sum(weights)
    opt.step()
    return {k: p.detach() for k, p in params.items()}


def _setup(mem, k=3, seed=0):
    torch.manual_seed(seed)
    g = {"a.w": torch.randn(8, 33), "a.b": torch.randn(33), "c": torch.randn(())}
    write_checkpoint(mem, "g0.safetensors", g, manifest={"round": 0})
    workers = [{n: v + 0.05 * torch.randn(v.shape) for n, v in g.items()} for _ in range(k)]
    return g, workers, read_manifest(mem, "g0.safetensors")["digest"]


def _publish(mem, key, g, w, sha, name=None, keep=1.0):
    if name is None:
        write_checkpoint(mem, key, w, manifest={"round": 0})
        return key
    return publish_delta(mem, key, g, w, codec.Encoding(name, keep, sha))


_merge = merge_g0


def test_fp32_delta_round_equals_weights_round_and_the_oracle(mem):
    g, workers, sha = _setup(mem)
    wts = [1.0, 2.0, 0.5]  # not summing to 1
    plain = [Contribution(i, _publish(mem, f"w{i}.safetensors", g, w, sha), wts[i]) for i, w in enumerate(workers)]
    coded = [Contribution(i, _publish(mem, f"d{i}.safetensors", g, w, sha, "fp32"), wts[i]) for i, w in enumerate(workers)]
    res_w, res_d = _merge(mem, plain, "g1.safetensors"), _merge(mem, coded, "h1.safetensors")
    assert res_w.merged == res_d.merged == [0, 1, 2] and res_d.rejected == {}
    oracle = _oracle(g, workers, wts, NESTEROV)
    got_w, got_d = load_checkpoint(mem, "g1.safetensors")[0], load_checkpoint(mem, "h1.safetensors")[0]
    for n in g:
        assert torch.allclose(got_d[n], oracle[n], atol=1e-6), n
        assert torch.allclose(got_w[n], oracle[n], atol=1e-6), n
    # the delta path feeds the mean delta to .grad directly: momentum buffer == the oracle's grad
    mom = load_checkpoint(mem, "state_h1.safetensors")[0]["a.w::momentum_buffer"]
    mean_delta = sum(wt * (g["a.w"] - w["a.w"]) for wt, w in zip(wts, workers)) / sum(wts)
    assert torch.allclose(mom, mean_delta, atol=1e-6)


@pytest.mark.parametrize("name, rel", [("bf16", 2 ** -8), ("int8", None)])
def test_bf16_and_int8_rounds_stay_within_their_bounds(mem, name, rel):
    g, workers, sha = _setup(mem, seed=3)
    coded = [Contribution(i, _publish(mem, f"d{i}.safetensors", g, w, sha, name), 1.0) for i, w in enumerate(workers)]
    _merge(mem, coded)
    oracle = _oracle(g, workers, [1.0] * 3, NESTEROV)
    got = load_checkpoint(mem, "g1.safetensors")[0]
    step = NESTEROV.lr * (1 + NESTEROV.momentum)  # first nesterov step: g - lr (1 + m) grad
    for n, t in g.items():
        deltas = [(t - w[n]).reshape(codec.rows_of(tuple(t.shape))) for w in workers]
        # per element: bf16 keeps 8 significant bits (relative error <= 2^-9, bound with slack 2^-8);
        # int8 errs by at most half a step of its row's max / 127
        bound = sum((d.abs() * rel) if rel else (d.abs().amax(dim=1, keepdim=True) / 254).expand_as(d)
                    for d in deltas) / 3
        err = (got[n] - oracle[n]).reshape(bound.shape).abs()
        assert torch.all(err <= step * bound + 1e-6), (n, float((err - step * bound).max()))
    assert not all(torch.equal(got[n], oracle[n]) for n in g)  # it did lose something


def test_pruned_int8_round_equals_the_oracle_on_pruned_deltas(mem):
    g, workers, sha = _setup(mem, seed=4)
    coded = [Contribution(i, _publish(mem, f"d{i}.safetensors", g, w, sha, "fp32", keep=0.3), 1.0)
             for i, w in enumerate(workers)]
    _merge(mem, coded)
    pruned = []
    for w in workers:  # independent pruning: zero all but the ceil(0.3 n) largest |delta| of each row
        d = {}
        for n, t in g.items():
            full = (t - w[n]).reshape(codec.rows_of(tuple(t.shape)))
            k = math.ceil(0.3 * full.shape[1])
            thr = full.abs().sort(dim=1, descending=True).values[:, k - 1: k]
            d[n] = torch.where(full.abs() >= thr, full, torch.zeros(())).reshape(t.shape)
        pruned.append(d)
    oracle = _oracle(g, workers, [1.0] * 3, NESTEROV, deltas=pruned)
    got = load_checkpoint(mem, "g1.safetensors")[0]
    assert all(torch.allclose(got[n], oracle[n], atol=1e-6) for n in g)


# -- the running sum: order, rejections, replaced files ----------------------------------------
def _bytes(mem, key):
    return mem.read_bytes(key)


def test_streamed_sum_is_bitwise_the_merge_of_the_same_order(mem):
    g, workers, sha = _setup(mem, k=4, seed=5)
    cs = [Contribution(i, _publish(mem, f"w{i}.safetensors", g, w, sha), float(100 + 7 * i)) for i, w in enumerate(workers)]
    acc = RunningSum(mem, "g0.safetensors")
    for i in (2, 0, 3):  # as they landed
        assert acc.add(cs[i])
    streamed = _merge(mem, cs, "g1.safetensors", accumulator=acc)  # worker 1 is folded at the merge
    assert streamed.order == [2, 0, 3, 1] and streamed.merged == [0, 1, 2, 3]
    _merge(mem, [cs[i] for i in (2, 0, 3, 1)], "h1.safetensors")  # non-incremental, same order
    assert _bytes(mem, "g1.safetensors") == _bytes(mem, "h1.safetensors")
    assert _bytes(mem, "state_g1.safetensors") == _bytes(mem, "state_h1.safetensors")
    assert read_manifest(mem, "g1.safetensors")["merge_order"] == [2, 0, 3, 1]
    oracle = _oracle(g, workers, [c.weight for c in cs], NESTEROV)
    assert all(torch.allclose(load_checkpoint(mem, "g1.safetensors")[0][n], oracle[n], atol=1e-6) for n in g)


def test_a_contribution_found_corrupt_after_being_added_never_counts(mem):
    g, workers, sha = _setup(mem, seed=6)
    cs = [Contribution(i, _publish(mem, f"w{i}.safetensors", g, w, sha), 1.0) for i, w in enumerate(workers)]
    raw = bytearray(mem.read_bytes("w1.safetensors"))
    raw[-3] ^= 0xFF  # in the last tensor: every other tensor of it is summed before the digest fails
    mem.fs.pipe_file(mem.path("w1.safetensors"), bytes(raw))
    acc = RunningSum(mem, "g0.safetensors")
    assert acc.add(cs[0]) and not acc.add(cs[1]) and acc.add(cs[2])
    assert "checksum does not match" in acc.rejected[1][1]
    res = _merge(mem, cs, accumulator=acc)
    assert res.merged == [0, 2] and "checksum does not match" in res.rejected[1]
    _merge(mem, [cs[0], cs[2]], "h1.safetensors")
    assert _bytes(mem, "g1.safetensors") == _bytes(mem, "h1.safetensors")


def test_a_last_contribution_found_corrupt_publishes_nothing_of_it(mem):
    g, workers, sha = _setup(mem, seed=15)
    cs = [Contribution(i, _publish(mem, f"w{i}.safetensors", g, w, sha), 1.0) for i, w in enumerate(workers)]
    raw = bytearray(mem.read_bytes("w2.safetensors"))
    raw[-3] ^= 0xFF  # the digest fails only after every tensor was added
    mem.fs.pipe_file(mem.path("w2.safetensors"), bytes(raw))
    acc = RunningSum(mem, "g0.safetensors")
    assert acc.add(cs[0]) and acc.add(cs[1])
    res = _merge(mem, cs, accumulator=acc)
    assert res.merged == [0, 1] and "checksum does not match" in res.rejected[2]
    assert read_manifest(mem, "g1.safetensors")["merge_order"] == [0, 1]
    _merge(mem, cs[:2], "h1.safetensors")
    assert _bytes(mem, "g1.safetensors") == _bytes(mem, "h1.safetensors")
    assert _bytes(mem, "state_g1.safetensors") == _bytes(mem, "state_h1.safetensors")


def test_a_contribution_replaced_after_folding_is_summed_as_it_is_now(mem):
    g, workers, sha = _setup(mem, k=2, seed=7)
    cs = [Contribution(i, _publish(mem, f"w{i}.safetensors", g, w, sha), 1.0) for i, w in enumerate(workers)]
    acc = RunningSum(mem, "g0.safetensors")
    assert acc.add(cs[0]) and acc.add(cs[1])
    workers[0] = {n: v + 1.0 for n, v in workers[0].items()}
    _publish(mem, "w0.safetensors", g, workers[0], sha)  # a requeued job published again
    _merge(mem, cs, accumulator=acc)
    oracle = _oracle(g, workers, [1.0, 1.0], NESTEROV)
    assert all(torch.allclose(load_checkpoint(mem, "g1.safetensors")[0][n], oracle[n], atol=1e-6) for n in g)


def _second_round(mem, seed):
    """Round 0 merged (it writes the outer state), and round 1's contributions against its result."""
    g, workers, sha = _setup(mem, k=3, seed=seed)
    _merge(mem, [Contribution(i, _publish(mem, f"w{i}.safetensors", g, w, sha), 1.0) for i, w in enumerate(workers)])
    g1 = load_checkpoint(mem, "g1.safetensors")[0]
    sha1 = read_manifest(mem, "g1.safetensors")["digest"]
    return [Contribution(i, _publish(mem, f"v{i}.safetensors", g1, {n: t + 0.03 * (i + 1) for n, t in g1.items()}, sha1),
                         float(1 + i)) for i in range(3)]


def _round1(mem, contribs, out, acc=None):
    return merge_round(mem,
                       RoundSpec(base="g1.safetensors", out=out, outer=NESTEROV, state_in="state_g1.safetensors",
                                 state_out="state_" + out), contribs, acc)


def test_held_global_and_state_are_stepped_in_place_and_give_the_same_bytes(mem):
    cs = _second_round(mem, seed=11)
    acc = RunningSum(mem, "g1.safetensors", state_key="state_g1.safetensors", preload=True)
    assert set(acc.held) == {"g1.safetensors", "state_g1.safetensors"}
    held = {key: tensors for key, (_, tensors) in acc.held.items()}
    for c in cs[:2]:
        assert acc.add(c)
    _round1(mem, cs, "g2.safetensors", acc)
    _round1(mem, cs, "h2.safetensors")  # nothing held: both read from storage, stepped on copies
    assert _bytes(mem, "g2.safetensors") == _bytes(mem, "h2.safetensors")
    assert _bytes(mem, "state_g2.safetensors") == _bytes(mem, "state_h2.safetensors")
    # the step ran in the held copies: they hold the new global and state now (their float
    # tensors: the files hold nothing else here), and are no longer held as round 1's
    for old_key, new_key in [("g1.safetensors", "g2.safetensors"), ("state_g1.safetensors", "state_g2.safetensors")]:
        f, new = held[old_key], load_checkpoint(mem, new_key)[0]
        assert all(torch.equal(f[n], new[n]) for n in f), old_key
    assert acc.held == {}
    _round1(mem, cs, "k2.safetensors", acc)  # the same merge again reads round 1's files
    assert _bytes(mem, "k2.safetensors") == _bytes(mem, "h2.safetensors")
    assert _bytes(mem, "state_k2.safetensors") == _bytes(mem, "state_h2.safetensors")


def test_a_last_contribution_refused_is_left_out_exactly(mem):
    cs = _second_round(mem, seed=14)
    g1 = load_checkpoint(mem, "g1.safetensors")[0]
    bad = {n: t + 0.03 for n, t in g1.items()}
    bad["c"] = torch.tensor(float("nan"))  # the last tensor: the others were added by then
    _publish(mem, cs[2].key, g1, bad, "unused")
    acc = RunningSum(mem, "g1.safetensors", state_key="state_g1.safetensors", preload=True)
    for c in cs[:2]:
        assert acc.add(c)
    res = _round1(mem, cs, "g2.safetensors", acc)
    assert res.merged == [0, 1] and "NaN" in res.rejected[2]
    _round1(mem, cs[:2], "h2.safetensors")  # the two good ones, from storage
    assert _bytes(mem, "g2.safetensors") == _bytes(mem, "h2.safetensors")
    assert _bytes(mem, "state_g2.safetensors") == _bytes(mem, "state_h2.safetensors")


def test_an_overflowing_in_place_step_is_refused_and_publishes_nothing(mem):
    cs = _second_round(mem, seed=15)
    g1 = load_checkpoint(mem, "g1.safetensors")[0]
    for c in cs:
        _publish(mem, c.key, g1, {n: t + 2.0 for n, t in g1.items()}, "unused")
    acc = RunningSum(mem, "g1.safetensors", state_key="state_g1.safetensors", preload=True)
    huge = OuterConfig(optimizer="nesterov", lr=1e38, momentum=0.9)  # lr x grad x (1 + m) > float32's max
    # the round is refused whole, naming the input farthest out (all tie here: the first folded)
    with pytest.raises(QuorumError, match="worker 0: its outer gradient .* made the merged global weights not finite: "
                                          ".*has NaN or Inf values although every input is finite: the outer merge overflowed"):
        merge_round(mem,
                    RoundSpec(base="g1.safetensors", out="g2.safetensors", outer=huge,
                              state_in="state_g1.safetensors", state_out="state_g2.safetensors"), cs, acc)
    assert not mem.exists("g2.safetensors") and not mem.exists("state_g2.safetensors")
    assert acc.held == {}


def test_a_held_state_replaced_on_storage_is_read_again(mem):
    cs = _second_round(mem, seed=12)
    acc = RunningSum(mem, "g1.safetensors", state_key="state_g1.safetensors", preload=True)
    state = load_checkpoint(mem, "state_g1.safetensors")[0]
    write_checkpoint(mem, "state_g1.safetensors", {n: t * 2 for n, t in state.items()}, manifest={"optimizer": "nesterov"})
    _round1(mem, cs, "g2.safetensors", acc)
    _round1(mem, cs, "h2.safetensors")
    assert _bytes(mem, "g2.safetensors") == _bytes(mem, "h2.safetensors")


def test_a_damaged_state_is_not_held_and_the_merge_names_it(mem, caplog):
    cs = _second_round(mem, seed=13)
    raw = bytearray(mem.read_bytes("state_g1.safetensors"))
    raw[-2] ^= 0x01
    mem.fs.pipe_file(mem.path("state_g1.safetensors"), bytes(raw))
    acc = RunningSum(mem, "g1.safetensors", state_key="state_g1.safetensors", preload=True)
    assert "state_g1.safetensors" not in acc.held
    assert "cannot hold the outer state in memory" in caplog.text
    with pytest.raises(CheckpointError, match=r"outer optimizer state .*state_g1\.safetensors.*checksum does not match"):
        _round1(mem, cs, "g2.safetensors", acc)
    assert not mem.exists("g2.safetensors")


def _nan_value(tensors, meta):
    rows = tensors["a.w"].clone()
    rows[0, 4:8] = torch.tensor([float("nan")]).view(torch.uint8)  # the first kept value, fp32
    tensors["a.w"] = rows
    return meta


@pytest.mark.parametrize("damage, reason", [
    (_nan_value, "tensor a.w: a kept value is NaN or Inf"),
    (meta_changed(chunk=4096), "unknown contribution coding"),
    (meta_changed(layout=None), "without a layout was written by an older islands"),
    (lambda t, m: t.__setitem__("a.w", t["a.w"][:, :-1].contiguous()) or m, r"a\.w is U8\[8, 48\]"),
])
def test_a_damaged_pruned_contribution_is_one_rejection_with_its_reason(mem, damage, reason):
    """A pruned delta is stored as top-k chunks a row long (core/topk.py), and refused as they are."""
    g, workers, sha = _setup(mem, k=2, seed=11)
    enc = codec.Encoding("fp32", 0.3, sha)
    # a row of 33 keeps 10: its scale, 10 fp32 values and their offsets as a bitmap of 33 bits (5
    # bytes; Elias-Fano's code would take 6: l = 1 low bit each, 2 bytes, and a high field of
    # 10 + (33 >> 1) = 26 bits, 4 bytes)
    assert codec.stored_specs({"a.w": ("F32", (8, 33))}, enc) == {"a.w": ("U8", (8, 4 + 40 + 5))}
    good = Contribution(0, _publish(mem, "d0.safetensors", g, workers[0], sha, "fp32", keep=0.3), 1.0)
    tensors, meta, _ = codec.encode(g, workers[1], enc)
    meta = damage(tensors, meta)
    write_checkpoint(mem, "d1.safetensors", tensors, metadata=meta,
                     manifest={"round": 0, "base": "g0.safetensors", "base_digest": sha})
    res = _merge(mem, [good, Contribution(1, "d1.safetensors", 1.0)])
    assert res.merged == [0] and re.search(reason, res.rejected[1]), res.rejected


def test_a_coded_contribution_with_wrong_entries_is_rejected_with_the_tensor_named(mem):
    g, workers, sha = _setup(mem, k=2, seed=8)
    good = Contribution(0, _publish(mem, "d0.safetensors", g, workers[0], sha, "int8"), 1.0)
    tensors, meta, _ = codec.encode(g, workers[1], codec.Encoding("int8", 1.0, sha))
    del tensors["a.w::scale"]
    write_checkpoint(mem, "d1.safetensors", tensors, metadata=meta, manifest={"round": 0})
    res = _merge(mem, [good, Contribution(1, "d1.safetensors", 1.0)])
    assert res.merged == [0] and "a.w::scale" in res.rejected[1]


def test_a_worker_continues_from_its_own_coded_contribution(mem):
    g, workers, sha = _setup(mem, k=1, seed=9)
    _publish(mem, "d0.safetensors", g, workers[0], sha, "int8")
    got = codec.load_weights(mem, "d0.safetensors")
    for n, t in g.items():
        rows = codec.rows_of(tuple(t.shape))
        d = (t - workers[0][n]).reshape(rows)
        err = (got[n] - workers[0][n]).reshape(rows).abs()
        assert torch.all(err <= d.abs().amax(dim=1, keepdim=True) / 254 + 1e-6)
    write_checkpoint(mem, "g0.safetensors", {n: t + 1 for n, t in g.items()}, manifest={"round": 0})
    with pytest.raises(Exception, match="replaced"):  # its base changed under it: refused, not mis-decoded
        codec.load_weights(mem, "d0.safetensors")


@pytest.mark.parametrize("sets, msg", [
    (["round.codec=int8"], "round.codec=int8 codes the outer gradient: it needs round.contribution=delta"),
    (["round.prune_keep=0.5"], "round.prune_keep=0.5 codes the outer gradient: it needs round.contribution=delta"),
    (["round.contribution=delta", "round.prune_keep=0"], "round.prune_keep must be in"),
    (["round.contribution=delta", "algorithm=lte"], "does not apply to lte"),
])
def test_config_refuses_codec_combinations_that_mean_nothing(sets, msg):
    with pytest.raises(ConfigError, match=msg):
        load_config(None, None, sets)
    assert load_config(None, None, ["round.contribution=delta", "round.codec=int8", "round.prune_keep=0.25"])


def test_outer_gradient_reads_coded_and_plain_contributions_alike(mem):
    from core.checkpoint import open_checkpoint
    g, workers, sha = _setup(mem, k=1, seed=10)
    _publish(mem, "w0.safetensors", g, workers[0], sha)
    _publish(mem, "d0.safetensors", g, workers[0], sha, "fp32")
    with open_checkpoint(mem, "w0.safetensors") as plain, open_checkpoint(mem, "d0.safetensors") as coded:
        for n, t in g.items():
            want = t.double() - workers[0][n].double()
            assert torch.allclose(codec.outer_gradient(plain, n, t), want)
            assert torch.allclose(codec.outer_gradient(coded, n, t), want, atol=1e-7)
        coded.verify()


def test_a_delta_against_another_base_is_decoded_whole_and_rebased_on_the_global(mem):
    """late_policy continue: a worker that missed round r-1 trains round r from its own weights B,
    so its delta is against B, not the round's global G: it enters as G - (B - delta)."""
    g, workers, sha = _setup(mem, k=2, seed=11)
    b = {n: t + 0.2 for n, t in g.items()}  # its own older weights
    write_checkpoint(mem, "b.safetensors", b, manifest={"round": 0})
    b_sha = read_manifest(mem, "b.safetensors")["digest"]
    c0 = Contribution(0, _publish(mem, "d0.safetensors", g, workers[0], sha, "fp32"), 1.0)
    tensors, meta, _ = codec.encode(b, workers[1], codec.Encoding("fp32", 1.0, b_sha))
    write_checkpoint(mem, "d1.safetensors", tensors, metadata=meta, manifest={"round": 0, "base": "b.safetensors"})
    res = _merge(mem, [c0, Contribution(1, "d1.safetensors", 1.0)])
    assert res.merged == [0, 1] and res.order == [0, 1]
    oracle = _oracle(g, workers, [1.0, 1.0], NESTEROV)
    assert all(torch.allclose(load_checkpoint(mem, "g1.safetensors")[0][n], oracle[n], atol=1e-5) for n in g)


@pytest.mark.parametrize("coding", [None, "fp32", "bf16", "int8"])
def test_a_fold_in_slices_gives_the_bytes_of_whole_tensors(mem, monkeypatch, coding):
    """Large tensors stored alone are folded in slices of FOLD_CHUNK elements: made 100 here, a.w (8 x 33 = 264 elements) is cut unevenly (100, 100, 64),
    the smaller ones are read whole, and int8 tensors (rows with their scales) always are. Same
    bytes as whole tensors, same oracle."""
    g, workers, sha = _setup(mem, k=3, seed=21)
    cs = [Contribution(i, _publish(mem, f"w{i}.safetensors", g, w, sha, coding), float(2 + i)) for i, w in enumerate(workers)]
    whole = RunningSum(mem, "g0.safetensors")
    assert whole.add(cs[0]) and whole.add(cs[1])
    _merge(mem, cs, "g1.safetensors", accumulator=whole)
    monkeypatch.setattr(reading, "FOLD_CHUNK", 100)
    sliced = RunningSum(mem, "g0.safetensors")
    assert sliced.add(cs[0]) and sliced.add(cs[1])
    reads = []
    real = rounds.RunningSum._add

    def add(self, c, label, name, x, start=0, stop=None):
        if stop is not None and stop - start < math.prod(self.ref[name].shape):  # a slice
            reads.append((name, start, stop))
        return real(self, c, label, name, x, start, stop)
    monkeypatch.setattr(rounds.RunningSum, "_add", add)
    res = _merge(mem, cs, "h1.safetensors", accumulator=sliced)  # worker 2 folds at the merge, in slices
    assert res.merged == [0, 1, 2]
    assert _bytes(mem, "g1.safetensors") == _bytes(mem, "h1.safetensors")
    assert _bytes(mem, "state_g1.safetensors") == _bytes(mem, "state_h1.safetensors")
    want = [] if coding == "int8" else [("a.w", 0, 100), ("a.w", 100, 200), ("a.w", 200, 264)]  # a.b: 33 <= 100
    assert reads == want
    if coding is None:
        oracle = _oracle(g, workers, [c.weight for c in cs], NESTEROV)
        assert all(torch.allclose(load_checkpoint(mem, "h1.safetensors")[0][n], oracle[n], atol=1e-6) for n in g)
