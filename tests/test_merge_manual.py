"""`orchestrate merge` and the merge methods: hand-worked numbers, plain-torch oracles, files in and out.

Every method is checked against an independent computation on the full tensors (plain torch,
no merge code), through real files: single safetensors, Hugging Face sharded directories, and
memory:// URLs. Every error case is checked for its message and for leaving nothing behind.
"""
from __future__ import annotations

import itertools
import json
import math
import os
import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load as st_load
from safetensors.torch import load_file, save_file
from safetensors.torch import save as st_save

import merge.engine as engine
from core.checkpoint_writer import write_checkpoint
from core.config import OuterConfig
from core.storage import Storage
from merge.manual import ManualMerge, MergeError, manual_merge
from merge.methods import average, check_method_args, get_method, median, slerp, task_arithmetic

ties = get_method("ties")

_ids = itertools.count()


# -- helpers ---------------------------------------------------------------------------------
def _save(path, tensors, manifest=False):
    """A plain safetensors file (as from elsewhere), or one of ours with a manifest."""
    if manifest:
        st_ = Storage(os.path.dirname(path))
        write_checkpoint(st_, os.path.basename(path), tensors)
    else:
        save_file({k: v.contiguous() for k, v in tensors.items()}, path)
    return path


def _model(seed, shapes=None, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    shapes = shapes or {"emb": (7, 5), "layer.w": (5, 5), "layer.b": (5,), "scalar": ()}
    return {k: torch.randn(s, generator=g).to(dtype) for k, s in shapes.items()}


def _merge_files(tmp_path, models, out="out.safetensors", **kw):
    paths = [_save(str(tmp_path / f"in{i}.safetensors"), m) for i, m in enumerate(models)]
    if "base" in kw and isinstance(kw["base"], dict):
        kw["base"] = _save(str(tmp_path / "base.safetensors"), kw["base"])
    manual_merge(ManualMerge(paths, str(tmp_path / out), **kw))
    return load_file(str(tmp_path / out))


def _files(tmp_path):
    return sorted(p.name for p in tmp_path.iterdir())


# -- hand-worked numbers ---------------------------------------------------------------------
def test_task_arithmetic_by_hand():
    # Prepare: task vectors [1,0] and [0,3]; weighted sum [1, 1.5]; scale 2 -> [2, 3]
    base = torch.tensor([1.0, 2.0])
    ts = [torch.tensor([2.0, 2.0]), torch.tensor([1.0, 5.0])]
    # Execute
    out = task_arithmetic(ts, [1.0, 0.5], base=base, scale=2.0)
    # Assert: base + [2, 3]
    assert torch.allclose(out, torch.tensor([3.0, 5.0]))


def test_ties_by_hand():
    # Prepare: density 0.5 keeps the 2 largest magnitudes of each task vector (base is 0):
    # t1 [3,-1,.5,2] -> [3,0,0,2]; t2 [-2,-4,1,.1] -> [-2,-4,0,0]; t3 [2.5,2,-3,.2] -> [2.5,0,-3,0]
    # weighted sums (w = 1,1,2): [6, -4, -6, 2] -> elected signs [+, -, -, +]
    # disjoint weighted means: e0 (3*1 + 2.5*2)/3 = 8/3; e1 -4; e2 -3; e3 2
    ts = [torch.tensor([3.0, -1.0, 0.5, 2.0]), torch.tensor([-2.0, -4.0, 1.0, 0.1]), torch.tensor([2.5, 2.0, -3.0, 0.2])]
    # Execute
    out = ties(ts, [1.0, 1.0, 2.0], base=torch.zeros(4), density=0.5)
    # Assert
    assert torch.allclose(out, torch.tensor([8 / 3, -4.0, -3.0, 2.0]))


def test_ties_scale_and_base_by_hand():
    base = torch.tensor([10.0, 10.0])
    ts = [torch.tensor([12.0, 9.0]), torch.tensor([14.0, 11.0])]  # task vectors [2,-1], [4,1]
    # density 1: no trimming; sums [6, 0]: signs [+, + (a sum of exactly 0 elects +, as mergekit)]
    # agreeing means [3, 1]; scale .5 -> base + [1.5, 0.5]
    out = ties(ts, [1.0, 1.0], base=base, density=1.0, scale=0.5)
    assert torch.equal(out, torch.tensor([11.5, 10.5]))
    # normalize=False (mergekit's normalize: false): the agreeing entries' weighted sum [6, 1], scaled
    assert torch.equal(ties(ts, [1.0, 1.0], base=base, density=1.0, scale=0.5, normalize=False), torch.tensor([13.0, 10.5]))


def test_ties_keeps_int_of_density_times_n_as_mergekit():
    # density 0.07 of 100 entries: 0.07 * 100 = 7.000000000000001 in floats; int() keeps 7, ceil() kept 8
    tv = torch.arange(1.0, 101.0)  # distinct magnitudes 1..100
    out = ties([tv], [1.0], base=torch.zeros(100), density=0.07)
    assert torch.equal(out.nonzero().flatten(), torch.arange(93, 100))  # the 7 largest: 94..100
    # density * n under 1 still keeps the largest entry (mergekit refuses k = 0)
    assert torch.equal(ties([tv], [1.0], base=torch.zeros(100), density=0.001).nonzero().flatten(), torch.tensor([99]))


def test_task_arithmetic_forms_each_task_vector_first():
    # base 1, three fine-tunes one float32 step above it (1 + 2^-23): the exact answer, 1 + 3 * 2^-23,
    # is a float32; summing the weights first gives 3 + 3 * 2^-23, which float32 cannot hold
    base = torch.ones(1)
    t = torch.full((1,), 1.0 + 2.0**-23)
    assert torch.equal(task_arithmetic([t, t, t], [1.0, 1.0, 1.0], base=base), torch.full((1,), 1.0 + 3 * 2.0**-23))
    # the case against float64: K = 8 task vectors of 1e-5 on weights around 1
    g = torch.Generator().manual_seed(0)
    b = 1 + 0.1 * torch.randn(100_000, generator=g)
    fts = [b + 1e-5 * torch.randn(100_000, generator=g) for _ in range(8)]
    exact = b.double() + sum(f.double() - b.double() for f in fts)
    assert (task_arithmetic(fts, [1.0] * 8, base=b).double() - exact).abs().max() < 2.5e-7  # was 1.7e-6


def test_slerp_by_hand():
    # orthogonal a = [2, 0], b = [0, 3]: angle pi/2; t = 0.5 -> s0 = s1 = sin(pi/4) / sin(pi/2) = 0.7071
    a, b = torch.tensor([2.0, 0.0]), torch.tensor([0.0, 3.0])
    assert torch.allclose(slerp([a, b], [1, 1], t=0.5), torch.tensor([2.0, 3.0]) * math.sqrt(0.5))
    assert torch.equal(slerp([a, b], [1, 1], t=0.0), a) and torch.allclose(slerp([a, b], [1, 1], t=1.0), b)
    # colinear ([1, 1] and [2, 2]): the straight line, 0.75 a + 0.25 b
    assert torch.equal(slerp([torch.ones(2), torch.full((2,), 2.0)], [1, 1], t=0.25), torch.full((2,), 1.25))


def test_slerp_streamed_in_slices_matches_mergekits_formula_in_float64(tmp_path):
    a, b = _model(1), _model(2)
    paths = [_save(str(tmp_path / f"{n}.safetensors"), m) for n, m in (("a", a), ("b", b))]
    out = str(tmp_path / "s.safetensors")
    manual_merge(ManualMerge(paths, out, method="slerp", params={"t": 0.3},
                             buffer_bytes=1))  # 1-byte buffers: many slices
    got = load_file(out)
    for k in a:  # mergekit's slerp (merge_methods/slerp.py), written out in float64
        x, y = a[k].double().reshape(-1), b[k].double().reshape(-1)
        dot = float((x / x.norm()) @ (y / y.norm()))
        if abs(dot) > 0.9995:  # nearly colinear (the 1-element tensor): the straight line
            s0, s1 = 0.7, 0.3
        else:
            theta = math.acos(dot)
            s0, s1 = math.sin(0.7 * theta) / math.sin(theta), math.sin(0.3 * theta) / math.sin(theta)
        want = s0 * a[k].double() + s1 * b[k].double()
        assert torch.allclose(got[k].double(), want, rtol=1e-6, atol=1e-6), k
    problems = check_method_args("slerp", [1.0, 1.0, 1.0], {"t": 1.5}, has_base=False)
    assert problems == ["slerp takes exactly 2 input models; got 3", "t must be in [0, 1], got 1.5"]


def test_median_by_hand():
    ts = [torch.tensor([1.0, 5.0, 3.0]), torch.tensor([2.0, 0.0, 3.0]), torch.tensor([9.0, 1.0, -1.0])]
    assert torch.equal(median(ts, [1, 1, 1]), torch.tensor([2.0, 1.0, 3.0]))
    assert torch.equal(median(ts[:2], [1, 1]), torch.tensor([1.5, 2.5, 3.0]))  # even count: mean of the middle two


# -- every method through files, against plain torch on the full tensors -------------------
def _oracle(method, models, weights, base=None, density=0.2, scale=1.0):
    out = {}
    for k in models[0]:
        xs = torch.stack([m[k].double() for m in models])
        w = torch.tensor(weights, dtype=torch.float64).reshape(-1, *[1] * (xs.dim() - 1))
        if method == "average":
            out[k] = (w * xs).sum(0) / w.sum()
        elif method == "task-arithmetic":
            out[k] = base[k].double() + scale * (w * (xs - base[k].double())).sum(0)
        elif method == "median":
            out[k] = torch.quantile(xs.reshape(len(models), -1), 0.5, dim=0).reshape(xs.shape[1:])
        elif method == "ties":
            tv = (xs - base[k].double()).reshape(len(models), -1)
            n = tv.shape[1]
            kk = max(1, int(density * n))  # mergekit's count (sparsify.magnitude)
            for i in range(len(models)):  # plain top-k by sorting
                thresh = tv[i].abs().sort(descending=True).values[kk - 1]
                tv[i] = torch.where(tv[i].abs() >= thresh, tv[i], torch.zeros(()))
            wf = w.reshape(-1, 1)
            sign = torch.where((wf * tv).sum(0) >= 0, 1.0, -1.0).double()  # mergekit: a tie elects +
            agree = ((torch.sign(tv) == sign) & (tv != 0)).double()
            den = (wf * agree).sum(0)
            mean = torch.where(den > 0, (wf * tv * agree).sum(0) / den.clamp_min(1e-300), torch.zeros(()))
            out[k] = base[k].double() + scale * mean.reshape(xs.shape[1:])
    return out


@pytest.mark.parametrize("method", ["average", "task-arithmetic", "ties", "median"])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_methods_match_plain_torch(tmp_path, method, k):
    models = [_model(i) for i in range(k)]
    weights = [0.5, 2.0, 1.25][:k] if method != "median" else [1.0] * k  # not summing to 1
    kw = {}
    base = None
    if method in ("task-arithmetic", "ties"):
        base = _model(100)
        kw["base"] = base
        kw["params"] = {"scale": 0.7, **({"density": 0.4} if method == "ties" else {})}
    got = _merge_files(tmp_path, models, method=method, weights=weights, **kw)
    want = _oracle(method, models, weights, base, **kw.get("params", {}))
    for name in want:
        assert got[name].dtype == torch.float32 and got[name].shape == models[0][name].shape
        assert torch.allclose(got[name].double(), want[name], atol=1e-5), (method, k, name)


def test_bf16_inputs_accumulate_in_fp32(tmp_path):
    # 1 + 2^-7 is representable in bf16; the mean of three of them and a 1.0 is 1 + .75*2^-7, which
    # a bf16 running sum would lose. The output is bf16 (the inputs' dtype), rounded once at the end.
    xs = [{"w": torch.full((4,), 1.0 + 2**-7, dtype=torch.bfloat16)} for _ in range(3)] + [{"w": torch.ones(4, dtype=torch.bfloat16)}]
    got = _merge_files(tmp_path, xs)["w"]
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, torch.full((4,), 1.0 + 0.75 * 2**-7).to(torch.bfloat16))
    models = [_model(i, dtype=torch.bfloat16) for i in range(3)]
    got = _merge_files(tmp_path, models, out="m.safetensors", weights=[1, 2, 3])
    want = _oracle("average", models, [1, 2, 3])
    for name in want:
        assert torch.equal(got[name], want[name].float().to(torch.bfloat16)), name


