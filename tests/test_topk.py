"""Top-k contributions with error feedback (core/topk.py, core/codec.py) and their sparse merge.

Hand-worked chunks, hypothesis properties of the coding, error feedback's bookkeeping, the running
sum against an oracle that decodes densely (plain torch, torch.optim.SGD for the outer step), and
each kind of damaged file refused with its reason.
"""
from __future__ import annotations

import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from core import codec, topk
from core.checkpoint import load_checkpoint, read_manifest
from core.checkpoint_writer import write_checkpoint
from core.config import load_config
from core.errors import CheckpointError, ConfigError
from core.layout import RunLayout
from core.storage import Storage
from merge.rounds import Contribution, RunningSum

from codec_support import merge_g0, meta_changed, publish_delta


def test_a_chunk_by_hand():
    """k = 2 of 4: -4 and 3; scale 4; 2 bits: step 2, levels -3, -1, 1, 3; codes 0 and 3 packed
    low bits first: 0 | 3 << 2 = 12. Offsets 1 and 3: in Elias-Fano's code, l = log2(4 / 2) = 1,
    low bits 1, 1 -> 0b11 = 3; high parts 0, 1 set bits 0 + 0 and 1 + 1 of a 2 + (4 >> 1) = 4-bit
    field -> 0b101 = 5: 2 bytes, where a bitmap of the chunk's 4 entries takes 1: bits 1 and 3 ->
    0b1010 = 10. The row: 4.0 as F32 little-endian (0x40800000), 12, 10. With 64 entries, -4 at 1
    and 3 at 63, Elias-Fano's code is the smaller (3 bytes against 8), and used: l = log2(64 / 2) = 5,
    low bits 1 and 31 -> 1 | 31 << 5 = 993 = 0x03E1; high parts 0, 1 -> bits 0 and 2 of a
    2 + (64 >> 5)-bit field -> 5. The row: 4.0, 12, 0xE1, 0x03, 5."""
    got = topk.encode(torch.tensor([0.0, -4.0, 1.0, 3.0]), 0.5, 2)
    assert got.dtype == torch.uint8 and got.tolist() == [[0, 0, 0x80, 0x40, 12, 10]]
    pos, vals = topk.sparse("x", 4, 0.5, 2, got)
    assert pos.tolist() == [1, 3] and vals.tolist() == [-3.0, 3.0]
    v = torch.zeros(64)
    v[1], v[63] = -4.0, 3.0
    got = topk.encode(v, 2 / 64, 2)
    assert got.tolist() == [[0, 0, 0x80, 0x40, 12, 0xE1, 0x03, 5]]
    pos, vals = topk.sparse("x", 64, 2 / 64, 2, got)
    assert pos.tolist() == [1, 63] and vals.tolist() == [-3.0, 3.0]


def test_layout_of_large_small_and_ragged_tensors():
    assert topk.layout(3 * 4096, 1 / 64) == topk.Layout(3 * 4096, 4096, 3, 64)
    assert topk.layout(128, 1 / 64) == topk.Layout(128, 128, 1, 2)  # smaller than a chunk: one chunk of its own
    assert topk.layout(4097, 1 / 64) == topk.Layout(4097, 4096, 2, 64)  # the last chunk: 1 real entry, padding
    assert topk.layout(5, 1.0).k == 5 and topk.layout(1, 0.01).k == 1


def _assert_each_chunks_largest(v: torch.Tensor, pos: torch.Tensor, lay: topk.Layout) -> None:
    """Each chunk of `v` kept exactly its k (or all, if fewer) entries of largest magnitude at `pos`."""
    for c in range(lay.chunks):
        chunk = v[c * lay.chunk:(c + 1) * lay.chunk].abs()
        mine = pos[(pos >= c * lay.chunk) & (pos < (c + 1) * lay.chunk)] - c * lay.chunk
        assert len(mine) == min(lay.k, len(chunk))
        rest = torch.ones(len(chunk), dtype=torch.bool)
        rest[mine] = False
        if rest.any():
            assert chunk[mine].min() >= chunk[rest].max()


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 9000), frac=st.sampled_from([1 / 64, 1 / 8, 0.5, 1.0]), bits=st.sampled_from([2, 4, 8]),
       seed=st.integers(0, 2**16))
