"""LoRA adapters in `orchestrate merge` (merge/adapters.py): several merged into one adapter, one or
more folded into their base model.

Hand-worked adapters built as files (the PEFT layout written by hand), then PEFT itself as the
oracle: PEFT's `merge_and_unload()` for a fold, its `add_weighted_adapter(combination_type="cat")`
for a merge, `PeftModel.from_pretrained` to load what the merge wrote, and a float64 reference of
the merged model's weights. Every refusal is checked for its message and for writing nothing.
"""
from __future__ import annotations

import json
import os
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load as st_load
from safetensors.torch import load_file, save_file
from safetensors.torch import save as st_save

from merge.adapters import MAX_PATTERN
from merge.manual import ManualMerge, MergeError, manual_merge

P = "base_model.model."


def _adapter(path, loras, *, r=1, alpha=2, extra=None, whole=None, **cfg):
    """An adapter directory written by hand: `loras` maps a module to (A, B)."""
    os.makedirs(path, exist_ok=True)
    tensors = {}
    for m, (a, b) in loras.items():
        tensors[f"{P}{m}.lora_A.weight"], tensors[f"{P}{m}.lora_B.weight"] = a, b
    tensors.update({P + k: v for k, v in (whole or {}).items()})
    tensors.update(extra or {})
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": r, "lora_alpha": alpha, "target_modules": sorted({m.rsplit(".", 1)[-1] for m in loras}),
              "fan_in_fan_out": False, "use_rslora": False, "rank_pattern": {}, "alpha_pattern": {}, **cfg}
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(config, f)
    return str(path)


def _base(path, tensors):
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w") as f:
        f.write("{}")
    return str(path)


A1, B1 = torch.tensor([[1.0, 2.0]]), torch.tensor([[1.0], [0.0], [2.0]])  # r 1, in 2, out 3
A2, B2 = torch.tensor([[0.0, 1.0]]), torch.tensor([[4.0], [1.0], [0.0]])


# -- hand-worked -------------------------------------------------------------------------------
def test_fold_one_adapter_by_hand(tmp_path):
    """scaling alpha / r = 2; delta = 2 * B @ A = [[2, 4], [0, 0], [4, 8]], added to ones."""
    ad = _adapter(tmp_path / "ad", {"layer.proj": (A1, B1)})
    base = _base(tmp_path / "base", {"layer.proj.weight": torch.ones(3, 2), "layer.proj.bias": torch.zeros(3)})
    manual_merge(ManualMerge([ad], str(tmp_path / "out"), base=base))
    out = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert torch.equal(out["layer.proj.weight"], torch.tensor([[3.0, 5.0], [1.0, 1.0], [5.0, 9.0]]))
    assert torch.equal(out["layer.proj.bias"], torch.zeros(3))
    assert os.path.exists(tmp_path / "out" / "config.json")


def test_fold_two_adapters_averaged_by_hand(tmp_path):
    """Weights 1, 3 -> c = 1/4, 3/4 of delta1 = 2 B1 A1 and delta2 = 2 B2 A2 = [[0, 8], [0, 2], [0, 0]]."""
    ads = [_adapter(tmp_path / "a1", {"p": (A1, B1)}), _adapter(tmp_path / "a2", {"p": (A2, B2)})]
    base = _base(tmp_path / "base", {"p.weight": torch.zeros(3, 2)})
    manual_merge(ManualMerge(ads, str(tmp_path / "out"), base=base, weights=[1, 3]))
    out = load_file(str(tmp_path / "out" / "model.safetensors"))["p.weight"]
    assert torch.equal(out, torch.tensor([[0.5, 7.0], [0.0, 1.5], [1.0, 2.0]]))


