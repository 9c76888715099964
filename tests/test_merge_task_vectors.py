"""DARE, Breadcrumbs, DELLA and Model Stock (#28): hand-worked numbers, a float64 reference written
from the papers and mergekit's definitions (numpy, sorting, no merge code), and the streamed merge
through real files equal to the whole-tensor maths bit for bit.

The random methods' reference takes its masks from the same uniform stream (merge.task_vectors.uniform,
keyed by seed, input and tensor): the masks are the method's randomness, not its maths; the stream's
own property (any slice equals the same slice of the whole stream) is tested separately.
"""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import merge.engine as engine
from merge import METHOD_DEFAULTS
from merge.manual import ManualMerge, MergeError, manual_merge
from merge.methods import METHODS, check_method_args, get_method, model_stock
from merge.task_vectors import Cut, TensorAux, della_keep, mask_key, uniform

SHAPES = {"emb": (9, 6), "w": (6, 6), "b": (6,), "s": ()}


def _models(k, shapes=SHAPES, seed=0):
    g = torch.Generator().manual_seed(seed)
    base = {n: torch.randn(s, generator=g) for n, s in shapes.items()}
    fts = [{n: base[n] + 0.1 * torch.randn(s, generator=g) for n, s in shapes.items()} for _ in range(k)]
    return base, fts


def _merge(tmp_path, method, fts, base, weights=None, params=None, buffer_bytes=1, out="out.safetensors"):
    paths = []
    for i, m in enumerate(fts):
        paths.append(str(tmp_path / f"in{i}.safetensors"))
        save_file(m, paths[-1])
    save_file(base, str(tmp_path / "base.safetensors"))
    manual_merge(ManualMerge(paths, str(tmp_path / out), method=method, weights=weights,
                             base=str(tmp_path / "base.safetensors"),
                 params=params or {}, buffer_bytes=buffer_bytes))
    return load_file(str(tmp_path / out))


# -- the random stream -----------------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**128 - 1), st.integers(0, 200), st.integers(0, 50))
def test_property_any_slice_of_the_stream_is_that_slice_of_the_whole(key, start, n):
    whole = uniform(key, 0, start + n)
    assert torch.equal(uniform(key, start, n), whole[start:])
    assert bool(((whole >= 0) & (whole < 1)).all())


def test_stream_is_uniform_and_keys_differ():
    u = uniform(mask_key(0, 0, "w"), 0, 100_000)
    assert abs(float(u.mean()) - 0.5) < 0.005 and abs(float((u < 0.3).double().mean()) - 0.3) < 0.005
    assert len({mask_key(0, 0, "w"), mask_key(1, 0, "w"), mask_key(0, 1, "w"), mask_key(0, 0, "v")}) == 4


# -- hand-worked numbers ---------------------------------------------------------------------
def test_breadcrumbs_by_hand():
    # Prepare: magnitudes 1..10; density 0.5 keeps 5, gamma 0.1 drops the top 1 -> ranks 4..8: 5,6,7,8,9
    tv = torch.tensor([3.0, -10.0, 1.0, 7.0, -5.0, 2.0, 9.0, -4.0, 6.0, 8.0])
    fn = get_method("breadcrumbs")
    # Execute
    out = fn([tv], [1.0], base=torch.zeros(10), density=0.5, gamma=0.1)
    # Assert
    assert out.tolist() == [0, 0, 0, 7, -5, 0, 9, 0, 6, 8]
    # gamma 0 keeps the top 5 (mergekit 0.1.5's count); density + gamma > 1 shrinks the top cut
    assert fn([tv], [1.0], base=torch.zeros(10), density=0.5, gamma=0.0).tolist() == [0, -10, 0, 7, 0, 0, 9, 0, 6, 8]
    assert fn([tv], [1.0], base=torch.zeros(10), density=0.9, gamma=0.5).tolist() == [3, 0, 1, 7, -5, 2, 9, -4, 6, 8]


def test_breadcrumbs_ties_elects_signs():
    # Prepare: density 1, gamma 0: nothing trimmed; element 0: +2 and -3 -> sum -1 elects -, keeps -3
    ts = [torch.tensor([2.0, 1.0]), torch.tensor([-3.0, 1.0])]
    # Execute
    out = get_method("breadcrumbs-ties")(ts, [1.0, 1.0], base=torch.zeros(2), density=1.0, gamma=0.0)
    # Assert: not normalized by default (mergekit): the agreeing entries' sum
    assert out.tolist() == [-3.0, 2.0]


