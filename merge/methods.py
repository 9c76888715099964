"""Merge methods: one small pure function per method, registered in one table.

A method takes the same-named tensor (or the same slice of it) from every input, already validated
(same shape and dtype, finite), the inputs' weights, and returns the merged tensor in float32.
Accumulation is always float32, whatever the inputs' dtype, so bf16 checkpoints lose nothing to
the sum. Methods that need the starting point of the inputs (task vectors are `input - base`)
receive it as `base=`; the engine passes it only to methods registered with `needs_base`.

Methods registered `elementwise` (the output element i depends only on element i of the inputs)
are fed slices of big tensors, so memory stays at a few MiB per input whatever the tensor sizes;
`ties` trims by magnitude over a whole tensor, so it is fed whole tensors (K of them at once).

| method          | result                                                                      |
|-----------------|-----------------------------------------------------------------------------|
| average         | sum_i w_i t_i / sum_i w_i (lo-fi, model soups, FedAvg)                       |
| task-arithmetic | base + scale * sum_i w_i (t_i - base)            (Ilharco et al. 2023)       |
| ties            | base + scale * disjoint-mean(trim(t_i - base))   (Yadav et al. 2023)         |
| median          | element-wise median of the inputs (mean of the middle two for even K)        |
| outer           | one DiLoCo outer step from base with the pseudo-gradient base - average      |
| outer-delta     | the same step, the inputs being pseudo-gradients: their average is the grad  |
"""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from core.config import OuterConfig
from merge.outer import outer_step, outer_step_from_grad

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
    """base + scale * sum_i w_i (t_i - base): weights are used as given (not normalised)."""
    b = _f32(base)
    # sum_i w_i (t_i - b) = sum_i w_i t_i - (sum_i w_i) b: one pass per input, no task-vector copies
    acc = _weighted_sum(tensors, [scale * w for w in weights])
    return acc.add_(b, alpha=1.0 - scale * float(sum(weights)))


def ties(tensors: Sequence[torch.Tensor], weights: Sequence[float], *, base: torch.Tensor,
         density: float = 0.2, scale: float = 1.0, **_: object) -> torch.Tensor:
    """TIES: trim each task vector to its top `density` fraction by magnitude, elect each element's
    sign by the weighted sum of the trimmed vectors, then take the weighted mean of the entries
    that agree with the elected sign (zero where none does), scaled and added to base.

    Trimming keeps ceil(density * n) entries of each task vector of n elements.
    """
    b = _f32(base)
    n = b.numel()
    if n == 0:
        return b.clone()
    k = min(n, max(1, math.ceil(density * n)))
    trimmed = []
    for t in tensors:
        tv = (_f32(t) - b).reshape(-1)
        if k < n:
            keep = torch.zeros(n, dtype=torch.bool)
            keep[tv.abs().topk(k, sorted=False).indices] = True
            tv = tv.where(keep, torch.zeros((), dtype=tv.dtype))
        trimmed.append(tv)
    elected = torch.sign(_weighted_sum(trimmed, weights))
    num = torch.zeros(n, dtype=torch.float32)
    den = torch.zeros(n, dtype=torch.float32)
    for tv, w in zip(trimmed, weights):
        agree = (torch.sign(tv) == elected) & (tv != 0)
        num.add_(tv * agree, alpha=float(w))
        den.add_(agree.to(torch.float32), alpha=float(w))
    merged = torch.where(den != 0, num / den.where(den != 0, torch.ones((), dtype=den.dtype)), torch.zeros(()))
    return b.add(merged.reshape(b.shape), alpha=float(scale))