def test_merge_concatenates_ranks_by_hand(tmp_path):
    """A = [c1 s1 A1; c2 s2 A2], B = [B1 B2], r = alpha = 2: B @ A is c1 delta1 + c2 delta2."""
    ads = [_adapter(tmp_path / "a1", {"p": (A1, B1)}), _adapter(tmp_path / "a2", {"p": (A2, B2)})]
    manual_merge(ManualMerge(ads, str(tmp_path / "out"), weights=[1, 3]))
    out = load_file(str(tmp_path / "out" / "adapter_model.safetensors"))
    a, b = out[f"{P}p.lora_A.weight"], out[f"{P}p.lora_B.weight"]
    assert torch.equal(a, torch.tensor([[0.5, 1.0], [0.0, 1.5]]))
    assert torch.equal(b, torch.tensor([[1.0, 4.0], [0.0, 1.0], [2.0, 0.0]]))
    assert torch.equal(b @ a, torch.tensor([[0.5, 7.0], [0.0, 1.5], [1.0, 2.0]]))
    cfg = json.load(open(tmp_path / "out" / "adapter_config.json"))
    assert (cfg["r"], cfg["lora_alpha"], cfg["rank_pattern"], cfg["use_rslora"]) == (2, 2, {}, False)
    meta = json.loads(_metadata(tmp_path / "out" / "adapter_model.safetensors")["islands.merge"])
    assert meta["lora"] == "concatenated ranks" and meta["coefficients"] == [0.25, 0.75]


def test_task_arithmetic_scales_the_summed_updates(tmp_path):
    ads = [_adapter(tmp_path / "a1", {"p": (A1, B1)}), _adapter(tmp_path / "a2", {"p": (A2, B2)})]
    base = _base(tmp_path / "base", {"p.weight": torch.zeros(3, 2)})
    manual_merge(ManualMerge(ads, str(tmp_path / "out"), base=base, method="task-arithmetic", weights=[1, -1],
                 params={"scale": 0.5}))
    out = load_file(str(tmp_path / "out" / "model.safetensors"))["p.weight"]
    assert torch.equal(out, 0.5 * (2 * B1 @ A1 - 2 * B2 @ A2))


def test_rslora_rank_and_alpha_patterns(tmp_path):
    """rslora: alpha / sqrt(r); alpha_pattern overrides alpha for the module it names (PEFT's match)."""
    a, b = torch.ones(4, 2), torch.ones(3, 4)
    ad = _adapter(tmp_path / "ad", {"layers.0.q": (a, b), "layers.1.q": (a[:1].clone(), b[:, :1].clone())}, r=4, alpha=8,
                  use_rslora=True, rank_pattern={"layers.1.q": 1}, alpha_pattern={"layers.1.q": 3})
    base = _base(tmp_path / "base", {"layers.0.q.weight": torch.zeros(3, 2), "layers.1.q.weight": torch.zeros(3, 2)})
    manual_merge(ManualMerge([ad], str(tmp_path / "out"), base=base))
    out = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert torch.equal(out["layers.0.q.weight"], torch.full((3, 2), 4 * 8 / 2.0))  # 4 ranks of 1, scaling 8/sqrt(4)
    assert torch.equal(out["layers.1.q.weight"], torch.full((3, 2), 3.0))  # 1 rank, scaling 3/sqrt(1)


def test_fold_into_a_single_safetensors_file(tmp_path):
    ad = _adapter(tmp_path / "ad", {"p": (A1, B1)})
    save_file({"p.weight": torch.zeros(3, 2)}, str(tmp_path / "base.safetensors"))
    manual_merge(ManualMerge([ad], str(tmp_path / "out.safetensors"), base=str(tmp_path / "base.safetensors")))
    assert torch.equal(load_file(str(tmp_path / "out.safetensors"))["p.weight"], 2 * B1 @ A1)
    assert os.path.exists(tmp_path / "out.json")  # a manifest: a checkpoint of ours


def _metadata(path):
    from safetensors import safe_open
    with safe_open(str(path), "pt") as f:
        return f.metadata()


# -- refusals -------------------------------------------------------------------------------------
def _refused(tmp_path, inputs, out, pattern, **kw):
    with pytest.raises(MergeError, match=pattern) as exc:
        manual_merge(ManualMerge(inputs, str(tmp_path / out), **kw))
    assert not os.path.exists(tmp_path / out) or os.listdir(tmp_path / out) == []  # staging made the folder
    return str(exc.value)


