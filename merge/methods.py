"""Merge methods: one small pure function per method, registered in one table.

A method takes the same-named tensor (or the same slice of it) from every input, already validated
(same shape and dtype, finite), the inputs' weights, and returns the merged tensor in float32.
Accumulation is always float32, whatever the inputs' dtype, so bf16 checkpoints lose nothing to
the sum. Methods that need the starting point of the inputs (task vectors are `input - base`)
receive it as `base=`; the engine passes it only to methods registered with `needs_base`.

Every method is element-wise given a few numbers per whole tensor (output element i depends only
on element i of the inputs, and on DELLA's ranks within its row), so the engine feeds slices and
memory stays at a few MiB per input whatever the tensor sizes; those numbers (TIES's trim
thresholds, SLERP's angle, Model Stock's ratio) a method's `prepare` computes first, reading whole
tensors. The task-vector family (TIES, DARE, Breadcrumbs, DELLA) lives in merge.task_vectors.

| method           | result                                                                     |
|------------------|----------------------------------------------------------------------------|
| average          | sum_i w_i t_i / sum_i w_i (lo-fi, model soups, FedAvg)                      |
| task-arithmetic  | base + scale * sum_i w_i (t_i - base)            (Ilharco et al. 2023)      |
| ties             | base + scale * disjoint-mean(top-k(t_i - base))  (Yadav et al. 2023)        |
| dare-linear      | base + scale * sum_i w_i drop(t_i - base) / density (Yu et al. 2024)        |
| dare-ties        | dare's random drop, then TIES's sign election                               |
| breadcrumbs      | base + scale * sum_i w_i band(t_i - base)  (Davari & Belilovsky 2024)       |
| breadcrumbs-ties | breadcrumbs' band, then TIES's sign election                                |
| della            | DELLA's rank-weighted random drop, then TIES's election (Deep et al. 2024)  |
| della-linear     | DELLA's drop, summed                                                        |
| model-stock      | base + r (mean_i t_i - base), r from the task vectors' angle (Jang et al. 2024) |
| median           | element-wise median of the inputs (mean of the middle two for even K)       |
| slerp            | s0(t, angle) a + s1(t, angle) b: spherical interpolation of two models      |
| outer            | one DiLoCo outer step from base with the pseudo-gradient base - average     |
"""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache, partial
from typing import Any

import torch

from core.config import OuterConfig
from core.checkpoint import FLOATS
from core.outer import outer_step
from merge import METHOD_DEFAULTS, task_vectors

MergeFn = Callable[..., torch.Tensor]


def _f32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.float32 else t.to(torch.float32)


def average(tensors: Sequence[torch.Tensor], weights: Sequence[float], **_: object) -> torch.Tensor:
    """Weighted mean: lo-fi's final average, a model soup, the mean inside DiLoCo's outer gradient.
    Summed input by input (one fused multiply-add each), then divided by the weights' sum: the
    operations of mergekit's linear merge, so the two agree bit for bit."""
    total = float(sum(weights))
    if total <= 0:
        raise ValueError(f"weights must sum to a positive number, got {list(weights)}")
    w = torch.tensor([float(x) for x in weights], dtype=torch.float32)
    acc = torch.zeros_like(_f32(tensors[0]))
    for t, c in zip(tensors, w):
        acc.addcmul_(_f32(t), c)
    return acc.div_(w.sum())


def task_arithmetic(tensors: Sequence[torch.Tensor], weights: Sequence[float], *, base: torch.Tensor,
                    scale: float = 1.0, **_: object) -> torch.Tensor:
    """base + scale * sum_i w_i (t_i - base): weights are used as given (not normalised).

    Each task vector is formed before it is weighted: fine-tuned weights sit close to the base, so
    `t_i - base` is exact in float32, where `sum_i w_i t_i - (sum_i w_i) base` cancels large numbers
    (1.7e-6 off a float64 reference for K = 8 task vectors of 1e-5 on weights of 1). The sum is
    merge.task_vectors.combine's (mergekit's operations, bit for bit)."""
    b = _f32(base)
    tvs = [(_f32(t) - b).reshape(-1) for t in tensors]
    merged = task_vectors.combine(tvs, weights, consensus=False, normalize=False)
    return task_vectors.scaled_sum(b, merged, scale)


