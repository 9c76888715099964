"""Merge methods: one small pure function per method, registered in one table.

A method takes the same-named tensor (or the same slice of it) from every input, already validated
(same shape and dtype, finite), the inputs' weights, and returns the merged tensor in float32.
Accumulation is always float32, whatever the inputs' dtype, so bf16 checkpoints lose nothing to
the sum. Methods that need the starting point of the inputs (task vectors are `input - base`)
receive it as `base=`; the engine passes it only to methods registered with `needs_base`.

Every method is element-wise (output element i depends only on element i of the inputs), so the
engine feeds slices of big tensors and memory stays at a few MiB per input whatever the tensor
sizes; what `ties` needs of a whole tensor (each input's trim threshold) its `prepare` computes
first, reading one whole tensor of one input at a time.

| method          | result                                                                      |
|-----------------|-----------------------------------------------------------------------------|
| average         | sum_i w_i t_i / sum_i w_i (lo-fi, model soups, FedAvg)                       |
| task-arithmetic | base + scale * sum_i w_i (t_i - base)            (Ilharco et al. 2023)       |
| ties            | base + scale * disjoint-mean(trim(t_i - base))   (Yadav et al. 2023)         |
| median          | element-wise median of the inputs (mean of the middle two for even K)        |
| slerp           | s0(t, angle) a + s1(t, angle) b: spherical interpolation of two models       |
| outer           | one DiLoCo outer step from base with the pseudo-gradient base - average      |
"""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from core.config import OuterConfig
from core.checkpoint import FLOATS
from merge.outer import outer_step

MergeFn = Callable[..., torch.Tensor]


def _f32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.float32 else t.to(torch.float32)


def _weighted_sum(tensors: Sequence[torch.Tensor], coeffs: Sequence[float]) -> torch.Tensor:
    """sum_i c_i t_i in float32, one input at a time (no stacking: memory is one tensor)."""
    acc = torch.mul(_f32(tensors[0]), float(coeffs[0]))
    for t, c in zip(tensors[1:], coeffs[1:]):
        acc.add_(_f32(t), alpha=float(c))
    return acc


def average(tensors: Sequence[torch.Tensor], weights: Sequence[float], **_: object) -> torch.Tensor:
    """Weighted mean: lo-fi's final average, a model soup, the mean inside DiLoCo's outer gradient."""
    total = float(sum(weights))
    if total <= 0:
        raise ValueError(f"weights must sum to a positive number, got {list(weights)}")
    return _weighted_sum(tensors, [w / total for w in weights])


def task_arithmetic(tensors: Sequence[torch.Tensor], weights: Sequence[float], *, base: torch.Tensor,
                    scale: float = 1.0, **_: object) -> torch.Tensor:
    """base + scale * sum_i w_i (t_i - base): weights are used as given (not normalised).

    Each task vector is formed before it is weighted: fine-tuned weights sit close to the base, so
    `t_i - base` is exact in float32, where `sum_i w_i t_i - (sum_i w_i) base` cancels large numbers
    (1.7e-6 off a float64 reference for K = 8 task vectors of 1e-5 on weights of 1)."""
    b = _f32(base)
    acc = torch.zeros_like(b)
    for t, w in zip(tensors, weights):
        acc.add_(_f32(t) - b, alpha=scale * float(w))  # one task vector at a time: memory is two tensors
    return acc.add_(b)