def test_bad_adapters_are_named_all_at_once_and_nothing_is_written(tmp_path):
    dora = _adapter(tmp_path / "dora", {"p": (A1, B1)}, use_dora=True)
    ia3 = _adapter(tmp_path / "ia3", {"p": (A1, B1)}, peft_type="IA3")
    no_b = _adapter(tmp_path / "nob", {"p": (A1, B1)}, extra={f"{P}q.lora_A.weight": A1.clone()})
    rank = _adapter(tmp_path / "rank", {"p": (A1, B1)}, r=2)
    regex = _adapter(tmp_path / "re", {"p": (A1, B1)}, alpha_pattern={"(": 1})
    huge = _adapter(tmp_path / "huge", {"p": (A1, B1)}, rank_pattern={"x" * (MAX_PATTERN + 1): 1})
    msg = _refused(tmp_path, [dora, ia3, no_b, rank, regex, huge], "out", "6 problem")
    for want in ["DoRA (use_dora)", "peft_type is 'IA3'", "module q has", "module p has rank 1, its config says 2",
                 "key '(' is not a usable module pattern", "too long"]:
        assert want in msg


def test_a_pickled_adapter_is_never_read(tmp_path):
    os.makedirs(tmp_path / "ad")
    (tmp_path / "ad" / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 1, "lora_alpha": 1}))
    (tmp_path / "ad" / "adapter_model.bin").write_bytes(b"\x80\x04pickle")
    _refused(tmp_path, [str(tmp_path / "ad")], "out", "a .bin adapter is a pickle, never read")


def test_nonfinite_adapter_leaves_nothing(tmp_path):
    ad = _adapter(tmp_path / "ad", {"p": (torch.tensor([[1.0, float("nan")]]), B1)})
    base = _base(tmp_path / "base", {"p.weight": torch.zeros(3, 2)})
    _refused(tmp_path, [ad], "out", r"ad/adapter_model.safetensors: tensor base_model.model.p.lora_A.weight has NaN",
             base=base)


@pytest.mark.parametrize("kw, pattern", [
    ({"method": "ties", "params": {"density": 0.5}}, "fold each adapter into its base first"),
    ({"base": "ADAPTER"}, "is an adapter: --base names the model"),
    ({"out": "merged.safetensors"}, "writes a PEFT adapter directory"),
    ({"inputs": "MODEL"}, r"are not LoRA adapter directories"),
    ({"base": "OTHER"}, r"tensor p.weight is F32\[2, 3\], .*update of it is \[3, 2\]: the adapter is for another model"),
    ({"base": "NOWEIGHT"}, "has no tensor p.weight"),
])
def test_bad_combinations_are_refused(tmp_path, kw, pattern):
    ad = _adapter(tmp_path / "ad", {"p": (A1, B1)})
    paths = {"ADAPTER": ad, "MODEL": _base(tmp_path / "model", {"p.weight": torch.zeros(3, 2)}),
             "OTHER": _base(tmp_path / "other", {"p.weight": torch.zeros(2, 3)}),
             "NOWEIGHT": _base(tmp_path / "now", {"q.weight": torch.zeros(3, 2)})}
    inputs = [ad, paths[kw.pop("inputs")]] if "inputs" in kw else [ad]
    if "base" in kw:
        kw["base"] = paths[kw["base"]]
    _refused(tmp_path, inputs, kw.pop("out", "out"), pattern, **kw)


def test_adapters_of_different_models_are_refused(tmp_path):
    a1 = _adapter(tmp_path / "a1", {"p": (A1, B1)})
    a2 = _adapter(tmp_path / "a2", {"p": (torch.ones(1, 5), torch.ones(3, 1))})
    _refused(tmp_path, [a1, a2], "out", r"module p is \(3, 5\), .* has \(3, 2\): adapters of different models")


def test_hostile_files_in_an_adapter_dir_are_refused(tmp_path):
    garbage = tmp_path / "garbage"
    garbage.mkdir()
    (garbage / "adapter_config.json").write_text("{not json")
    big = _adapter(tmp_path / "big", {"p": (A1, B1)})
    (tmp_path / "big" / "adapter_config.json").write_text(json.dumps({"pad": "x" * (2 << 20)}))
    cut = _adapter(tmp_path / "cut", {"p": (A1, B1)})
    path = tmp_path / "cut" / "adapter_model.safetensors"
    path.write_bytes(path.read_bytes()[:-4])
    alien = _adapter(tmp_path / "alien", {"p": (A1, B1)}, extra={"weird.name": torch.ones(1)})
    fifo = tmp_path / "fifo"
    fifo.mkdir()
    os.mkfifo(fifo / "adapter_config.json")  # read, it would hang
    msg = _refused(tmp_path, [str(garbage), big, cut, alien, str(fifo)], "out", "5 problem")
    for want in ["garbage/adapter_config.json", "over the limit", "truncated",
                 "tensor weird.name does not start with 'base_model.model.'", "named pipe (FIFO)"]:
        assert want in msg