def test_chunked_streaming_equals_whole_tensors(tmp_path, monkeypatch):
    """Tensors cut in slices of 3 elements (tiny buffers) give the same bytes as whole tensors."""
    models = [_model(i, {"a": (7, 5), "b": (11,), "c": ()}) for i in range(3)]
    whole = _merge_files(tmp_path, models, out="whole.safetensors", weights=[1, 2, 3])
    monkeypatch.setattr(engine, "_MIN_CHUNK", 3)
    paths = [str(tmp_path / f"in{i}.safetensors") for i in range(3)]
    manual_merge(ManualMerge(paths, str(tmp_path / "sliced.safetensors"), weights=[1, 2, 3], buffer_bytes=1))
    sliced = load_file(str(tmp_path / "sliced.safetensors"))
    for k in whole:
        assert torch.equal(whole[k], sliced[k])


def test_a_merge_runs_torch_on_one_thread_and_restores_it(tmp_path, monkeypatch):
    """The maths are memory-bound and the cores are the readers' and the writer's: torch uses one
    thread while a merge runs, and gets its own count back after, also when the merge fails."""
    models = [_model(i, {"a": (100, 100), "b": (7,)}) for i in range(3)]
    _merge_files(tmp_path, models, out="warm.safetensors")
    paths = [str(tmp_path / f"in{i}.safetensors") for i in range(3)]
    inside = []
    run = engine._Run.run
    monkeypatch.setattr(engine._Run, "run", lambda *a: (inside.append(torch.get_num_threads()), run(*a))[1])
    threads = torch.get_num_threads()
    manual_merge(ManualMerge(paths, str(tmp_path / "out.safetensors")))
    assert inside == [1] and torch.get_num_threads() == threads
    with pytest.raises(MergeError):
        manual_merge(ManualMerge([*paths, str(tmp_path / "absent.safetensors")], str(tmp_path / "out2.safetensors")))
    assert torch.get_num_threads() == threads


