"""Merge methods: one small pure function per method, registered in one table.

A method takes the same-named tensor from every input (already validated: same shape, finite),
their weights, and returns the merged tensor in float32. Accumulation is always float32, whatever
the inputs' dtype, so bf16 checkpoints lose nothing to the sum.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

MergeFn = Callable[..., torch.Tensor]


def average(tensors: Sequence[torch.Tensor], weights: Sequence[float], **_: object) -> torch.Tensor:
    """Weighted mean: lo-fi's final average, a model soup, the mean inside DiLoCo's outer gradient."""
    total = float(sum(weights))
    if total <= 0:
        raise ValueError(f"weights must sum to a positive number, got {list(weights)}")
    acc = torch.zeros(tensors[0].shape, dtype=torch.float32)
    for t, w in zip(tensors, weights):
        acc.add_(t.to(torch.float32), alpha=w / total)
    return acc


METHODS: dict[str, MergeFn] = {
    "average": average,
}


def get_method(name: str) -> MergeFn:
    try:
        return METHODS[name]
    except KeyError:
        raise ValueError(f"unknown merge method {name!r}; valid methods: {', '.join(sorted(METHODS))}") from None