SLERP_COLINEAR = 0.9995
"""|cos| of the angle above which SLERP takes the straight line (mergekit's DOT_THRESHOLD)."""


def slerp(tensors: Sequence[torch.Tensor], weights: Sequence[float], *, t: float = 0.5,
          aux: tuple[float, float] | None = None, **_: object) -> torch.Tensor:
    """Spherical interpolation of two models, per tensor: s0 * a + s1 * b, where s0, s1 come from
    the angle between the two whole tensors (`slerp_coefficients`; the engine feeds slices and
    passes them as `aux`). t = 0 gives a, t = 1 gives b; weights are not used."""
    a, b = tensors
    s0, s1 = aux if aux is not None else slerp_coefficients_of(a, b, t)
    return torch.mul(_f32(a), s0).add_(_f32(b), alpha=s1)


def slerp_coefficients_of(a: torch.Tensor, b: torch.Tensor, t: float) -> tuple[float, float]:
    """SLERP's two coefficients for whole tensors a and b, as mergekit computes them: from the
    angle between their directions (a zero-norm tensor is taken as it is), the straight line
    (1 - t, t) when they are nearly colinear."""
    a64, b64 = a.reshape(-1).to(torch.float64), b.reshape(-1).to(torch.float64)
    na, nb = float(a64.norm()), float(b64.norm())
    dot = float(torch.dot(a64, b64)) / ((na if na > 1e-8 else 1.0) * (nb if nb > 1e-8 else 1.0))
    if abs(dot) > SLERP_COLINEAR:
        return 1.0 - t, t
    theta = math.acos(dot)
    return math.sin((1 - t) * theta) / math.sin(theta), math.sin(t * theta) / math.sin(theta)


def slerp_coefficients(inputs: Sequence[Any], base: Any, params: Mapping[str, Any]) -> dict[str, tuple[float, float]]:
    """Every float tensor's SLERP coefficients, reading the two whole tensors one at a time."""
    out = {}
    for name, (f, spec) in inputs[0].tensors.items():
        if spec.dtype in FLOATS:
            out[name] = slerp_coefficients_of(f.read(name), inputs[1].tensors[name][0].read(name), params.get("t", 0.5))
    return out


def model_stock(tensors: Sequence[torch.Tensor], weights: Sequence[float], *, base: torch.Tensor,
                aux: float | None = None, **_: object) -> torch.Tensor:
    """Model Stock: base + r (mean_i t_i - base), with r = K cos / (1 + (K - 1) cos) from the mean
    cosine between the task vectors `t_i - base` of the whole tensor (`model_stock_ratio`; the
    engine feeds slices and passes it as `aux`). Unweighted; needs two inputs or more."""
    r = aux if aux is not None else model_stock_ratio([t.reshape(-1) - base.reshape(-1) for t in tensors])
    avg = _f32(tensors[0]).clone()
    for t in tensors[1:]:
        avg.add_(_f32(t))  # left to right, as mergekit's sum(ws)
    avg.div_(len(tensors))
    return avg.mul_(r).add_(_f32(base), alpha=1.0 - r)