# -- outer: torch.optim stepped directly, state round-tripped through its file --------------
@pytest.mark.parametrize("opt, chunked", [("nesterov", False), ("nesterov", True), ("adam", True)])
def test_outer_matches_torch_optim_with_state_file(tmp_path, monkeypatch, opt, chunked):
    if chunked:  # slices of 4 elements: the state streams (momentum) or is gathered per tensor (Adam)
        monkeypatch.setattr(engine, "_MIN_CHUNK", 4)
    cfg = OuterConfig(optimizer=opt, lr=0.7 if opt == "nesterov" else 0.05, momentum=0.9, eps=0.1)
    torch.manual_seed(0)
    params = {k: torch.nn.Parameter(torch.randn(s)) for k, s in {"a": (3, 5), "b": (6,), "c": ()}.items()}
    oracle = (torch.optim.SGD(list(params.values()), lr=0.7, momentum=0.9, nesterov=True) if opt == "nesterov"
              else torch.optim.Adam(list(params.values()), lr=0.05, betas=(0.9, 0.95), eps=0.1))
    _save(str(tmp_path / "g0.safetensors"), {k: p.detach().clone() for k, p in params.items()})
    state = str(tmp_path / "outer_state.safetensors")
    for r in range(3):
        workers = [{k: p.detach() + 0.3 * torch.randn(p.shape) for k, p in params.items()} for _ in range(2)]
        paths = [_save(str(tmp_path / f"w{r}_{i}.safetensors"), w) for i, w in enumerate(workers)]
        manual_merge(ManualMerge(paths, str(tmp_path / f"g{r + 1}.safetensors"), method="outer", weights=[1.0, 3.0],
                     base=str(tmp_path / f"g{r}.safetensors"), outer=cfg, state=state, buffer_bytes=1))
        for k, p in params.items():  # the oracle: pseudo-gradient into .grad, one real step
            p.grad = p.detach() - (1.0 * workers[0][k] + 3.0 * workers[1][k]) / 4.0
        oracle.step()
        got = load_file(str(tmp_path / f"g{r + 1}.safetensors"))
        for k, p in params.items():
            assert torch.allclose(got[k], p.detach(), atol=1e-6), (r, k)
    saved = load_file(state)
    for k, p in params.items():
        for slot, t in oracle.state[p].items():
            assert torch.allclose(saved[f"{k}::{slot}"], t.float(), atol=1e-6), (k, slot)
    assert json.loads((tmp_path / "outer_state.json").read_text())["optimizer"] == opt  # a manifest: verified next time