def ties(tensors: Sequence[torch.Tensor], weights: Sequence[float], *, base: torch.Tensor,
         density: float = 0.2, scale: float = 1.0, normalize: bool = True, aux: Sequence[float] | None = None,
         **_: object) -> torch.Tensor:
    """TIES: trim each task vector to its top `density` fraction by magnitude, elect each element's
    sign by the weighted sum of the trimmed vectors (a sum of exactly 0 elects +, as mergekit
    does), then take the weighted mean of the entries that agree with the elected sign (zero where
    none does; with `normalize=False` their weighted sum), scaled and added to base.

    Trimming keeps the entries whose magnitude reaches the int(density * n)-th largest of their
    task vector, mergekit's count (entries tied with it are all kept, where mergekit keeps the
    first k). The engine feeds slices: `aux` then holds each input's threshold over the whole
    tensor (`ties_thresholds`); without it the tensors are whole.
    """
    b = _f32(base)
    thresholds = aux if aux is not None else [ties_threshold(t, b, density) for t in tensors]
    trimmed = []
    for t, thr in zip(tensors, thresholds):
        tv = (_f32(t) - b).reshape(-1)
        trimmed.append(tv.where(tv.abs() >= thr, torch.zeros((), dtype=tv.dtype)))
    elected = torch.where(_weighted_sum(trimmed, weights) >= 0, 1.0, -1.0)
    num = torch.zeros(b.numel(), dtype=torch.float32)
    den = torch.zeros(b.numel(), dtype=torch.float32)
    for tv, w in zip(trimmed, weights):
        agree = (torch.sign(tv) == elected) & (tv != 0)
        num.add_(tv * agree, alpha=float(w))
        den.add_(agree.to(torch.float32), alpha=float(w))
    merged = num / den.where(den != 0, torch.ones((), dtype=den.dtype)) if normalize else num
    return b.add(merged.reshape(b.shape), alpha=float(scale))


def ties_threshold(t: torch.Tensor, base: torch.Tensor, density: float) -> float:
    """The magnitude an entry of the task vector `t - base` must reach to survive TIES's trim: its
    int(density * n)-th largest magnitude, at least the largest (found in place, without sorting a copy)."""
    n = base.numel()
    if n == 0:
        return 0.0
    k = min(n, max(1, int(density * n)))
    tv = t.to(torch.float32, copy=True).reshape(-1).sub_(_f32(base).reshape(-1)).abs_()
    a = tv.numpy()
    a.partition(n - k)
    return float(a[n - k])


def ties_thresholds(inputs: Sequence[Any], base: Any, params: Mapping[str, Any]) -> dict[str, list[float]]:
    """Every input's trim threshold of every float tensor, reading one whole tensor of one input
    at a time (merge.inputs.Model): the engine then streams TIES slice by slice."""
    out: dict[str, list[float]] = {}
    for name, (f, spec) in base.tensors.items():
        if spec.dtype in FLOATS:
            b = f.read(name).to(torch.float32)
            out[name] = [ties_threshold(m.tensors[name][0].read(name), b, params.get("density", 0.2)) for m in inputs]
    return out


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


def median(tensors: Sequence[torch.Tensor], weights: Sequence[float], **_: object) -> torch.Tensor:
    """Element-wise median; for an even count, the mean of the two middle values. Unweighted."""
    if len(tensors) == 1:
        return _f32(tensors[0]).clone()
    s = torch.stack([_f32(t) for t in tensors]).sort(dim=0).values
    k = len(tensors)
    return s[k // 2].clone() if k % 2 else (s[k // 2 - 1] + s[k // 2]) / 2


def outer(tensors: Sequence[torch.Tensor], weights: Sequence[float], *, base: torch.Tensor,
          state: dict[str, torch.Tensor], optimizer: OuterConfig, inner: str = "average",
          stats: dict[str, float] | None = None, **_: object) -> torch.Tensor:
    """One DiLoCo outer step: the pseudo-gradient `base - inner(inputs)` goes into `.grad` of base
    and a real torch.optim optimizer (`optimizer`) steps it (merge.outer).

    `state` holds the optimizer's slots for this tensor (momentum buffer, Adam moments; empty on
    the first step); it is replaced in place by the slots after the step. `stats`, when given,
    accumulates the squared norm of the pseudo-gradient under "grad_sq".
    """
    merged = get_method(inner)(tensors, weights)
    return _stepped(outer_step(_f32(base), merged, dict(state), optimizer), state, stats)


def _stepped(step: tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor], state: dict[str, torch.Tensor],
             stats: dict[str, float] | None) -> torch.Tensor:
    """An outer step's result: `state` replaced in place by the new slots, the gradient's squared
    norm added to `stats`, the new tensor returned."""
    new, new_state, grad = step
    state.clear()
    state.update(new_state)
    if stats is not None:
        g = grad.reshape(-1)
        stats["grad_sq"] = stats.get("grad_sq", 0.0) + float(torch.dot(g, g))  # a statistic: fp32 is plenty
    return new