def model_stock_ratio(offsets: Sequence[torch.Tensor], name: str = "") -> float:
    """r from the task vectors' mean pairwise cosine (float64; a zero vector counts as orthogonal,
    as in mergekit). Anti-aligned vectors (1 + (K - 1) cos near 0) have no ratio: an error."""
    k = len(offsets)
    o64 = [o.to(torch.float64) for o in offsets]
    norms = [float(o.norm()) for o in o64]
    cos = [max(-1.0, min(1.0, float(torch.dot(o64[i], o64[j])) / max(norms[i] * norms[j], 1e-6)))
           for i in range(k) for j in range(i + 1, k)]
    c = sum(cos) / len(cos)
    if 1 + (k - 1) * c < 1e-6:
        raise ValueError(f"model-stock: the task vectors of tensor {name or '?'} point in opposite directions "
                         f"(mean cosine {c:.3f}), which leaves the interpolation ratio undefined; merge them "
                         "with another method")
    return k * c / (1 + (k - 1) * c)


def model_stock_ratios(inputs: Sequence[Any], base: Any, params: Mapping[str, Any]) -> dict[str, float]:
    """Every float tensor's Model Stock ratio, reading the K whole tensors of one name at a time."""
    out = {}
    for name, (f, spec) in base.tensors.items():
        if spec.dtype in FLOATS:
            b = f.read(name).to(torch.float32).reshape(-1)
            out[name] = model_stock_ratio([m.tensors[name][0].read(name).to(torch.float32).reshape(-1) - b
                                           for m in inputs], name)
    return out