# -- layouts and URLs ------------------------------------------------------------------------
def _hf_dir(path, tensors, groups, extra=True):
    """A Hugging Face-style sharded directory built by hand: shards + index + config + tokenizer."""
    path.mkdir()
    weight_map = {}
    for i, names in enumerate(groups):
        shard = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        save_file({n: tensors[n] for n in names}, str(path / shard), metadata={"format": "pt"})
        weight_map.update({n: shard for n in names})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    if extra:
        (path / "config.json").write_text('{"model_type": "toy"}')
        (path / "tokenizer.json").write_text('{"vocab": {}}')
        (path / "pytorch_model.bin").write_bytes(b"not copied")
    return str(path)


def test_hf_sharded_dir_in_and_out(tmp_path):
    groups = [["emb", "layer.b"], ["layer.w"], ["scalar"]]
    models = [_model(i) for i in range(3)]
    dirs = [_hf_dir(tmp_path / f"m{i}", m, groups) for i, m in enumerate(models)]
    out = tmp_path / "out"
    manual_merge(ManualMerge(dirs, str(out), weights=[1, 1, 2]))
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model-00001-of-00003.safetensors",
                                                    "model-00002-of-00003.safetensors", "model-00003-of-00003.safetensors",
                                                    "model.safetensors.index.json", "tokenizer.json"]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index == json.loads((tmp_path / "m0" / "model.safetensors.index.json").read_text())
    want = _oracle("average", models, [1, 1, 2])
    for i, names in enumerate(groups):
        shard = load_file(str(out / f"model-{i + 1:05d}-of-00003.safetensors"))
        assert sorted(shard) == sorted(names)
        for n in names:
            assert torch.allclose(shard[n].double(), want[n], atol=1e-6)
    from safetensors import safe_open
    with safe_open(str(out / "model-00001-of-00003.safetensors"), "pt") as f:
        meta = f.metadata()
    assert meta["format"] == "pt"  # transformers refuses shards without it
    assert json.loads(meta["islands.merge"]) == {"method": "average", "inputs": dirs, "weights": [1.0, 1.0, 2.0]}
    # a sharded input can also be merged into one file, and mixed with plain files
    manual_merge(ManualMerge([dirs[0], _save(str(tmp_path / "one.safetensors"), models[1])],
                             str(tmp_path / "flat.safetensors")))
    flat = load_file(str(tmp_path / "flat.safetensors"))
    assert torch.allclose(flat["layer.w"], (models[0]["layer.w"] + models[1]["layer.w"]) / 2)