def test_kept_entries_are_each_chunks_largest_and_within_half_a_step(n, frac, bits, seed):
    v = torch.randn(n, generator=torch.Generator().manual_seed(seed))
    lay = topk.layout(n, frac)
    got = topk.encode(v, frac, bits)
    assert tuple(got.shape) == (lay.chunks, lay.row_bytes(bits))
    scales = got[:, :4].reshape(-1).clone().view(torch.float32)
    pos, vals = topk.sparse("v", n, frac, bits, got)
    assert len(set(pos.tolist())) == len(pos) and all(0 <= p < n for p in pos.tolist())
    _assert_each_chunks_largest(v, pos, lay)
    for c in range(lay.chunks):
        step = 2 * scales[c] / (1 << bits)
        sel = (pos >= c * lay.chunk) & (pos < (c + 1) * lay.chunk)
        assert torch.all((vals[sel] - v[pos[sel]]).abs() <= step / 2 + 1e-6 * scales[c])  # fp32 rounding


def test_error_feedback_sends_what_it_left_out_later():
    """What is sent plus what is left is what was to be sent (decay x buffer + delta); with decay 1
    the sums over rounds of what was sent and of the deltas differ by the last buffer alone."""
    torch.manual_seed(0)
    base = {"w": torch.randn(64, 64), "n": torch.arange(3)}
    enc = codec.Encoding("topk", 1.0, "x", 1 / 64, 2)
    fb: codec.Feedback = {}
    sent_sum, delta_sum = torch.zeros(64, 64), torch.zeros(64, 64)
    for r in range(6):
        delta = torch.randn(64, 64)
        weights = {"w": base["w"] - delta, "n": base["n"]}
        before = {k: t.clone() for k, t in fb.items()}
        tensors, _, new = codec.encode(base, weights, enc, fb, decay=1.0)
        assert {k: t.tolist() for k, t in fb.items()} == {k: t.tolist() for k, t in before.items()}  # not changed
        sent = codec.decode_tensor("w", (64, 64), enc, tensors.__getitem__)
        torch.testing.assert_close(sent + new["w"], delta + before.get("w", torch.zeros(64, 64)))
        assert tensors["n"].tolist() == [0, 1, 2]  # not a float: as it is
        fb = new
        sent_sum += sent
        delta_sum += delta
    torch.testing.assert_close(sent_sum + fb["w"], delta_sum, rtol=1e-5, atol=1e-4)
    tensors, _, decayed = codec.encode(base, base, enc, fb, decay=0.5)  # no delta: half the buffer to send
    sent = codec.decode_tensor("w", (64, 64), enc, tensors.__getitem__)
    torch.testing.assert_close(sent + decayed["w"], 0.5 * fb["w"])
    with pytest.raises(CheckpointError, match="error feedback for tensor w has 8 entries"):
        codec.encode(base, weights, enc, {"w": torch.zeros(8)}, 1.0)


def test_in_place_feedback_is_the_same_buffer_holding_the_same_values():
    """in_place (a CPU worker, which holds one buffer instead of two): the new feedback is the
    old buffer, overwritten with what the copying encode returns, and the coded tensors are equal."""
    torch.manual_seed(1)
    base = {"w": torch.randn(32, 16), "b": torch.randn(16), "n": torch.arange(3)}
    weights = {k: v - 0.1 * torch.randn_like(v) if v.is_floating_point() else v for k, v in base.items()}
    enc = codec.Encoding("topk", 1.0, "x", 1 / 8, 4)
    fb = {"w": torch.randn(32, 16)}  # "b" has none yet: a new buffer is made for it
    copied, _, new = codec.encode(base, weights, enc, {k: t.clone() for k, t in fb.items()}, decay=0.9)
    held = fb["w"]
    coded, _, same = codec.encode(base, weights, enc, fb, decay=0.9, in_place=True)
    assert same is fb and same["w"] is held and same.keys() == new.keys() == {"w", "b"}
    assert all(torch.equal(same[k], new[k]) for k in new) and all(torch.equal(coded[k], copied[k]) for k in copied)