def test_dare_keeps_each_entry_or_drops_it_and_rescales_by_density():
    # Prepare: one task vector of 20000 ones * 3
    tv, base = torch.full((20_000,), 3.0), torch.full((20_000,), 1.0)
    # Execute
    out = get_method("dare-linear")([base + tv], [1.0], base=base, density=0.25, seed=3) - base
    # Assert: every entry is 0 or 3 / 0.25 = 12, about a quarter kept
    assert set(out.unique().tolist()) == {0.0, 12.0}
    assert abs(float((out != 0).double().mean()) - 0.25) < 0.015
    # without rescale: 0 or 3; density 1 keeps everything: task arithmetic
    plain = get_method("dare-linear")([base + tv], [1.0], base=base, density=0.25, seed=3, rescale=False) - base
    assert torch.equal(plain != 0, out != 0) and set(plain.unique().tolist()) == {0.0, 3.0}
    assert torch.equal(get_method("dare-ties")([base + tv], [1.0], base=base, density=1.0), base + tv)


def test_della_keep_probabilities_by_hand():
    # Prepare: two rows of 3; density 0.5, epsilon 0.1: ranks 0, 1, 2 in each row -> 0.4, 0.5, 0.6
    tv = torch.tensor([[5.0, -1.0, 3.0], [0.0, 2.0, -7.0]])
    # Execute
    p = della_keep(tv.reshape(-1), 3, 0.5, 0.1)
    # Assert
    assert torch.allclose(p, torch.tensor([0.6, 0.4, 0.5, 0.4, 0.5, 0.6], dtype=torch.float64))


def test_della_with_epsilon_0_is_dare_bit_for_bit():
    base, fts = _models(3, {"w": (8, 16)})
    ts = [m["w"] for m in fts]
    d = get_method("della-linear")(ts, [1.0, 2.0, 1.0], base=base["w"], epsilon=0.0, density=0.3, seed=5)
    r = get_method("dare-linear")(ts, [1.0, 2.0, 1.0], base=base["w"], density=0.3, seed=5)
    assert torch.equal(d, r)


def test_model_stock_by_hand():
    # Prepare: task vectors [1, 0] and [0.5, sqrt(3)/2] (cos 0.5): r = 2 * 0.5 / (1 + 0.5) = 2/3
    base = torch.tensor([1.0, 1.0])
    ts = [base + torch.tensor([1.0, 0.0]), base + torch.tensor([0.5, math.sqrt(3) / 2])]
    # Execute
    out = model_stock(ts, [1.0, 1.0], base=base)
    # Assert: base + 2/3 * mean task vector
    want = torch.tensor([1 + 2 / 3 * 0.75, 1 + 2 / 3 * math.sqrt(3) / 4])
    assert torch.allclose(out, want, atol=1e-6)
    # orthogonal task vectors: the base; identical ones: their mean
    assert torch.allclose(model_stock([base + torch.tensor([1.0, 0]), base + torch.tensor([0, 1.0])], [1, 1], base=base), base)
    same = [base + torch.tensor([1.0, 2.0])] * 2
    assert torch.allclose(model_stock(same, [1, 1], base=base), same[0])
    with pytest.raises(ValueError, match="opposite directions"):
        model_stock([base + torch.tensor([1.0, 0]), base - torch.tensor([1.0, 0])], [1, 1], base=base)


# -- the float64 reference -------------------------------------------------------------------
def _ref_sparsify(tv, kind, p, key):
    """The papers' / mergekit's sparsifiers on a whole flat float64 numpy task vector."""
    n = tv.size
    order = np.argsort(np.abs(tv), kind="stable")  # ascending magnitude
    mask = np.zeros(n, bool)
    keep = int(p["density"] * n)
    if kind == "magnitude":
        mask[order[n - max(1, keep):]] = True
        return tv * mask
    if kind == "outliers":
        n_bot = max(0, n - keep - int(p["gamma"] * n))
        mask[order[n_bot:n_bot + keep]] = True
        return tv * mask
    u = uniform(key, 0, n).numpy()
    if kind == "random":
        prob = np.full(n, p["density"])
    else:  # della: per row (shape[0] rows), rank 0..row-1 -> density - eps .. density + eps
        rows = p["rows"]
        a = np.abs(tv).reshape(rows, -1)
        rank = np.argsort(np.argsort(a, axis=1, kind="stable"), axis=1, kind="stable")
        prob = (p["density"] - p["epsilon"] + rank / max(a.shape[1] - 1, 1) * 2 * p["epsilon"]).reshape(-1)
    return np.where(u < prob, tv / prob if p["rescale"] else tv, 0.0)