def test_hf_transformers_round_trip(tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16, bos_token_id=0,
                                  eos_token_id=0)
    models = []
    for i in range(2):
        torch.manual_seed(i)
        m = transformers.GPT2LMHeadModel(cfg)
        m.save_pretrained(str(tmp_path / f"g{i}"), max_shard_size="20KB")
        models.append(m)
    assert (tmp_path / "g0" / "model.safetensors.index.json").exists()
    manual_merge(ManualMerge([str(tmp_path / "g0"), str(tmp_path / "g1")], str(tmp_path / "merged")))
    merged = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path / "merged"))
    sd0, sd1 = models[0].state_dict(), models[1].state_dict()
    for k, v in merged.state_dict().items():
        assert torch.allclose(v, (sd0[k] + sd1[k]) / 2, atol=1e-6), k


def test_memory_urls_in_and_out():
    root = f"memory://manual-{next(_ids)}"
    s = Storage(root)
    models = [_model(i) for i in range(2)]
    write_checkpoint(s, "a.safetensors", models[0])  # ours, with a manifest: verified
    s.write_bytes("b.safetensors", st_save(models[1]))  # plain, without one
    manual_merge(ManualMerge([f"{root}/a.safetensors", f"{root}/b.safetensors"], f"{root}/out/merged.safetensors",
                             weights=[3, 1]))
    got = st_load(s.read_bytes("out/merged.safetensors"))
    for k in got:
        assert torch.allclose(got[k], (3 * models[0][k] + models[1][k]) / 4, atol=1e-6)
    assert s.read_json("out/merged.json")["digest"]


# -- errors: each names file and tensor, and nothing is written ------------------------------
def _pair(tmp_path, second):
    a = _save(str(tmp_path / "a.safetensors"), {"w": torch.ones(2, 2), "b": torch.ones(2)})
    b = _save(str(tmp_path / "b.safetensors"), second)
    return [a, b]


@pytest.mark.parametrize("second, pattern", [
    ({"w": torch.ones(2, 2)}, r"b\.safetensors: tensor names differ .*missing \['b'\]"),
    ({"w": torch.ones(2, 3), "b": torch.ones(2)}, r"b\.safetensors: tensor w is F32\[2, 3\], .*a\.safetensors has F32\[2, 2\]"),
    ({"w": torch.ones(2, 2, dtype=torch.bfloat16), "b": torch.ones(2)}, r"b\.safetensors: tensor w is BF16\[2, 2\]"),
    ({"w": torch.ones(2, 2), "b": torch.tensor([1.0, float("nan")])}, r"b\.safetensors: tensor b has NaN or Inf"),
    ({"w": torch.full((2, 2), float("-inf")), "b": torch.ones(2)}, r"b\.safetensors: tensor w has NaN or Inf"),
])
def test_bad_input_is_named_and_nothing_written(tmp_path, second, pattern):
    paths = _pair(tmp_path, second)
    before = _files(tmp_path)
    with pytest.raises(MergeError, match=pattern):
        manual_merge(ManualMerge(paths, str(tmp_path / "out.safetensors")))
    assert _files(tmp_path) == before  # no output, no manifest, no temporary