# -- the registry ---------------------------------------------------------------------------
def _check_density(p: Mapping[str, Any]) -> list[str]:
    d = p.get("density", 0.2)
    return [] if isinstance(d, (int, float)) and 0 < d <= 1 else [f"density must be in (0, 1], got {d!r}"]


def _check_scale(p: Mapping[str, Any]) -> list[str]:
    s = p.get("scale", 1.0)
    return [] if isinstance(s, (int, float)) and math.isfinite(s) else [f"scale must be a finite number, got {s!r}"]


def _check_t(p: Mapping[str, Any]) -> list[str]:
    t = p.get("t", 0.5)
    return [] if isinstance(t, (int, float)) and 0 <= t <= 1 else [f"t must be in [0, 1], got {t!r}"]


def _two(w: Sequence[float]) -> list[str]:
    return [] if len(w) == 2 else [f"slerp interpolates exactly two models; got {len(w)}"]


def _check_normalize(p: Mapping[str, Any]) -> list[str]:
    n = p.get("normalize", True)
    return [] if isinstance(n, bool) else [f"normalize must be true or false, got {n!r}"]


def _check_optimizer(p: Mapping[str, Any]) -> list[str]:
    return [] if isinstance(p.get("optimizer"), OuterConfig) else ["outer needs optimizer= (an OuterConfig)"]


def _positive_sum(w: Sequence[float]) -> list[str]:
    return [] if sum(w) > 0 else [f"weights must sum to a positive number, got {list(w)}"]


def _uniform(w: Sequence[float]) -> list[str]:
    return [] if len(set(w)) <= 1 else [f"median is unweighted; drop the weights (got {list(w)})"]


@dataclass(frozen=True)
class Method:
    fn: MergeFn
    """Merges one segment (a slice of a tensor, every input's same elements): element-wise."""
    needs_base: bool = False
    """The method is given `base=` (the inputs' common starting point)."""
    params: tuple[str, ...] = ()
    """Keyword parameters it accepts (besides base, state, stats, aux)."""
    checks: tuple[Callable[[Mapping[str, Any]], list[str]], ...] = ()
    weight_checks: tuple[Callable[[Sequence[float]], list[str]], ...] = (_positive_sum,)
    stateful: bool = False
    """Reads and replaces optimizer state (`state=`), saved between merges."""
    propagates_nonfinite: bool = False
    """A NaN or Inf in any input (or base) always makes the result non-finite (sums do; a median
    does not): the engine then checks the result only, and the inputs only to name the culprit."""
    prepare: Callable[[Sequence[Any], Any, Mapping[str, Any]], dict[str, Any]] | None = None
    """(inputs, base, params) -> per tensor name, what `fn` needs of the whole tensors (`aux=`),
    computed before the stream starts."""


METHODS: dict[str, Method] = {
    "average": Method(average, propagates_nonfinite=True),
    "task-arithmetic": Method(task_arithmetic, needs_base=True, params=("scale",), checks=(_check_scale,),
                              weight_checks=(), propagates_nonfinite=True),
    "ties": Method(ties, needs_base=True, params=("density", "scale", "normalize"),
                   checks=(_check_density, _check_scale, _check_normalize),
                   prepare=ties_thresholds),
    "median": Method(median, weight_checks=(_uniform,)),
    "slerp": Method(slerp, params=("t",), checks=(_check_t,), weight_checks=(_two, _uniform), prepare=slerp_coefficients),
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
    for check in m.checks:
        problems += check(params)
    return problems