def median(tensors: Sequence[torch.Tensor], weights: Sequence[float], **_: object) -> torch.Tensor:
    """Element-wise median; for an even count, the mean of the two middle values. Unweighted."""
    if len(tensors) == 1:
        return _f32(tensors[0]).clone()
    s = torch.stack([_f32(t) for t in tensors]).sort(dim=0).values
    k = len(tensors)
    return s[k // 2].clone() if k % 2 else (s[k // 2 - 1] + s[k // 2]) / 2


def outer(tensors: Sequence[torch.Tensor], weights: Sequence[float], *, base: torch.Tensor,
          state: dict[str, torch.Tensor], optimizer: OuterConfig, inner: str = "average",
          stats: dict[str, float] | None = None, in_place: bool = False, **_: object) -> torch.Tensor:
    """One DiLoCo outer step: the pseudo-gradient `base - inner(inputs)` goes into `.grad` of base
    and a real torch.optim optimizer (`optimizer`) steps it (merge.outer).

    `state` holds the optimizer's slots for this tensor (momentum buffer, Adam moments; empty on
    the first step); it is replaced in place by the slots after the step. `stats`, when given,
    accumulates the squared norm of the pseudo-gradient under "grad_sq". `in_place`: base, the
    state's tensors and a single input are the caller's to overwrite (merge.outer.outer_step).
    """
    # one input (the round merge's mean) averages to itself, bit for bit: skip the copy
    single = len(tensors) == 1 and inner == "average"
    merged = tensors[0] if single else get_method(inner)(tensors, weights)
    return _stepped(outer_step(_f32(base), merged, dict(state), optimizer, in_place=in_place and single), state, stats)


def outer_delta(tensors: Sequence[torch.Tensor], weights: Sequence[float], *, base: torch.Tensor,
                state: dict[str, torch.Tensor], optimizer: OuterConfig, stats: dict[str, float] | None = None,
                in_place: bool = False, **_: object) -> torch.Tensor:
    """`outer` for inputs that are outer gradients already (base - worker weights, as delta
    contributions carry them): their weighted mean goes into `.grad` as it is."""
    grad = tensors[0] if len(tensors) == 1 and tensors[0].dtype == torch.float32 else average(tensors, weights)
    return _stepped(outer_step_from_grad(_f32(base), grad, dict(state), optimizer, in_place=in_place), state, stats)


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


def _check_optimizer(p: Mapping[str, Any]) -> list[str]:
    return [] if isinstance(p.get("optimizer"), OuterConfig) else ["outer needs optimizer= (an OuterConfig)"]


def _positive_sum(w: Sequence[float]) -> list[str]:
    return [] if sum(w) > 0 else [f"weights must sum to a positive number, got {list(w)}"]


def _uniform(w: Sequence[float]) -> list[str]:
    return [] if len(set(w)) <= 1 else [f"median is unweighted; drop the weights (got {list(w)})"]


@dataclass(frozen=True)
class Method:
    fn: MergeFn
    needs_base: bool = False
    """The method is given `base=` (the inputs' common starting point)."""
    elementwise: bool = True
    """Output element i depends on element i of the inputs only: the engine may feed slices."""
    params: tuple[str, ...] = ()
    """Keyword parameters it accepts (besides base, state, stats)."""
    checks: tuple[Callable[[Mapping[str, Any]], list[str]], ...] = ()
    weight_checks: tuple[Callable[[Sequence[float]], list[str]], ...] = (_positive_sum,)
    stateful: bool = False
    """Reads and replaces optimizer state (`state=`), saved between merges."""
    propagates_nonfinite: bool = False
    """A NaN or Inf in any input (or base) always makes the result non-finite (sums do; a median
    does not): the engine then checks the result only, and the inputs only to name the culprit."""
    internal: bool = False
    """Used by the round merge only (merge/incremental.py), not offered by `orchestrate merge`."""


METHODS: dict[str, Method] = {
    "average": Method(average, propagates_nonfinite=True),
    "task-arithmetic": Method(task_arithmetic, needs_base=True, params=("scale",), checks=(_check_scale,),
                              weight_checks=(), propagates_nonfinite=True),
    "ties": Method(ties, needs_base=True, elementwise=False, params=("density", "scale"),
                   checks=(_check_density, _check_scale)),
    "median": Method(median, weight_checks=(_uniform,)),
    "outer": Method(outer, needs_base=True, params=("optimizer", "inner", "in_place"), checks=(_check_optimizer,),
                    stateful=True, propagates_nonfinite=True),  # when `inner` does: see the engine
    "outer-delta": Method(outer_delta, needs_base=True, params=("optimizer", "in_place"), checks=(_check_optimizer,),
                          stateful=True, propagates_nonfinite=True, internal=True),
}
PUBLIC = sorted(name for name, m in METHODS.items() if not m.internal)


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