def test_nonfinite_late_in_the_stream_leaves_nothing(tmp_path, monkeypatch):
    """A NaN in the last slice of the last tensor, found after earlier slices were written out."""
    monkeypatch.setattr(engine, "_MIN_CHUNK", 2)
    bad = {"a": torch.ones(10), "z": torch.ones(10)}
    bad["z"][-1] = float("nan")
    paths = [_save(str(tmp_path / "x.safetensors"), {"a": torch.ones(10), "z": torch.ones(10)}),
             _save(str(tmp_path / "y.safetensors"), bad)]
    (tmp_path / "out").mkdir()
    with pytest.raises(MergeError, match=r"y\.safetensors: tensor z has NaN or Inf"):
        manual_merge(ManualMerge(paths, str(tmp_path / "out" / "m.safetensors"), buffer_bytes=1))
    assert os.listdir(tmp_path / "out") == []


def test_missing_truncated_and_garbage_files(tmp_path):
    good = _save(str(tmp_path / "good.safetensors"), {"w": torch.ones(64)})
    raw = (tmp_path / "good.safetensors").read_bytes()
    (tmp_path / "trunc.safetensors").write_bytes(raw[:-10])
    (tmp_path / "junk.safetensors").write_bytes(b"this is not a safetensors file at all")
    (tmp_path / "badjson.safetensors").write_bytes(struct.pack("<Q", 4) + b"{{{{")
    with pytest.raises(MergeError) as info:
        manual_merge(ManualMerge([good, str(tmp_path / "trunc.safetensors"), str(tmp_path / "junk.safetensors"),
                      str(tmp_path / "badjson.safetensors"), str(tmp_path / "nope.safetensors")],
                     str(tmp_path / "out.safetensors")))
    msg = str(info.value)
    assert "4 problem(s)" in msg  # all reported at once
    assert "trunc.safetensors: file is truncated: its header describes 328 bytes, the file has 318" in msg
    assert "junk.safetensors: header length" in msg and "not a safetensors file" in msg
    assert "badjson.safetensors: safetensors header is not valid JSON" in msg
    assert "nope.safetensors: no such file or directory" in msg
    assert not (tmp_path / "out.safetensors").exists()


def test_manifest_checksum_is_verified(tmp_path):
    a = _save(str(tmp_path / "a.safetensors"), {"w": torch.ones(8)}, manifest=True)
    b = _save(str(tmp_path / "b.safetensors"), {"w": torch.zeros(8)}, manifest=True)
    manual_merge(ManualMerge([a, b], str(tmp_path / "ok.safetensors")))  # intact: fine
    raw = bytearray((tmp_path / "b.safetensors").read_bytes())
    raw[-1] ^= 0x01  # flip a bit of the data behind the manifest's back (still finite)
    (tmp_path / "b.safetensors").write_bytes(bytes(raw))
    with pytest.raises(MergeError, match=r"b\.safetensors: checksum does not match the manifest"):
        manual_merge(ManualMerge([a, b], str(tmp_path / "out.safetensors")))
    assert not (tmp_path / "out.safetensors").exists() and not (tmp_path / "out.json").exists()


def test_failed_outer_merge_keeps_the_old_state(tmp_path):
    base = _save(str(tmp_path / "g.safetensors"), {"w": torch.zeros(3)})
    w0 = _save(str(tmp_path / "w0.safetensors"), {"w": torch.ones(3)})
    state = str(tmp_path / "state.safetensors")
    manual_merge(ManualMerge([w0], str(tmp_path / "g1.safetensors"), method="outer", base=base, state=state))
    before = (tmp_path / "state.safetensors").read_bytes()
    bad = _save(str(tmp_path / "bad.safetensors"), {"w": torch.tensor([1.0, float("inf"), 0.0])})
    with pytest.raises(MergeError, match="tensor w has NaN or Inf"):
        manual_merge(ManualMerge([w0, bad], str(tmp_path / "g2.safetensors"), method="outer", base=base, state=state))
    assert (tmp_path / "state.safetensors").read_bytes() == before and not (tmp_path / "g2.safetensors").exists()


@pytest.mark.parametrize("kw, pattern", [
    ({"method": "ties"}, "method ties needs a base model"),
    ({"method": "average", "base": "B"}, "method average does not use a base model"),
    ({"method": "ties", "base": "B", "params": {"density": 0}}, r"density must be in \(0, 1\]"),
    ({"method": "average", "params": {"density": 0.5}}, r"takes no parameter\(s\) \['density'\]"),
    ({"weights": [1.0]}, "1 weights for 2 inputs"),
    ({"weights": [1.0, -1.0]}, "weights must sum to a positive number"),
    ({"method": "median", "weights": [1.0, 2.0]}, "median is unweighted"),
    ({"method": "average", "state": "s.safetensors"}, "--outer-state are for --method outer"),
    ({"method": "nope"}, "valid methods: average, breadcrumbs, .*, ties"),
])
def test_bad_arguments_are_refused_before_reading(tmp_path, kw, pattern):
    paths = _pair(tmp_path, {"w": torch.ones(2, 2), "b": torch.ones(2)})
    if kw.get("base") == "B":
        kw["base"] = paths[0]
    with pytest.raises((MergeError, ValueError), match=pattern):
        manual_merge(ManualMerge(paths, str(tmp_path / "out.safetensors"), **kw))
    assert not (tmp_path / "out.safetensors").exists()