def median(tensors: Sequence[torch.Tensor], weights: Sequence[float], **_: object) -> torch.Tensor:
    """Element-wise median; for an even count, the mean of the two middle values. Unweighted."""
    s, k = sorted_elementwise(tensors), len(tensors)
    return s[k // 2] if k % 2 else (s[k // 2 - 1] + s[k // 2]) / 2


def sorted_elementwise(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The K tensors' values sorted element by element (out[0] holds each element's smallest), as
    float32 copies: compare-exchanges of whole tensors along Batcher's sorting network, a few times
    faster than torch.sort along a stacked first dimension for small K (docs/benchmarks.md) and
    without its int64 indices. The inputs are finite (a NaN would spread to its element's outputs)."""
    x = [_f32(t).clone() for t in tensors]
    for i, j in sorting_network(len(x)):
        low = torch.minimum(x[i], x[j])
        torch.maximum(x[i], x[j], out=x[j])
        x[i] = low
    return x


@lru_cache(maxsize=64)
def sorting_network(n: int) -> tuple[tuple[int, int], ...]:
    """Batcher's odd-even merge sort for n inputs: compare-exchange pairs (i < j, the smaller value
    to i) that leave any n values in order. Built for the next power of two without the pairs that
    reach past n: those would compare a value with an +inf pad, which never moves."""
    size = 1 << max(0, n - 1).bit_length()
    pairs, p = [], 1
    while p < size:
        k = p
        while k >= 1:
            for j in range(k % p, size - k, 2 * k):
                for i in range(min(k, size - j - k)):
                    if (i + j) // (2 * p) == (i + j + k) // (2 * p) and i + j + k < n:
                        pairs.append((i + j, i + j + k))
            k //= 2
        p *= 2
    return tuple(pairs)


def outer(tensors: Sequence[torch.Tensor], weights: Sequence[float], *, base: torch.Tensor,
          state: dict[str, torch.Tensor], optimizer: OuterConfig, inner: str = "average") -> torch.Tensor:
    """One DiLoCo outer step in memory: the pseudo-gradient `base - inner(inputs)` goes into `.grad`
    of base and a real torch.optim optimizer (`optimizer`) steps it (merge.outer). Over files, the
    engine merges with `inner` and steps through merge.outer.OuterStep.

    `state` holds the optimizer's slots for this tensor (momentum buffer, Adam moments; empty on
    the first step); it is replaced in place by the slots after the step.
    """
    new, new_state, _ = outer_step(_f32(base), get_method(inner)(tensors, weights), dict(state), optimizer)
    state.clear()
    state.update(new_state)
    return new


# -- the registry ---------------------------------------------------------------------------
def _number(key: str, lo: float, hi: float, lo_open: bool = True, hi_open: bool = False):
    def check(p: Mapping[str, Any]) -> list[str]:
        v = p.get(key)
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and (lo < v if lo_open else lo <= v) and (
            v < hi if hi_open else v <= hi)
        return [] if ok else [f"{key} must be in {'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}, got {v!r}"]
    return check


def _flag(key: str):
    def check(p: Mapping[str, Any]) -> list[str]:
        return [] if isinstance(p.get(key), bool) else [f"{key} must be true or false, got {p.get(key)!r}"]
    return check


def _check_scale(p: Mapping[str, Any]) -> list[str]:
    s = p.get("scale", 1.0)
    return [] if isinstance(s, (int, float)) and math.isfinite(s) else [f"scale must be a finite number, got {s!r}"]


def _check_seed(p: Mapping[str, Any]) -> list[str]:
    s = p.get("seed")
    return [] if isinstance(s, int) and not isinstance(s, bool) and s >= 0 else [f"seed must be an integer >= 0, got {s!r}"]


def _check_epsilon(p: Mapping[str, Any]) -> list[str]:
    d, e = p.get("density"), p.get("epsilon")
    if isinstance(d, (int, float)) and isinstance(e, (int, float)) and e >= 0 and d - e > 0 and d + e <= 1:
        return []
    return [f"DELLA keeps entries with probabilities density - epsilon to density + epsilon: they must lie in "
            f"(0, 1], got density {d!r}, epsilon {e!r}"]


def _check_optimizer(p: Mapping[str, Any]) -> list[str]:
    return [] if isinstance(p.get("optimizer"), OuterConfig) else ["outer needs optimizer= (an OuterConfig)"]


def _positive_sum(w: Sequence[float]) -> list[str]:
    return [] if sum(w) > 0 else [f"weights must sum to a positive number, got {list(w)}"]


def _count(method: str, lo: int, hi: int | None = None):
    def check(w: Sequence[float]) -> list[str]:
        ok = lo <= len(w) and (hi is None or len(w) <= hi)
        want = f"exactly {lo}" if hi == lo else f"at least {lo}"
        return [] if ok else [f"{method} takes {want} input models; got {len(w)}"]
    return check


def _unweighted(method: str):
    def check(w: Sequence[float]) -> list[str]:
        return [] if len(set(w)) <= 1 else [f"{method} is unweighted; drop the weights (got {list(w)})"]
    return check


@dataclass(frozen=True)
class Method:
    fn: MergeFn
    """Merges one segment (a slice of a tensor, every input's same elements), given `aux`."""
    needs_base: bool = False
    """The method is given `base=` (the inputs' common starting point)."""
    params: tuple[str, ...] = ()
    """Keyword parameters it accepts (besides base, state, stats, aux, start)."""
    defaults: Mapping[str, Any] = field(default_factory=dict)
    """Values of `params` when not given; recorded with the output (a DARE merge's seed)."""
    checks: tuple[Callable[[Mapping[str, Any]], list[str]], ...] = ()
    """Each returns the problems with the parameters (defaults filled in)."""
    weight_checks: tuple[Callable[[Sequence[float]], list[str]], ...] = (_positive_sum,)
    stateful: bool = False
    """Reads and replaces optimizer state (`state=`), saved between merges."""
    propagates_nonfinite: bool = False
    """A NaN or Inf in any input (or base) always makes the result non-finite (sums do; a median
    does not): the engine then checks the result only, and the inputs only to name the culprit."""
    prepare: Callable[[Sequence[Any], Any, Mapping[str, Any]], dict[str, Any]] | None = None
    """(inputs, base, params) -> per tensor name, what `fn` needs of the whole tensors (`aux=`),
    computed before the stream starts."""
    rows: bool = False
    """Slices hold whole rows (shape[0] rows of a tensor, a vector is one row): DELLA ranks in rows."""


_DENSITY = _number("density", 0, 1)
_TV_CHECKS = (_DENSITY, _check_scale, _flag("normalize"))


def _task_vector_method(name: str, sparsify: str, consensus: bool) -> Method:
    """A member of merge.task_vectors' family: TIES, DARE, Breadcrumbs, DELLA."""
    defaults = METHOD_DEFAULTS[name]
    checks = _TV_CHECKS + tuple(c for k, c in (("gamma", _number("gamma", 0, 1, lo_open=False, hi_open=True)),
                                              ("seed", _check_seed), ("rescale", _flag("rescale")),
                                              ("epsilon", _check_epsilon)) if k in defaults)
    return Method(partial(task_vectors.TaskVectorMerge(sparsify, consensus), **defaults), needs_base=True,
                  params=tuple(defaults), defaults=defaults, checks=checks, prepare=task_vectors.prepare(sparsify),
                  rows=sparsify == "della")


METHODS: dict[str, Method] = {
    "average": Method(average, propagates_nonfinite=True),
    "task-arithmetic": Method(task_arithmetic, needs_base=True, params=("scale",), defaults=METHOD_DEFAULTS["task-arithmetic"],
                              checks=(_check_scale,), weight_checks=(), propagates_nonfinite=True),
    "ties": _task_vector_method("ties", "magnitude", True),
    "dare-linear": _task_vector_method("dare-linear", "random", False),
    "dare-ties": _task_vector_method("dare-ties", "random", True),
    "breadcrumbs": _task_vector_method("breadcrumbs", "outliers", False),
    "breadcrumbs-ties": _task_vector_method("breadcrumbs-ties", "outliers", True),
    "della": _task_vector_method("della", "della", True),
    "della-linear": _task_vector_method("della-linear", "della", False),
    "model-stock": Method(model_stock, needs_base=True, weight_checks=(_count("model-stock", 2), _unweighted("model-stock")),
                          prepare=model_stock_ratios),
    "median": Method(median, weight_checks=(_unweighted("median"),)),
    "slerp": Method(slerp, params=("t",), defaults=METHOD_DEFAULTS["slerp"], checks=(_number("t", 0, 1, lo_open=False),),
                    weight_checks=(_count("slerp", 2, 2), _unweighted("slerp")), prepare=slerp_coefficients),
    "outer": Method(outer, needs_base=True, params=("optimizer", "inner"), checks=(_check_optimizer,),
                    stateful=True, propagates_nonfinite=True),  # when `inner` does: see the engine
}
PUBLIC = sorted(METHODS)


def method_spec(name: str) -> Method:
    try:
        return METHODS[name]
    except KeyError:
        raise ValueError(f"unknown merge method {name!r}; valid methods: {', '.join(PUBLIC)}") from None


def get_method(name: str) -> MergeFn:
    return method_spec(name).fn


def check_method_args(name: str, weights: Sequence[float], params: Mapping[str, Any], has_base: bool) -> list[str]:
    """Every problem with a call of method `name`, found before any tensor is read."""
    m = method_spec(name)
    problems = []
    unknown = sorted(set(params) - set(m.params))
    if unknown:
        problems.append(f"method {name} takes no parameter(s) {unknown}; it takes {list(m.params) or 'none'}")
    if m.needs_base and not has_base:
        problems.append(f"method {name} needs a base model (the inputs' common starting point)")
    if not m.needs_base and has_base:
        problems.append(f"method {name} does not use a base model; drop it")
    if not weights:
        problems.append("there are no inputs")
    elif not all(math.isfinite(w) for w in weights):
        problems.append(f"weights must be finite numbers, got {list(weights)}")
    else:
        for check in m.weight_checks:
            problems += check(weights)
    full = with_defaults(name, params)
    for check in m.checks:
        problems += check(full)
    return problems


def with_defaults(name: str, params: Mapping[str, Any]) -> dict[str, Any]:
    """`params` with method `name`'s defaults for those not given."""
    return {**method_spec(name).defaults, **params}