def test_adapters_and_output_on_memory_urls():
    import fsspec
    fs = fsspec.filesystem("memory")
    for name, (a, b) in {"a1": (A1, B1), "a2": (A2, B2)}.items():
        fs.pipe(f"/lora/{name}/adapter_model.safetensors", st_save({f"{P}p.lora_A.weight": a, f"{P}p.lora_B.weight": b}))
        fs.pipe(f"/lora/{name}/adapter_config.json", json.dumps({"peft_type": "LORA", "r": 1, "lora_alpha": 2}).encode())
    fs.pipe("/lora/base/model.safetensors", st_save({"p.weight": torch.zeros(3, 2)}))
    manual_merge(ManualMerge(["memory://lora/a1", "memory://lora/a2"], "memory://lora/out", base="memory://lora/base"))
    out = st_load(fs.cat("/lora/out/model.safetensors"))["p.weight"]
    assert torch.equal(out, B1 @ A1 + B2 @ A2)  # c = 1/2 each of 2 B A


def test_cli_merges_and_folds_adapters(tmp_path, capsys):
    from orchestrator.cli import main
    ads = [_adapter(tmp_path / "a1", {"p": (A1, B1)}), _adapter(tmp_path / "a2", {"p": (A2, B2)})]
    assert main(["merge", *ads, "--weights", "1,3", "--out", str(tmp_path / "m")]) == 0
    assert "adapter_config.json" in capsys.readouterr().out
    assert main(["merge", str(tmp_path / "m"), "--base", _base(tmp_path / "b", {"p.weight": torch.zeros(3, 2)}),
                 "--out", str(tmp_path / "f")]) == 0
    folded = load_file(str(tmp_path / "f" / "model.safetensors"))["p.weight"]
    assert torch.equal(folded, torch.tensor([[0.5, 7.0], [0.0, 1.5], [1.0, 2.0]]))  # as folding the two
    assert main(["merge", *ads, "--method", "ties", "--out", str(tmp_path / "x")]) == 2
    got = capsys.readouterr()
    assert "fold each adapter into its base first" in got.out + got.err


@settings(max_examples=15, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 3), st.floats(0.1, 4), st.floats(0.25, 2)), min_size=1, max_size=3),
       st.integers(0, 2 ** 16))
def test_property_merged_adapter_update_is_the_weighted_sum_of_updates(tmp_path_factory, specs, seed):
    """Any ranks, alphas and weights: B @ A of the merged adapter = sum_i c_i s_i B_i A_i (float64),
    and folding the merged adapter = folding the adapters."""
    tmp = tmp_path_factory.mktemp("prop")
    g = torch.Generator().manual_seed(seed)
    ads, ref = [], torch.zeros(5, 4, dtype=torch.float64)
    total = sum(w for *_, w in specs)
    for i, (r, alpha, w) in enumerate(specs):
        a, b = torch.randn(r, 4, generator=g), torch.randn(5, r, generator=g)
        ads.append(_adapter(tmp / f"a{i}", {"p": (a, b)}, r=r, alpha=alpha))
        ref += (w / total) * (alpha / r) * b.double() @ a.double()
    weights = [w for *_, w in specs]
    manual_merge(ManualMerge(ads, str(tmp / "m"), weights=weights))
    m = load_file(str(tmp / "m" / "adapter_model.safetensors"))
    merged = m[f"{P}p.lora_B.weight"].double() @ m[f"{P}p.lora_A.weight"].double()
    assert torch.allclose(merged, ref, rtol=1e-5, atol=1e-5)
    base = _base(tmp / "b", {"p.weight": torch.zeros(5, 4)})
    manual_merge(ManualMerge(ads, str(tmp / "f1"), weights=weights, base=base))
    manual_merge(ManualMerge([str(tmp / "m")], str(tmp / "f2"), base=base))
    f1, f2 = (load_file(str(tmp / d / "model.safetensors"))["p.weight"].double() for d in ("f1", "f2"))
    assert torch.allclose(f1, ref, rtol=1e-5, atol=1e-5) and torch.allclose(f2, ref, rtol=1e-5, atol=1e-5)