def test_output_may_not_overwrite_an_input(tmp_path):
    paths = _pair(tmp_path, {"w": torch.ones(2, 2), "b": torch.ones(2)})
    with pytest.raises(MergeError, match="is also an input"):
        manual_merge(ManualMerge(paths, paths[1]))


# -- the command line ------------------------------------------------------------------------
def test_cli_merge(tmp_path, capsys):
    from orchestrator.cli import main
    paths = _pair(tmp_path, {"w": torch.full((2, 2), 3.0), "b": torch.full((2,), 3.0)})
    out = str(tmp_path / "cli.safetensors")
    assert main(["merge", *paths, "--out", out, "--weights", "1,3"]) == 0
    assert torch.equal(load_file(out)["w"], torch.full((2, 2), 2.5))
    assert "merged 2 input(s) with average" in capsys.readouterr().out
    base = paths[0]
    assert main(["merge", paths[1], "--out", str(tmp_path / "o.safetensors"), "--method", "outer", "--base", base,
                 "--outer-optimizer", "sgd", "--outer-lr", "1.0", "--outer-state", str(tmp_path / "st.safetensors")]) == 0
    assert torch.equal(load_file(str(tmp_path / "o.safetensors"))["w"], torch.full((2, 2), 3.0))  # sgd lr 1 = average
    assert main(["merge", paths[0], "--out", str(tmp_path / "x.safetensors"), "--method", "ties"]) == 2
    assert "method ties needs a base model" in capsys.readouterr().out


def test_cli_outer_adam_betas_and_eps_reach_torch_optim(tmp_path, capsys):
    from orchestrator.cli import build_parser, main
    w0, w1 = torch.tensor([1.0, -2.0, 0.5]), torch.tensor([0.0, 1.0, 0.25])
    base, ft = str(tmp_path / "g.safetensors"), str(tmp_path / "w.safetensors")
    save_file({"w": w0}, base)
    save_file({"w": w1}, ft)
    out = str(tmp_path / "o.safetensors")
    assert main(["merge", ft, "--out", out, "--method", "outer", "--base", base, "--outer-optimizer", "adam",
                 "--outer-lr", "0.5", "--outer-betas", "0.8,0.99", "--outer-eps", "0.001"]) == 0
    p = torch.nn.Parameter(w0.clone())  # the oracle: torch.optim.Adam's first step on the pseudo-gradient
    opt = torch.optim.Adam([p], lr=0.5, betas=(0.8, 0.99), eps=0.001)
    p.grad = w0 - w1
    opt.step()
    assert torch.equal(load_file(out)["w"], p.detach())
    for bad, why in ((["--outer-betas", "0.9"], "--outer-betas '0.9' is not two numbers in [0, 1)"),
                     (["--outer-eps", "0"], "--outer-eps 0.0 must be a positive number")):
        assert main(["merge", ft, "--out", out, "--method", "outer", "--base", base, *bad]) == 2
        assert why in capsys.readouterr().out
    text = build_parser()._subparsers._group_actions[0].choices["merge"].format_help()
    assert "(default 0.9,0.95)" in text and "(default 0.1" in text and "--no-normalize" in text


def test_cli_no_ties_normalize_sums_the_agreeing_entries(tmp_path):
    from orchestrator.cli import main
    base, a, b = (str(tmp_path / f"{n}.safetensors") for n in "gab")
    save_file({"w": torch.tensor([10.0, 10.0])}, base)
    save_file({"w": torch.tensor([12.0, 9.0])}, a)
    save_file({"w": torch.tensor([14.0, 11.0])}, b)
    for flag, want in (("--normalize", [13.0, 11.0]), ("--no-normalize", [16.0, 11.0])):
        out = str(tmp_path / f"{flag}.safetensors")
        assert main(["merge", a, b, "--out", out, "--method", "ties", "--base", base, "--density", "1", flag]) == 0
        assert torch.equal(load_file(out)["w"], torch.tensor(want))  # as test_ties_scale_and_base_by_hand, scale 1


# -- properties of the maths ------------------------------------------------------------------
_float = st.floats(-100, 100, allow_nan=False, width=32)
_vec = st.lists(_float, min_size=1, max_size=6)