def _setup(mem, k=3, seed=0):
    torch.manual_seed(seed)
    g = {"a.w": torch.randn(96, 100), "a.b": torch.randn(100), "c": torch.randn(()), "n": torch.arange(4)}
    write_checkpoint(mem, "g0.safetensors", g, manifest={"round": 0})
    workers = [{n: v + 0.05 * torch.randn(v.shape) if v.is_floating_point() else v for n, v in g.items()}
               for _ in range(k)]
    return g, workers, read_manifest(mem, "g0.safetensors")["digest"]


ENC = dict(codec="topk", keep=1.0, topk=1 / 64, bits=4)


def _publish(mem, key, g, w, sha):
    return publish_delta(mem, key, g, w, codec.Encoding(**ENC, base_digest=sha))


_merge = merge_g0


def test_a_topk_round_equals_the_outer_step_on_the_decoded_mean(mem):
    """The merge scatters each contribution into the running sum; the oracle decodes each densely
    (codec.load_weights) and steps torch.optim.SGD on the weighted mean delta."""
    g, workers, sha = _setup(mem)
    wts = [1.0, 2.0, 0.5]
    cs = [Contribution(i, _publish(mem, f"d{i}.safetensors", g, w, sha), wts[i]) for i, w in enumerate(workers)]
    acc = RunningSum(mem, "g0.safetensors")
    for c in cs:
        assert acc.add(c)
    res = _merge(mem, cs, accumulator=acc)
    assert res.merged == [0, 1, 2] and res.rejected == {}
    decoded = [codec.load_weights(mem, c.key) for c in cs]
    floats = [n for n in g if g[n].is_floating_point()]
    params = {n: torch.nn.Parameter(g[n].clone()) for n in floats}
    opt = torch.optim.SGD(list(params.values()), lr=0.7, momentum=0.9, nesterov=True)
    for n, p in params.items():
        p.grad = sum(wt * (g[n] - d[n]) for wt, d in zip(wts, decoded)) / sum(wts)
        assert (p.grad != 0).sum() <= 3 * (3 * 64 + 2 + 1)  # sparse: 3 workers x (3 chunks of a.w, a.b, c)
    opt.step()
    got = load_checkpoint(mem, "g1.safetensors")[0]
    for n in floats:
        torch.testing.assert_close(got[n], params[n].detach(), rtol=1e-6, atol=1e-6)
    assert torch.equal(got["n"], g["n"])


def _hostile(mem, g, w, sha, damage):
    tensors, meta, _ = codec.encode(g, w, codec.Encoding(**ENC, base_digest=sha))
    changed = damage(tensors, meta)
    meta = changed if isinstance(changed, dict) else meta
    write_checkpoint(mem, "bad.safetensors", tensors, metadata=meta, manifest={"round": 0, "base": "g0.safetensors"})
    return Contribution(1, "bad.safetensors", 1.0)


# a.w: 3 chunks of 4096, 64 kept in 4 bits: rows of 4 bytes of scale, 32 of codes, 64 of offsets
# (48 of low bits, then 16 of the high parts' 128-bit field)
A_W = topk.layout(3 * 4096, 1 / 64)


def _index(tensors, fix):
    """Offsets of a.w decoded, changed by `fix`, coded again."""
    rows = tensors["a.w"].clone()
    idx = topk.decode_offsets("a.w", rows[:, 36:], A_W)
    fix(idx)
    rows[:, 36:] = topk.encode_offsets(idx, A_W)
    tensors["a.w"] = rows