def _ref(method, fts, base, weights, p):
    out = {}
    spars = {"ties": "magnitude", "dare-linear": "random", "dare-ties": "random", "breadcrumbs": "outliers",
             "breadcrumbs-ties": "outliers", "della": "della", "della-linear": "della"}[method]
    for name, b in base.items():
        b64 = b.double().reshape(-1).numpy()
        q = {**p, "rows": b.shape[0] if b.dim() >= 2 else 1}
        tvs = [_ref_sparsify(m[name].double().reshape(-1).numpy() - b64, spars, q, mask_key(p["seed"], i, name))
               for i, m in enumerate(fts)]
        w = np.array(weights, dtype=np.float64)[:, None]
        wt = np.stack(tvs) * w
        if method.endswith("ties") or method == "della":
            elected = np.where(wt.sum(0) >= 0, 1.0, -1.0)
            agree = np.sign(wt) == elected
            merged, div = (wt * agree).sum(0), (w * agree).sum(0)
            div[div == 0] = 1
        else:
            merged, div = wt.sum(0), w.sum()
        merged = merged / div if p["normalize"] else merged
        out[name] = (b64 + p["scale"] * merged).reshape(b.shape)
    return out


@pytest.mark.parametrize("method", ["ties", "dare-linear", "dare-ties", "breadcrumbs", "breadcrumbs-ties", "della",
                                    "della-linear"])
def test_streamed_merge_matches_the_float64_reference(tmp_path, monkeypatch, method):
    """Through real files, in slices of a few elements (DELLA: whole rows), against the reference."""
    monkeypatch.setattr(engine, "_MIN_CHUNK", 5)
    base, fts = _models(3)
    params = {"seed": 11, "scale": 0.8, "density": 0.4} if "seed" in METHOD_DEFAULTS[method] else {"scale": 0.8}
    got = _merge(tmp_path, method, fts, base, weights=[1.0, 0.5, 2.0], params=params)
    p = {"seed": 0, "rescale": True, **METHOD_DEFAULTS[method], **params}
    want = _ref(method, fts, base, [1.0, 0.5, 2.0], p)
    for name in SHAPES:
        assert torch.allclose(got[name].double(), torch.from_numpy(np.asarray(want[name])), atol=2e-6, rtol=1e-6), name


def test_model_stock_streamed_matches_the_float64_reference(tmp_path, monkeypatch):
    monkeypatch.setattr(engine, "_MIN_CHUNK", 4)
    base, fts = _models(3)
    got = _merge(tmp_path, "model-stock", fts, base)
    for name, b in base.items():
        tvs = [m[name].double().reshape(-1) - b.double().reshape(-1) for m in fts]
        cos = [float(tvs[i] @ tvs[j]) / float(tvs[i].norm() * tvs[j].norm()) for i in range(3) for j in range(i + 1, 3)]
        c = sum(cos) / 3
        r = 3 * c / (1 + 2 * c)
        want = b.double().reshape(-1) + r * sum(tvs) / 3
        assert torch.allclose(got[name].double().reshape(-1), want, atol=1e-6), name


# -- seeds, slices, records ------------------------------------------------------------------
def test_random_merge_is_reproducible_from_its_recorded_seed_whatever_the_slicing(tmp_path, monkeypatch):
    base, fts = _models(2, {"w": (64, 64)})
    whole = _merge(tmp_path, "dare-ties", fts, base, params={"seed": 7}, buffer_bytes=256 << 20, out="a.safetensors")
    monkeypatch.setattr(engine, "_MIN_CHUNK", 7)
    sliced = _merge(tmp_path, "dare-ties", fts, base, params={"seed": 7}, out="b.safetensors")
    other = _merge(tmp_path, "dare-ties", fts, base, params={"seed": 8}, out="c.safetensors")
    assert torch.equal(whole["w"], sliced["w"]) and not torch.equal(whole["w"], other["w"])
    with safe_open(str(tmp_path / "b.safetensors"), "pt") as f:
        note = json.loads(f.metadata()["islands.merge"])
    assert note["seed"] == 7 and note["density"] == 0.5 and note["rescale"] is True and note["method"] == "dare-ties"
    assert json.loads((tmp_path / "b.json").read_text())["seed"] == 7  # and in its manifest
    # the engine's slices equal the function on whole tensors given the same per-input keys
    keys = TensorAux([Cut(key=mask_key(7, i, "w")) for i in range(2)], 64)
    direct = get_method("dare-ties")([m["w"] for m in fts], [1.0, 1.0], base=base["w"], seed=7, aux=keys)
    assert torch.equal(direct, whole["w"])


