"""Tests for worker/model.py: shapes, init, learning, causality, determinism, errors."""

from __future__ import annotations

import math

import pytest
import torch

from worker.model import GPT

TINY = dict(n_layer=2, n_head=4, n_embd=32, block_size=16)


def expected_params(n_layer: int, n_embd: int, block_size: int, vocab: int, bias: bool) -> int:
    """Hand count: embeddings + per-block (2 LayerNorms, qkv, proj, 4x MLP) + ln_f + lm_head."""
    C, b = n_embd, int(bias)
    ln = C + b * C
    attn = (3 * C * C + b * 3 * C) + (C * C + b * C)
    mlp = (4 * C * C + b * 4 * C) + (4 * C * C + b * C)
    block = 2 * ln + attn + mlp
    return vocab * C + block_size * C + n_layer * block + ln + vocab * C


@pytest.mark.parametrize("bias", [True, False])
def test_num_params_matches_formula(bias):
    model = GPT(**TINY, bias=bias)
    assert model.num_params() == expected_params(2, 32, 16, 256, bias)
    assert model.num_params() == sum(p.numel() for p in model.state_dict().values())


def test_small_config_is_about_half_a_million():
    model = GPT(n_layer=2, n_head=4, n_embd=128, block_size=128)
    assert 0.4e6 < model.num_params() < 0.6e6


def test_state_dict_names_are_stable():
    names = list(GPT(**TINY).state_dict())
    assert names[:2] == ["transformer.wte.weight", "transformer.wpe.weight"]
    assert "transformer.h.1.attn.c_attn.weight" in names
    assert "transformer.h.0.mlp.c_proj.bias" in names
    assert names[-3:] == ["transformer.ln_f.weight", "transformer.ln_f.bias", "lm_head.weight"]


def test_lm_head_is_not_tied():
    model = GPT(**TINY)
    assert model.lm_head.weight.data_ptr() != model.transformer.wte.weight.data_ptr()


def test_forward_shapes_and_initial_loss():
    torch.manual_seed(0)
    model = GPT(**TINY)
    idx = torch.randint(0, 256, (3, 16))
    logits, loss = model(idx)
    assert logits.shape == (3, 16, 256) and loss is None
    _, loss = model(idx, idx)
    assert abs(loss.item() - math.log(256)) < 0.3


def test_residual_projections_are_scaled_down():
    torch.manual_seed(0)
    model = GPT(n_layer=8, n_head=4, n_embd=128, block_size=16)
    std = model.transformer.h[0].attn.c_proj.weight.std().item()
    assert std == pytest.approx(0.02 / math.sqrt(16), rel=0.1)
    assert model.transformer.h[0].attn.c_attn.weight.std().item() == pytest.approx(0.02, rel=0.1)


def test_param_groups_split_by_dimension_and_cover_everything():
    model = GPT(**TINY)
    decay, no_decay = model.param_groups(weight_decay=0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decay["params"])
    assert all(p.dim() < 2 for p in no_decay["params"])
    grouped = {id(p) for g in (decay, no_decay) for p in g["params"]}
    assert grouped == {id(p) for p in model.parameters()}
    by_name = [p for _, p in sorted(model.named_parameters()) if p.dim() >= 2]
    assert [id(p) for p in decay["params"]] == [id(p) for p in by_name]
    torch.optim.AdamW(model.param_groups(0.1), lr=1e-3)  # torch accepts the groups as they are


def test_overfits_one_batch():
    torch.manual_seed(0)
    model = GPT(n_layer=2, n_head=4, n_embd=64, block_size=32)
    data = torch.randint(0, 256, (4, 33))
    x, y = data[:, :-1], data[:, 1:]
    opt = torch.optim.AdamW(model.param_groups(0.0), lr=3e-3)
    for _ in range(150):
        _, loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    assert loss.item() < 1.0


def test_causal_later_tokens_do_not_change_earlier_logits():
    torch.manual_seed(0)
    model = GPT(**TINY).eval()
    idx = torch.randint(0, 256, (2, 16))
    changed = idx.clone()
    changed[:, 10:] = (changed[:, 10:] + 1) % 256
    a, _ = model(idx)
    b, _ = model(changed)
    torch.testing.assert_close(a[:, :10], b[:, :10])
    assert not torch.allclose(a[:, 10:], b[:, 10:])


def test_deterministic_under_manual_seed():
    torch.manual_seed(123)
    a = GPT(**TINY)
    torch.manual_seed(123)
    b = GPT(**TINY)
    for (na, ta), (nb, tb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert na == nb and torch.equal(ta, tb)


def test_generate_appends_tokens_and_crops_context():
    torch.manual_seed(0)
    model = GPT(**TINY).eval()
    out = model.generate(torch.zeros(2, 10, dtype=torch.long), max_new_tokens=20, top_k=5)
    assert out.shape == (2, 30) and out.dtype == torch.long
    assert int(out.min()) >= 0 and int(out.max()) < 256


def test_clear_errors():
    with pytest.raises(ValueError, match="divisible by n_head"):
        GPT(n_layer=1, n_head=3, n_embd=32, block_size=8)
    with pytest.raises(ValueError, match="block_size is 16"):
        GPT(**TINY)(torch.zeros(1, 17, dtype=torch.long))
    with pytest.raises(ValueError, match="temperature"):
        GPT(**TINY).generate(torch.zeros(1, 1, dtype=torch.long), 1, temperature=0.0)