def _high_bit(tensors):
    """One more bit set in the first chunk's unary field of high parts: 65 entries for 64."""
    rows = tensors["a.w"].clone()
    field = topk.to_bits(rows[:, 84:], 128)
    field[0, field[0].argmin()] = 1
    rows[:, 84:] = topk.to_bytes(field)
    tensors["a.w"] = rows


def _scale(tensors, value):
    rows = tensors["a.w"].clone()
    rows[1, :4] = torch.tensor([value]).view(torch.uint8)
    tensors["a.w"] = rows


def _descending(i):
    i[0] = torch.arange(64) * 64
    i[0, :2] = torch.tensor([5, 3])  # one high part (0), low bits going down


@pytest.mark.parametrize("damage, reason", [
    (lambda t, m: _index(t, lambda i: i.__setitem__((0, -1), 4096)), r"offset is out of range \[0, 4096\)"),
    (lambda t, m: _high_bit(t), "do not hold exactly 64 entries"),
    (lambda t, m: _index(t, lambda i: i.__setitem__((0, 1), i[0, 0])), "not strictly ascending .*a duplicate"),
    (lambda t, m: _index(t, _descending), "not strictly ascending"),
    (lambda t, m: _scale(t, float("nan")), "scale is negative or not finite"),
    (lambda t, m: _scale(t, -1.0), "scale is negative or not finite"),
    (lambda t, m: t.__setitem__("a.w", t["a.w"][:, :-1].contiguous()), r"a\.w is U8\[3, 99\], a topk delta .* has U8\[3, 100\]"),
    (lambda t, m: t.__setitem__("a.w", t["a.w"][:-1].contiguous()), r"tensor a\.w is U8\[2, 100\]"),
    (lambda t, m: t.pop("a.b"), r"a\.b"),
    (meta_changed(topk=0), "unknown contribution coding"),
    (meta_changed(topk=1.5), "unknown contribution coding"),
    (meta_changed(bits=3), "unknown contribution coding"),
    (meta_changed(chunk=1024), "chunks of 4096"),
    (meta_changed(bits="two"), "malformed"),
    (meta_changed(layout=None), "without a layout was written by an older islands"),
    (meta_changed(layout="rows/elias-fano"), "one of layout rows/elias-fano: finish that run"),  # before the bitmaps
])
def test_a_damaged_topk_contribution_is_one_rejection_with_its_reason(mem, damage, reason):
    g, workers, sha = _setup(mem, k=2, seed=4)
    good = Contribution(0, _publish(mem, "d0.safetensors", g, workers[0], sha), 1.0)
    bad = _hostile(mem, g, workers[1], sha, damage)
    acc = RunningSum(mem, "g0.safetensors")
    assert acc.add(good) and not acc.add(bad)
    assert re.search(reason, acc.rejected[1][1]), acc.rejected[1][1]
    res = _merge(mem, [good, bad], accumulator=acc)
    assert res.merged == [0] and 1 in res.rejected
    _merge(mem, [good], out="h1.safetensors")  # the bad one left no trace in the sum
    assert load_checkpoint(mem, "g1.safetensors")[0]["a.w"].equal(load_checkpoint(mem, "h1.safetensors")[0]["a.w"])


@pytest.mark.parametrize("sets, msg", [
    (["round.contribution=delta", "round.codec=topk", "round.topk=0"], r"round.topk must be in \(0, 1\]"),
    (["round.contribution=delta", "round.codec=topk", "round.topk=1.5"], r"round.topk must be in \(0, 1\]"),
    (["round.contribution=delta", "round.codec=topk", "round.bits=3"], "round.bits must be 2, 4 or 8"),
    (["round.contribution=delta", "round.codec=topk", "round.error_feedback=1.5"], "error_feedback .* must be in"),
    (["round.contribution=delta", "round.codec=topk", "round.aggregate=median"], "almost always 0"),
    (["round.contribution=delta", "round.codec=topk", "round.prune_keep=0.5"], "drop prune_keep"),
    (["round.codec=topk"], "round.codec=topk codes the outer gradient: it needs round.contribution=delta"),
])
def test_config_refuses_topk_settings_that_mean_nothing(sets, msg):
    with pytest.raises(ConfigError, match=msg):
        load_config(None, None, sets)
    assert load_config(None, None, ["round.contribution=delta", "round.codec=topk", "round.bits=8"]).round.topk == 1 / 16


