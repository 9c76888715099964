"""Merge maths against hand-worked tensors and against torch.optim run directly (the oracle)."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from core.checkpoint import load_checkpoint, read_manifest
from core.checkpoint_writer import write_checkpoint
from core.config import OuterConfig
from merge.rounds import Contribution, QuorumError, merge_round
from merge.round_spec import RoundSpec
from merge.methods import average, get_method
from core.outer import outer_step


def _write(storage, key, tensors):
    write_checkpoint(storage, key, tensors)
    return key


def _merge(storage, contribs, outer, r=0, min_inputs=1):
    spec = RoundSpec(base=f"g{r}.safetensors", out=f"g{r + 1}.safetensors", outer=outer,
                     state_in=f"s{r}.safetensors" if r else None, state_out=f"s{r + 1}.safetensors", min_inputs=min_inputs)
    return merge_round(storage, spec, contribs)


def test_average_weighted_by_hand():
    # Prepare
    a, b = torch.tensor([1.0, 2.0]), torch.tensor([4.0, 8.0])
    # Execute
    out = average([a, b], [1.0, 2.0])
    # Assert: (1*1 + 2*4)/3 = 3, (1*2 + 2*8)/3 = 6
    assert torch.allclose(out, torch.tensor([3.0, 6.0]))


def test_average_accumulates_bf16_in_fp32():
    xs = [torch.full((4,), 1.0 + 2**-7, dtype=torch.bfloat16) for _ in range(3)] + [torch.full((4,), 1.0, dtype=torch.bfloat16)]
    out = average(xs, [1, 1, 1, 1])
    assert out.dtype == torch.float32
    assert torch.allclose(out, torch.full((4,), 1.0 + 0.75 * 2**-7))


def test_unknown_method_lists_valid_ones():
    with pytest.raises(ValueError, match="valid methods: average"):
        get_method("nope")


def test_nesterov_two_rounds_by_hand(mem):
    # Round 0: global w=[1,2]; workers [0,2] and [1,0]: mean [0.5,1], outer grad [0.5,1].
    # Nesterov (lr .7, mom .9), first step: buf=g, update=g+.9*buf=1.9g -> w = [1,2]-1.33*[.5,1] = [.335,.67]
    _write(mem, "g0.safetensors", {"w": torch.tensor([1.0, 2.0])})
    _write(mem, "a.safetensors", {"w": torch.tensor([0.0, 2.0])})
    _write(mem, "b.safetensors", {"w": torch.tensor([1.0, 0.0])})
    outer = OuterConfig(optimizer="nesterov", lr=0.7, momentum=0.9)
    res = _merge(mem, [Contribution(0, "a.safetensors", 1), Contribution(1, "b.safetensors", 1)], outer)
    g1 = load_checkpoint(mem, "g1.safetensors")[0]["w"]
    assert torch.allclose(g1, torch.tensor([0.335, 0.67]), atol=1e-6)
    assert res.outer_grad_norm == pytest.approx(math.sqrt(0.25 + 1.0))
    # Round 1: one worker at g1 - [.1,.2]: grad [.1,.2]; buf = .9*[.5,1]+[.1,.2] = [.55,1.1];
    # update = grad + .9*buf = [.595,1.19]; w = g1 - .7*update = [-.0815, -.163]
    _write(mem, "c.safetensors", {"w": g1 - torch.tensor([0.1, 0.2])})
    _merge(mem, [Contribution(0, "c.safetensors", 1)], outer, r=1)
    g2 = load_checkpoint(mem, "g2.safetensors")[0]["w"]
    assert torch.allclose(g2, torch.tensor([-0.0815, -0.163]), atol=1e-6)
    state = load_checkpoint(mem, "s2.safetensors")[0]
    assert torch.allclose(state["w::momentum_buffer"], torch.tensor([0.55, 1.1]))


def test_sgd_lr1_is_fedavg_weighted_by_tokens(mem):
    _write(mem, "g0.safetensors", {"w": torch.tensor([10.0])})
    _write(mem, "a.safetensors", {"w": torch.tensor([1.0])})
    _write(mem, "b.safetensors", {"w": torch.tensor([4.0])})
    _merge(mem, [Contribution(0, "a.safetensors", 100), Contribution(1, "b.safetensors", 300)],
           OuterConfig(optimizer="sgd", lr=1.0))
    assert load_checkpoint(mem, "g1.safetensors")[0]["w"].item() == pytest.approx(3.25)  # (100*1+300*4)/400


@pytest.mark.parametrize("opt", ["nesterov", "sgd", "sgdm", "adam"])
def test_outer_optimizers_match_torch_optim_over_rounds(mem, opt):
    """Three rounds through files and persisted state == one in-memory torch.optim run."""
    torch.manual_seed(0)
    cfg = OuterConfig(optimizer=opt, lr=0.7 if opt != "adam" else 0.05, momentum=0.9, eps=0.1)
    shapes = {"a": (3, 4), "b": (5,), "c": ()}
    params = {k: torch.nn.Parameter(torch.randn(s)) for k, s in shapes.items()}
    groups = [params[k] for k in sorted(params)]
    oracle = {"nesterov": lambda: torch.optim.SGD(groups, lr=0.7, momentum=0.9, nesterov=True),
              "sgd": lambda: torch.optim.SGD(groups, lr=0.7),
              "sgdm": lambda: torch.optim.SGD(groups, lr=0.7, momentum=0.9),
              "adam": lambda: torch.optim.Adam(groups, lr=0.05, betas=(0.9, 0.95), eps=0.1)}[opt]()
    _write(mem, "g0.safetensors", {k: p.detach().clone() for k, p in params.items()})
    for r in range(3):
        workers = [{k: p.detach() + 0.3 * torch.randn(p.shape) for k, p in params.items()} for _ in range(3)]
        weights = [1.0, 2.0, 3.0]
        contribs = [Contribution(i, _write(mem, f"w{r}_{i}.safetensors", w), weights[i]) for i, w in enumerate(workers)]
        _merge(mem, contribs, cfg, r=r)
        for k, p in params.items():  # the oracle: pseudo-gradient into .grad, one real step
            mean = sum(wt * w[k] for wt, w in zip(weights, workers)) / sum(weights)
            p.grad = p.detach() - mean
        oracle.step()
        got = load_checkpoint(mem, f"g{r + 1}.safetensors")[0]
        for k, p in params.items():
            assert torch.allclose(got[k], p.detach(), atol=1e-6), (opt, r, k)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.lists(st.floats(-1e3, 1e3, allow_nan=False), min_size=3, max_size=3), min_size=1, max_size=5),
       st.lists(st.floats(0.1, 10), min_size=5, max_size=5))
def test_property_outer_sgd_lr1_equals_weighted_mean(values, weights):
    g = torch.zeros(3)
    ws = [torch.tensor(v) for v in values]
    wts = weights[: len(ws)]
    mean = average(ws, wts)
    new, _, grad = outer_step(g, mean, {}, OuterConfig(optimizer="sgd", lr=1.0))
    expected = sum(w * t.double() for w, t in zip(wts, ws)) / sum(wts)
    assert torch.allclose(new.double(), expected, atol=1e-3, rtol=1e-5)
    assert torch.allclose(grad, g - mean)


@settings(max_examples=30, deadline=None)
@given(st.floats(0.05, 1.0), st.floats(0.0, 0.99), st.lists(st.floats(-5, 5), min_size=4, max_size=4))
def test_property_nesterov_first_step_closed_form(lr, mom, delta):
    g = torch.ones(4)
    merged = g - torch.tensor(delta)
    cfg = OuterConfig(optimizer="nesterov", lr=lr, momentum=max(mom, 0.01))
    new, state, _ = outer_step(g, merged, {}, cfg)
    d = torch.tensor(delta)
    assert torch.allclose(new, g - lr * (1 + cfg.momentum) * d, atol=1e-5)
    assert torch.allclose(state["momentum_buffer"], d, atol=1e-6)  # d went through 1 - (1 - d) in float32


@pytest.mark.parametrize("name", ["nesterov", "sgdm", "sgd", "adam"])
@pytest.mark.parametrize("n", [1, 7, 1000, 4099])  # whole vectors and tails of every width
def test_outer_step_is_torch_optim_default_over_two_steps(name, n):
    """The SGD family steps fused (merge.outer.make_optimizer): it must give torch.optim's default
    implementation's numbers, stepped directly, momentum included, to the last bit (here the fused
    kernel gave the same bytes on long tensors and 1 ulp off on some of 1 and 7 elements)."""
    g = torch.Generator().manual_seed(n)
    w, m1, m2 = (torch.randn(n, generator=g) for _ in range(3))
    cfg = OuterConfig(optimizer=name, lr=0.7, momentum=0.9)
    p = torch.nn.Parameter(w.clone())
    opt = torch.optim.Adam([p], lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps) if name == "adam" else \
        torch.optim.SGD([p], lr=0.7, momentum=0.0 if name == "sgd" else 0.9, nesterov=name == "nesterov")
    new, state = w, {}
    for merged in (m1, m2):
        p.grad = p.detach() - merged
        opt.step()
        new, state, _ = outer_step(new, merged, state, cfg)
        torch.testing.assert_close(new, p.detach(), rtol=2 ** -23, atol=2 ** -23)  # <= 1 ulp (|w| ~ 1)
    assert state.keys() == {k for k, v in opt.state[p].items() if torch.is_tensor(v)}
    for k in state:
        torch.testing.assert_close(state[k], opt.state[p][k], rtol=2 ** -23, atol=2 ** -23)


@pytest.mark.parametrize("name", ["nesterov", "sgdm", "sgd", "adam"])
def test_an_in_place_step_gives_the_same_bytes_in_the_callers_tensors(name):
    """in_place (the round merge over models held in memory): the global tensor, the state's
    tensors and the merged input are overwritten, and the results are those very tensors, with the
    bytes of the step on copies."""
    g = torch.Generator().manual_seed(3)
    w, m1, m2 = (torch.randn(1000, generator=g) for _ in range(3))
    cfg = OuterConfig(optimizer=name, lr=0.7, momentum=0.9)
    want, want_state, want_grad = w, {}, None
    got, state = w.clone(), {}
    for merged in (m1, m2):
        want, want_state, want_grad = outer_step(want, merged, want_state, cfg)
        mine = merged.clone()
        new, state, grad = outer_step(got, mine, state, cfg, in_place=True)
        assert new.data_ptr() == got.data_ptr() and grad.data_ptr() == mine.data_ptr()
        assert torch.equal(got, want) and torch.equal(grad, want_grad)
        assert state.keys() == want_state.keys() and all(torch.equal(state[k], want_state[k]) for k in state)
    held = {k: v.clone() for k, v in state.items()}
    _, again, _ = outer_step(got, m1.clone(), held, cfg, in_place=True)
    assert all(again[k].data_ptr() == held[k].data_ptr() for k in held)  # the state stepped where it lies


# -- validation: a bad contribution is rejected with a reason, the round goes on -------------
def _round_with(mem, bad: dict):
    _write(mem, "g0.safetensors", {"w": torch.zeros(2, 2), "b": torch.zeros(2)})
    _write(mem, "ok.safetensors", {"w": torch.ones(2, 2), "b": torch.ones(2)})
    _write(mem, "bad.safetensors", bad)
    return [Contribution(0, "ok.safetensors", 1), Contribution(1, "bad.safetensors", 1)]


@pytest.mark.parametrize("bad, reason", [
    ({"w": torch.full((2, 2), float("nan")), "b": torch.ones(2)}, "tensor w has NaN or Inf"),
    ({"w": torch.ones(2, 3), "b": torch.ones(2)}, r"tensor w is F32\[2, 3\]"),
    ({"w": torch.ones(2, 2)}, r"missing \['b'\]"),
    ({"w": torch.ones(2, 2), "b": torch.ones(2), "x": torch.ones(1)}, r"unexpected \['x'\]"),
    ({"w": torch.ones(2, 2, dtype=torch.float64), "b": torch.ones(2)}, r"tensor w is F64"),
])
def test_bad_contribution_is_rejected_with_reason(mem, bad, reason):
    res = _merge(mem, _round_with(mem, bad), OuterConfig(optimizer="sgd", lr=1.0))
    assert res.merged == [0]
    assert list(res.rejected) == [1]
    import re
    assert re.search(reason, res.rejected[1]), res.rejected[1]
    assert torch.equal(load_checkpoint(mem, "g1.safetensors")[0]["w"], torch.ones(2, 2))


def test_flipped_byte_is_caught_by_checksum(mem):
    contribs = _round_with(mem, {"w": torch.ones(2, 2), "b": torch.ones(2)})
    raw = bytearray(mem.read_bytes("bad.safetensors"))
    raw[-3] ^= 0xFF
    mem.fs.pipe_file(mem.path("bad.safetensors"), bytes(raw))  # damage it behind the manifest's back
    res = _merge(mem, contribs, OuterConfig(optimizer="sgd", lr=1.0))
    assert res.merged == [0] and "checksum does not match" in res.rejected[1]


def test_missing_manifest_is_rejected(mem):
    contribs = _round_with(mem, {"w": torch.ones(2, 2), "b": torch.ones(2)})
    mem.remove("bad.json")
    res = _merge(mem, contribs, OuterConfig(optimizer="sgd", lr=1.0))
    assert res.merged == [0] and "no manifest" in res.rejected[1]


def test_below_quorum_writes_nothing(mem):
    contribs = _round_with(mem, {"w": torch.full((2, 2), float("inf")), "b": torch.ones(2)})
    with pytest.raises(QuorumError, match="quorum is 2") as info:
        _merge(mem, contribs, OuterConfig(), min_inputs=2)
    assert 1 in info.value.rejected
    assert not mem.exists("g1.safetensors") and read_manifest(mem, "g1.safetensors") is None
    assert [n for n in mem.list("") if n.startswith("g1")] == []