# -- PEFT as the oracle ----------------------------------------------------------------------------
try:
    import peft
    import transformers
except ImportError:  # test extras: installed by tests/run.sh
    peft = transformers = None
pytestmark_peft = pytest.mark.skipif(peft is None, reason="peft and transformers (the test extras) are not installed")


def _llama(path, dtype=torch.float32):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    transformers.LlamaForCausalLM(cfg).to(dtype).save_pretrained(path, max_shard_size="20KB")
    return str(path)


def _peft_adapter(base, path, seed, **lora):
    """A real PEFT adapter with random (not zero) B, as after training."""
    torch.manual_seed(seed)
    m = transformers.LlamaForCausalLM.from_pretrained(base)
    p = peft.get_peft_model(m, peft.LoraConfig(init_lora_weights=False, **lora))
    if lora.get("modules_to_save"):
        with torch.no_grad():
            p.base_model.model.lm_head.modules_to_save["default"].weight.add_(0.01 * seed)
    p.save_pretrained(path)
    return str(path)


def _load(base, *adapters):
    m = transformers.LlamaForCausalLM.from_pretrained(base)
    return peft.PeftModel.from_pretrained(m, adapters[0]) if adapters else m


SPEC1 = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj", "embed_tokens"],
         "rank_pattern": {"layers.1.self_attn.q_proj": 2}}
SPEC2 = {"r": 2, "lora_alpha": 16, "target_modules": ["q_proj", "o_proj"], "use_rslora": True}


@pytestmark_peft
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fold_equals_peft_merge_and_unload_bitwise(tmp_path, dtype):
    """A sharded base (several files + index), LoRA on linear layers and the embedding, a rank pattern."""
    base = _llama(tmp_path / "base", dtype)
    ad = _peft_adapter(base, tmp_path / "ad", 1, **SPEC1)
    manual_merge(ManualMerge([ad], str(tmp_path / "out"), base=base))
    want = peft.PeftModel.from_pretrained(transformers.LlamaForCausalLM.from_pretrained(base, dtype=dtype),
                                          ad).merge_and_unload().state_dict()
    got = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "out"), dtype=dtype).state_dict()
    assert got.keys() == want.keys()
    differ = [k for k in want if not torch.equal(want[k], got[k])]
    if dtype == torch.float32:
        assert differ == []
    else:  # PEFT rounds an embedding's update to bf16 before adding it (two roundings), we once
        assert differ == ["model.embed_tokens.weight"]
        w, g = want[differ[0]].float(), got[differ[0]].float()
        assert ((g - w).abs() <= w.abs() * 2 ** -7).all()
    assert os.path.exists(tmp_path / "out" / "model.safetensors.index.json")


@pytestmark_peft
def test_merge_equals_peft_cat_bitwise_and_loads_with_peft(tmp_path):
    """Different ranks, target modules and scalings (rslora); PEFT's add_weighted_adapter 'cat'
    gives the same tensors, and PEFT loads our adapter directory."""
    base = _llama(tmp_path / "base")
    a1, a2 = _peft_adapter(base, tmp_path / "a1", 1, **SPEC1), _peft_adapter(base, tmp_path / "a2", 2, **SPEC2)
    manual_merge(ManualMerge([a1, a2], str(tmp_path / "out"), weights=[1, 3]))
    pm = peft.PeftModel.from_pretrained(transformers.LlamaForCausalLM.from_pretrained(base), a1, adapter_name="a1")
    pm.load_adapter(a2, adapter_name="a2")
    pm.add_weighted_adapter(["a1", "a2"], [0.25, 0.75], "cat", combination_type="cat")
    got = load_file(str(tmp_path / "out" / "adapter_model.safetensors"))
    lora = {k: v for k, v in got.items() if ".lora_" in k}
    assert [k for k in got if k not in lora] == [f"{P}model.embed_tokens.base_layer.weight"]  # PEFT saves it
    want = _adapter_tensors(pm, "cat")
    assert sorted(lora) == sorted(want)
    assert [k for k in lora if not torch.equal(lora[k], want[k])] == []
    loaded = peft.PeftModel.from_pretrained(transformers.LlamaForCausalLM.from_pretrained(base), str(tmp_path / "out"))
    have = _adapter_tensors(loaded, "default")
    assert sorted(have) == sorted(lora) and all(torch.equal(have[k], v) for k, v in lora.items())