def _vecs(count: int, size: int | None = None):
    """`count` lists of floats of one common length (`size`, or drawn)."""
    sizes = st.just(size) if size else st.integers(1, 6)
    return sizes.flatmap(lambda n: st.lists(st.lists(_float, min_size=n, max_size=n), min_size=count, max_size=count))


@settings(max_examples=40, deadline=None)
@given(_vec, st.integers(1, 5), st.lists(st.floats(0.1, 10), min_size=5, max_size=5))
def test_property_average_of_identical_inputs_is_the_input(v, k, w):
    t = torch.tensor(v)
    assert torch.allclose(average([t] * k, w[:k]), t, atol=1e-4, rtol=1e-5)


@settings(max_examples=40, deadline=None)
@given(_vecs(3))
def test_property_median_of_three_is_one_of_them_and_between_min_and_max(xs):
    ts = [torch.tensor(x) for x in xs]
    m = median(ts, [1, 1, 1])
    s = torch.stack(ts)
    assert torch.all(m >= s.min(0).values) and torch.all(m <= s.max(0).values)
    assert torch.all((s == m).any(0))


@settings(max_examples=40, deadline=None)
@given(st.lists(st.floats(0.01, 50), min_size=4, max_size=4), st.integers(1, 4),
       st.lists(st.floats(0.1, 10), min_size=4, max_size=4), st.lists(st.booleans(), min_size=4, max_size=4))
def test_property_ties_density_1_agreeing_signs_is_average(mags, k, w, neg):
    # every input moves every element away from base in the same direction (signs agree, none zero)
    base = torch.tensor([1.0, -2.0, 3.0, 0.5])
    sign = torch.tensor([-1.0 if n else 1.0 for n in neg])
    ts = [base + sign * torch.tensor(mags) * (i + 1) for i in range(k)]
    got = ties(ts, w[:k], base=base, density=1.0)
    assert torch.allclose(got, average(ts, w[:k]), atol=1e-4, rtol=1e-5)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 4).flatmap(lambda k: _vecs(k, 3)), st.floats(-2, 2))
def test_property_task_arithmetic_is_linear(xs, scale):
    base = torch.tensor([0.5, -1.0, 2.0])
    ts = [torch.tensor(x) for x in xs]
    w = [1.0] * len(ts)
    got = task_arithmetic(ts, w, base=base, scale=scale)
    want = base.double() + scale * sum(t.double() - base.double() for t in ts)
    assert torch.allclose(got.double(), want, atol=1e-3, rtol=1e-5)
    # scale 1 with weights 1/K is the average
    assert torch.allclose(task_arithmetic(ts, [1 / len(ts)] * len(ts), base=base), average(ts, w), atol=1e-3, rtol=1e-5)


def test_check_method_args_lists_every_problem():
    problems = check_method_args("ties", [1.0, float("nan")], {"density": 2.0, "bogus": 1}, has_base=False)
    assert len(problems) == 4, problems


def test_ties_streamed_in_slices_equals_ties_on_whole_tensors(tmp_path, monkeypatch):
    """Through the engine, in slices of 3 elements, TIES trims each slice with its input's
    threshold over the whole tensor (merge.methods.ties_thresholds): the result is `ties` on the
    whole tensors in memory, bit for bit."""
    shapes = {"a": (7, 5), "b": (11,), "c": ()}
    models, base = [_model(i, shapes) for i in range(3)], _model(9, shapes)
    monkeypatch.setattr(engine, "_MIN_CHUNK", 3)
    got = _merge_files(tmp_path, models, method="ties", weights=[1, 2, 3], base=base, params={"density": 0.3},
                       buffer_bytes=1)
    for k in shapes:
        want = ties([m[k] for m in models], [1, 2, 3], base=base[k], density=0.3)
        assert torch.equal(got[k], want.reshape(got[k].shape)), k


def test_cli_slerp_of_two_models(tmp_path, capsys):
    from orchestrator.cli import main
    a, b, c = (str(tmp_path / f"{n}.safetensors") for n in "abc")
    save_file({"w": torch.ones(2)}, a)
    save_file({"w": torch.full((2,), 2.0)}, b)
    save_file({"w": torch.full((2,), 3.0)}, c)
    out = str(tmp_path / "s.safetensors")
    assert main(["merge", a, b, "--out", out, "--method", "slerp", "--t", "0.25"]) == 0
    assert torch.equal(load_file(out)["w"], torch.full((2,), 1.25))  # colinear: 0.75 a + 0.25 b
    assert main(["merge", a, b, c, "--out", out, "--method", "slerp"]) == 2
    assert "slerp takes exactly 2 input models; got 3" in capsys.readouterr().out