@settings(max_examples=80, deadline=None)
@given(chunk=st.integers(1, 4096), data=st.data())
def test_offsets_round_trip_through_elias_fano_at_any_density(chunk, data):
    """Any k of a chunk, any rows: decode(encode(offsets)) is the offsets, in the bytes the layout says."""
    k = data.draw(st.integers(1, chunk))
    rows = data.draw(st.integers(1, 3))
    lay = topk.Layout(rows * chunk, chunk, rows, k)
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    idx = torch.stack([torch.randperm(chunk, generator=g)[:k].sort().values for _ in range(rows)])
    coded = topk.encode_offsets(idx, lay)
    assert coded.dtype == torch.uint8 and tuple(coded.shape) == (rows, lay.index_bytes)
    assert torch.equal(topk.decode_offsets("t", coded, lay), idx)


def test_a_bitmap_whose_chunks_hold_other_counts_than_k_is_refused():
    """Chunks of 8 keeping 4, as bitmaps: a bit moved from the second chunk to the first leaves the
    total right (8) and each chunk's count wrong (5 and 3): refused, as is a bit more or less."""
    rows = topk.encode(torch.arange(1.0, 17.0), 0.5, 32, chunk=8)  # bitmaps 0xF0, 0xF0: the 4 largest
    assert topk.layout(16, 0.5, 8).bitmap and rows[:, -1].tolist() == [0xF0, 0xF0]
    for first, second in ((0xF8, 0x70), (0xF0, 0xF8), (0xF0, 0x70), (0x0F, 0xF0)):
        bad = rows.clone()
        bad[:, -1] = torch.tensor([first, second], dtype=torch.uint8)
        if first == 0x0F:  # the right counts, other positions: decoded as they say
            pos, _ = topk.sparse("t", 16, 0.5, 32, bad, chunk=8)
            assert pos.tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
            continue
        with pytest.raises(CheckpointError, match="do not hold exactly 4 entries"):
            topk.sparse("t", 16, 0.5, 32, bad, chunk=8)


def test_offsets_cost_about_two_bits_more_than_their_share_of_the_chunk():
    """l = log2(chunk / k); bytes a chunk = k l / 8 + (k + chunk >> l) / 8."""
    assert topk.layout(4096, 1 / 64).index_bytes == 64 * 6 // 8 + (64 + 64) // 8 == 64  # 8 bits an offset
    assert topk.layout(4096, 1 / 16).index_bytes == 256 * 4 // 8 + (256 + 256) // 8 == 192  # 6 bits
    assert topk.layout(4096, 1.0).index_bytes == 4096 // 8  # all kept: a bitmap, 1 bit an entry
    assert [topk.layout(4096, k / 4096).bitmap for k in (1000, 1024, 2048)] == [False, True, True]  # from k = chunk / 4


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 3000), chunk=st.sampled_from([topk.CHUNK, 1, 7, 64, 300]),
       frac=st.sampled_from([1 / 64, 0.1, 0.5, 1.0]), seed=st.integers(0, 2**16))
def test_values_of_16_and_32_bits_are_stored_as_they_are(n, chunk, frac, seed):
    """A pruned delta's chunks (a row each: any length) keep each chunk's largest entries, their
    values exact in 32 bits and bf16-rounded in 16."""
    v = torch.randn(n, generator=torch.Generator().manual_seed(seed))
    lay = topk.layout(n, frac, chunk)
    for bits, dtype in ((32, torch.float32), (16, torch.bfloat16)):
        got = topk.encode(v, frac, bits, chunk)
        assert tuple(got.shape) == (lay.chunks, lay.row_bytes(bits))
        pos, vals = topk.sparse("v", n, frac, bits, got, chunk)
        assert torch.equal(vals, v[pos].to(dtype).to(torch.float32))
        _assert_each_chunks_largest(v, pos, lay)