def _adapter_tensors(model, name):
    """A PeftModel's tensors of adapter `name`, named as in a saved adapter file."""
    return {re.sub(rf"\.{name}(\.|$)", r"\1", k): v for k, v in model.state_dict().items()
            if re.search(rf"\.lora_\w+\.{name}(\.|$)", k)}


@pytestmark_peft
def test_merged_adapter_and_fold_match_a_float64_reference(tmp_path):
    """The merged adapter, loaded by PEFT, and the two adapters folded into the base both compute the
    model whose weights are base + 1/4 delta1 + 3/4 delta2 in float64 (modules_to_save heads averaged)."""
    base = _llama(tmp_path / "base")
    spec = {"modules_to_save": ["lm_head"]}
    a1 = _peft_adapter(base, tmp_path / "a1", 1, **SPEC1, **spec)
    a2 = _peft_adapter(base, tmp_path / "a2", 2, **SPEC2, **spec)
    manual_merge(ManualMerge([a1, a2], str(tmp_path / "merged"), weights=[1, 3]))
    manual_merge(ManualMerge([a1, a2], str(tmp_path / "folded"), weights=[1, 3], base=base))
    b = _load(base).state_dict()
    ft = [_load(base, a).merge_and_unload().state_dict() for a in (a1, a2)]
    ref = {k: (b[k].double() + 0.25 * (ft[0][k].double() - b[k].double())
               + 0.75 * (ft[1][k].double() - b[k].double())) for k in b}
    folded = _load(str(tmp_path / "folded")).state_dict()
    assert max((folded[k].double() - ref[k]).abs().max().item() for k in ref) < 1e-6
    oracle = _load(base)
    oracle.load_state_dict({k: v.float() for k, v in ref.items()})
    x = torch.randint(0, 64, (2, 8))
    with torch.no_grad():
        got = _load(base, str(tmp_path / "merged"))(x).logits
        assert (got - oracle(x).logits).abs().max().item() < 1e-5


@pytestmark_peft
def test_gpt2_conv1d_fold_equals_peft(tmp_path):
    """GPT-2's Conv1D stores weights transposed (fan_in_fan_out): the update is (B @ A).T."""
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=64, n_positions=32)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(tmp_path / "base")
    m = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "base")
    p = peft.get_peft_model(m, peft.LoraConfig(r=4, target_modules=["c_attn"], fan_in_fan_out=True, init_lora_weights=False))
    p.save_pretrained(tmp_path / "ad")
    manual_merge(ManualMerge([str(tmp_path / "ad")], str(tmp_path / "out"), base=str(tmp_path / "base")))
    want = peft.PeftModel.from_pretrained(transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "base"),
                                          tmp_path / "ad").merge_and_unload().state_dict()
    got = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert torch.equal(got["transformer.h.0.attn.c_attn.weight"], want["transformer.h.0.attn.c_attn.weight"])
    assert not torch.equal(got["transformer.h.0.attn.c_attn.weight"],
                           load_file(str(tmp_path / "base" / "model.safetensors"))["transformer.h.0.attn.c_attn.weight"])


@pytest.mark.parametrize("cfg, pattern", [
    ({"rank_pattern": {"(a+)+$": 1}}, "can take for ever"),  # catastrophic backtracking on a module name
    ({"alpha_pattern": {".*" * 10: 2.0}}, "can take for ever"),
    ({"r": 10**15}, "not a positive integer up to 65536"),  # allocated petabytes
    ({"lora_alpha": 1e308}, "not a nonzero number up to 1e\\+06"),  # made the merged adapter Inf
])
def test_hostile_adapter_configs_are_refused_at_once(tmp_path, cfg, pattern):
    ad = _adapter(tmp_path / "ad", {"p": (A1, B1)}, **cfg)
    _refused(tmp_path, [ad, _adapter(tmp_path / "ad2", {"p": (A2, B2)})], "out", pattern)