def test_della_slices_hold_whole_rows(tmp_path, monkeypatch):
    """A row longer than the chunk is one segment: the ranks are those of the whole row."""
    monkeypatch.setattr(engine, "_MIN_CHUNK", 4)
    base, fts = _models(2, {"w": (3, 10)})
    got = _merge(tmp_path, "della", fts, base, params={"seed": 1})
    keys = TensorAux([Cut(key=mask_key(1, i, "w")) for i in range(2)], 10)
    want = get_method("della")([m["w"] for m in fts], [1.0, 1.0], base=base["w"], seed=1, aux=keys)
    assert torch.equal(got["w"], want)


def test_bad_parameters_are_all_named_before_reading():
    problems = check_method_args("della", [1.0, 1.0], {"density": 0.9, "epsilon": 0.2, "seed": -1, "rescale": "yes"},
                                 has_base=True)
    text = "\n".join(problems)
    assert "density - epsilon to density + epsilon" in text and "seed must be an integer >= 0" in text
    assert "rescale must be true or false" in text and len(problems) == 3
    assert check_method_args("breadcrumbs", [1.0], {"gamma": 1.0}, True) == ["gamma must be in [0, 1), got 1.0"]
    assert check_method_args("model-stock", [1.0], {}, True) == ["model-stock takes at least 2 input models; got 1"]
    assert "takes no parameter(s) ['seed']" in check_method_args("ties", [1.0], {"seed": 1}, True)[0]
    assert sorted(METHODS) == sorted(METHOD_DEFAULTS)


def test_cli_dare_with_a_seed_and_help_shows_each_default(tmp_path, capsys):
    from orchestrator.cli import main
    base, fts = _models(2, {"w": (4, 4)})
    paths = []
    for i, m in enumerate([base, *fts]):
        paths.append(str(tmp_path / f"m{i}.safetensors"))
        save_file(m, paths[-1])
    out = str(tmp_path / "o.safetensors")
    assert main(["merge", *paths[1:], "--base", paths[0], "--out", out, "--method", "dare-ties", "--seed", "4",
                 "--density", "0.3", "--no-rescale"]) == 0
    with safe_open(out, "pt") as f:
        note = json.loads(f.metadata()["islands.merge"])
    assert (note["seed"], note["density"], note["rescale"]) == (4, 0.3, False)
    assert main(["merge", *paths[1:], "--base", paths[0], "--out", out, "--method", "della", "--epsilon", "0.6"]) == 2
    assert "density - epsilon" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["merge", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "ties: 0.2" in text and "dare-linear, dare-ties, della, della-linear: 0.5" in text and "--gamma" in text


def test_model_stock_with_opposite_task_vectors_is_one_clear_error(tmp_path):
    base = {"w": torch.zeros(3)}
    fts = [{"w": torch.tensor([1.0, 2.0, 3.0])}, {"w": torch.tensor([-1.0, -2.0, -3.0])}]
    with pytest.raises(MergeError, match="tensor w point in opposite directions"):
        _merge(tmp_path, "model-stock", fts, base)
    assert not (tmp_path / "out.safetensors").exists()


def test_two_runs_final_models_merge_against_their_base_named_by_run_directory(dense_run, tmp_path, corpus_cache):
    """Runs from one seed share round 0's global, which a run keeps (its base): `orchestrate merge
    RUN1 RUN2 --base RUN1` takes each run's final model and that base; task arithmetic by hand."""
    from core.checkpoint import load_checkpoint, read_manifest
    from core.storage import Storage
    from orchestrator.cli import main
    from runs import DENSE, submit_tiny
    other = tmp_path / "other"
    assert main(submit_tiny(other, corpus_cache, *DENSE, "--set", "inner.lr=0.002", executor="inline")) == 0
    base = "global/round_00000.safetensors"
    assert read_manifest(Storage(str(other)), base)["digest"] == read_manifest(Storage(str(dense_run)), base)["digest"]
    out = tmp_path / "merged.safetensors"
    assert main(["merge", str(dense_run), str(other), "--base", str(dense_run), "--method", "task-arithmetic",
                 "--out", str(out)]) == 0
    g0 = load_checkpoint(Storage(str(dense_run)), base)[0]
    f1, f2 = (load_checkpoint(Storage(str(r)), "final/model.safetensors")[0] for r in (dense_run, other))
    got = load_file(out)
    for name, b in g0.items():
        want = b.double() + (f1[name].double() - b.double()) + (f2[name].double() - b.double())
        torch.testing.assert_close(got[name].double(), want, rtol=0, atol=1e-6)
    assert main(["merge", str(dense_run), str(other), "--base", str(dense_run), "--method", "ties",
                 "--out", str(tmp_path / "ties.safetensors")]) == 0