@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 9000), frac=st.sampled_from([1 / 64, 1 / 16, 0.5, 1.0]), bits=st.sampled_from([2, 4, 8, 16, 32]),
       chunk=st.sampled_from([topk.CHUNK, 1, 64, 300]), data=st.data())
def test_any_bytes_of_the_right_shape_decode_to_kept_entries_or_one_refusal(n, frac, bits, chunk, data):
    """What the header check lets through (the row shape) is decoded or refused by CheckpointError:
    never another exception, never a position outside the tensor or twice, never a value that is not
    finite. Rows are random bytes, or a real coding with one byte changed; chunks of 4096 (topk) or
    a row's length (a pruned delta), values quantized or stored as they are (16, 32 bits)."""
    lay = topk.layout(n, frac, chunk)
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**32 - 1)))
    if data.draw(st.booleans()):
        rows = torch.randint(0, 256, (lay.chunks, lay.row_bytes(bits)), generator=g, dtype=torch.uint8)
    else:
        rows = topk.encode(torch.randn(n, generator=g), frac, bits, chunk)
        rows.view(-1)[data.draw(st.integers(0, rows.numel() - 1))] = data.draw(st.integers(0, 255))
    try:
        pos, vals = topk.sparse("t", n, frac, bits, rows, chunk)
    except CheckpointError:
        return
    assert pos.dtype == torch.int64 and len(set(pos.tolist())) == len(pos)
    assert bool(((pos >= 0) & (pos < n)).all()) and bool(torch.isfinite(vals).all())


def test_the_outer_learning_rate_warms_up_over_its_rounds():
    from orchestrator.round_merge import round_spec
    cfg = load_config(sets=["outer.optimizer=sgd", "outer.lr=3", "outer.warmup_rounds=4"])
    assert [round_spec(cfg, r, {}, 1).outer.lr for r in range(6)] == [0.75, 1.5, 2.25, 3.0, 3.0, 3.0]
    assert round_spec(load_config(sets=["outer.lr=3"]), 0, {}, 1).outer.lr == 3.0  # no warm-up: lr from round 0
    with pytest.raises(ConfigError, match="outer.warmup_rounds must be >= 0"):
        load_config(sets=["outer.warmup_rounds=-1"])


@pytest.mark.slow
def test_dense_first_rounds_then_topk_in_a_real_run(tmp_path, corpus_cache):
    """round.dense_rounds 1: round 0's contributions are dense fp32 deltas (nothing left to the
    buffer), round 1's top-k ones; the service merges both kinds."""
    from orchestrator.cli import main
    run = tmp_path / "run"
    assert main(["submit", "--executor", "inline", "--workers", "2", "--rounds", "2", "--inner-steps", "3",
                 "--run-dir", str(run), "--set", f"data.cache_dir={corpus_cache}", "--set", "model.n_layer=1",
                 "--set", "model.n_embd=32", "--set", "model.n_head=2", "--set", "model.block_size=32",
                 "--set", "inner.batch_size=4", "--set", "data.eval_batches=1", "--set", "round.contribution=delta",
                 "--set", "round.codec=topk", "--set", "round.dense_rounds=1", "--set", "outer.optimizer=sgd",
                 "--set", "outer.lr=3", "--set", "outer.warmup_rounds=2"]) == 0
    s, L = Storage(str(run)), RunLayout()
    for r, want in ((0, "fp32"), (1, "topk")):
        for w in (0, 1):
            m = read_manifest(s, L.contribution(r, w))  # kept by retention, which deletes round 0's tensors
            assert m["contribution"]["codec"] == want, (r, w, m["contribution"])
    for w in (0, 1):
        assert codec.encoding_of(load_checkpoint(s, L.contribution(1, w))[1], "c").codec == "topk"
    for r in (0, 1):
        assert s.read_json(L.round_record(r))["merged"] == [0, 1]
