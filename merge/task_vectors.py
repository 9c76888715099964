"""Task-vector merges: sparsify each input's task vector `t_i - base`, elect signs or not, combine.

One function covers TIES, DARE, Model Breadcrumbs and DELLA, as mergekit's generalised task
arithmetic does; a method is a choice of sparsifier and of sign consensus (merge.methods's table):

| sparsifier | keeps of each task vector                                               | scaled by |
|------------|--------------------------------------------------------------------------|-----------|
| magnitude  | the int(density*n) largest magnitudes (TIES)                             | 1         |
| outliers   | int(density*n) magnitudes under the top int(gamma*n) (Breadcrumbs)        | 1         |
| random     | each entry with probability density (DARE)                              | 1/density |
| della      | each entry with probability density-eps..density+eps by its rank in its row | 1/p     |

With `consensus`, each element's sign is elected by the weighted sum of the sparsified vectors
(a sum of exactly 0 elects +) and only the entries that agree with it are summed. The weighted
sum is divided by the weights summed (`normalize`; with consensus, the weights of the agreeing
entries), scaled, and added to base.

Streaming: the engine feeds slices. What a sparsifier needs of a whole tensor is computed first
by `prepare` (one whole tensor of one input at a time): the magnitude cuts, or the key of each
input's random mask. Random masks come from a counter-based generator (numpy's Philox) keyed by
(seed, input, tensor name) and addressed by element index, so a slice draws exactly the numbers
the whole tensor would: the merge is reproducible from its seed, whatever the slicing. DELLA ranks
within rows, so the engine cuts its slices on row boundaries (`Method.rows`).
"""
from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from core.checkpoint import FLOATS

SPARSIFIERS = ("magnitude", "outliers", "random", "della")


@dataclass(frozen=True)
class Cut:
    """What one input's sparsifier needs of the whole tensor: keep lo <= |x| < hi (magnitude,
    outliers), or the key of its random mask (random, della)."""
    lo: float = 0.0
    hi: float = math.inf
    key: int = 0


@dataclass(frozen=True)
class TensorAux:
    cuts: list[Cut]
    """One per input, in input order."""
    row: int
    """Elements per row (della ranks within rows): `row_length`."""


def mask_key(seed: int, index: int, name: str) -> int:
    """The 128-bit Philox key of input `index`'s mask of tensor `name`."""
    return int.from_bytes(hashlib.blake2b(f"{seed}\0{index}\0{name}".encode(), digest_size=16).digest(), "little")


def uniform(key: int, start: int, n: int) -> torch.Tensor:
    """Elements start..start+n of the uniform [0, 1) stream with this key (float64, 53 random bits
    each): Philox yields four 64-bit words per counter step, so any slice is reachable directly."""
    gen = np.random.Philox(key=key)
    gen.advance(start // 4)
    raw = gen.random_raw(n + start % 4)[start % 4:]
    return torch.from_numpy((raw >> np.uint64(11)).astype(np.float64) * 2.0 ** -53)


def _kth_smallest(a: np.ndarray, k: int) -> float:
    a.partition(k)
    return float(a[k])


def cut_of(t: torch.Tensor, base: torch.Tensor, sparsify: str, p: Mapping[str, Any]) -> Cut:
    """The magnitude cut of the task vector `t - base` (whole tensors) for `sparsify`."""
    n = base.numel()
    a = t.to(torch.float32, copy=True).reshape(-1).sub_(base.to(torch.float32).reshape(-1)).abs_().numpy()
    if n == 0:
        return Cut()
    keep = int(p["density"] * n)
    if sparsify == "magnitude":
        return Cut(lo=_kth_smallest(a, n - min(n, max(1, keep))))
    n_bot = max(0, n - keep - int(p["gamma"] * n))  # outliers: as mergekit, the top cut shrinks to keep `keep`
    lo = _kth_smallest(a, n_bot) if keep else math.inf
    return Cut(lo=lo, hi=_kth_smallest(a, n_bot + keep) if n_bot + keep < n else math.inf)


def row_length(shape: Sequence[int]) -> int:
    """Elements per row: a tensor of 2+ dims is shape[0] rows, a vector (or scalar) is one row."""
    numel = math.prod(shape)
    return numel // shape[0] if len(shape) >= 2 and shape[0] else max(numel, 1)


def tensor_aux(sparsify: str, params: Mapping[str, Any], name: str, base: torch.Tensor,
               inputs: Iterable[torch.Tensor]) -> TensorAux:
    """What the sparsifier needs of tensor `name` (whole `base` and `inputs`, read one at a time)."""
    if sparsify in ("random", "della"):
        cuts = [Cut(key=mask_key(params["seed"], i, name)) for i, _ in enumerate(inputs)]
    else:
        cuts = [cut_of(t, base, sparsify, params) for t in inputs]
    return TensorAux(cuts, row_length(base.shape))


def prepare(sparsify: str):
    """The engine's `prepare` for a sparsifier: (inputs, base, params) -> {tensor name: TensorAux}."""
    def run(inputs: Sequence[Any], base: Any, params: Mapping[str, Any]) -> dict[str, TensorAux]:
        reads = sparsify not in ("random", "della")  # random masks need only the names
        out = {}
        for name, (f, spec) in base.tensors.items():
            if spec.dtype in FLOATS:
                b = f.read(name).to(torch.float32) if reads else torch.empty(spec.shape, device="meta")
                ts = (m.tensors[name][0].read(name) if reads else b for m in inputs)
                out[name] = tensor_aux(sparsify, params, name, b, ts)
        return out
    return run


def della_keep(tv: torch.Tensor, row: int, density: float, epsilon: float) -> torch.Tensor:
    """DELLA's keep probability of each entry: density - eps for the smallest magnitude of its row,
    rising linearly with rank to density + eps for the largest (ties ranked in index order)."""
    a = tv.reshape(-1, row).abs()
    rank = a.argsort(dim=1, stable=True).argsort(dim=1, stable=True).to(torch.float64)
    frac = rank / (row - 1) if row > 1 else torch.zeros_like(rank)
    return (density - epsilon + frac * (2 * epsilon)).reshape(-1)


def sparsified(tv: torch.Tensor, cut: Cut, sparsify: str, p: Mapping[str, Any], start: int, row: int) -> torch.Tensor:
    """One input's task-vector slice (flat, float32, starting at element `start`) sparsified."""
    zero = torch.zeros((), dtype=tv.dtype)
    if sparsify in ("magnitude", "outliers"):
        a = tv.abs()
        return tv.where((a >= cut.lo) & (a < cut.hi), zero)
    keep_p = (torch.full((tv.numel(),), float(p["density"]), dtype=torch.float64) if sparsify == "random"
              else della_keep(tv, row, p["density"], p["epsilon"]))
    kept = tv.where(uniform(cut.key, start, tv.numel()) < keep_p, zero)
    return (kept.to(torch.float64) / keep_p).to(torch.float32) if p.get("rescale", True) else kept


def combine(tvs: Sequence[torch.Tensor], weights: Sequence[float], consensus: bool, normalize: bool) -> torch.Tensor:
    """The weighted sum of the (flat) sparsified task vectors, with TIES's sign election when
    `consensus`, divided by the summed weights when `normalize`. Stacked and summed along the
    inputs with mergekit's operations (torch's reduction order is not left to right beyond four
    inputs), so that the two agree bit for bit; memory is K slices."""
    w = torch.tensor([float(x) for x in weights], dtype=torch.float32).reshape(-1, 1)
    wt = torch.stack(tvs).mul_(w)
    if not consensus:
        num, den = wt.sum(dim=0), w.sum()
        return num.div_(den) if normalize and abs(float(den)) >= 1e-8 else num
    agree = torch.sign(wt) == torch.where(wt.sum(dim=0) >= 0, 1.0, -1.0)  # a trimmed (zero) entry agrees with neither
    num = (wt * agree).sum(dim=0)
    if not normalize:
        return num
    den = (w * agree).sum(dim=0)
    return num.div_(den.masked_fill_(den == 0, 1.0))


def scaled_sum(base: torch.Tensor, merged: torch.Tensor, scale: float) -> torch.Tensor:
    """base + scale * merged, in base's shape (the product only when scale is not 1, as mergekit)."""
    if scale != 1:
        merged = merged.mul_(float(scale))
    return (base.reshape(-1) + merged).reshape(base.shape)


@dataclass(frozen=True)
class TaskVectorMerge:
    """A member of the family (merge.methods registers each): how it sparsifies the task vectors,
    and whether it elects a sign per entry (TIES's consensus) or sums them."""

    sparsify: str
    consensus: bool

    def __call__(self, tensors: Sequence[torch.Tensor], weights: Sequence[float], *, base: torch.Tensor,
                 aux: TensorAux | None = None, start: int = 0, **p: Any) -> torch.Tensor:
        """base + scale * combine(sparsify(t_i - base)): see the module docstring. `aux` comes from
        `prepare` when the engine feeds slices; without it the tensors are whole and it is computed.
        `p`: the method's parameters (scale, normalize, density, ...)."""
        aux = aux if aux is not None else tensor_aux(self.sparsify, p, "", base, tensors)
        b = base.to(torch.float32).reshape(-1)
        tvs = [sparsified(t.to(torch.float32).reshape(-1) - b, cut, self.sparsify, p, start, aux.row)
               for t, cut in zip(tensors, aux.cuts)]
        merged = combine(tvs, weights, self.consensus, p.get("normalize", False))
        return scaled_sum(b, merged, p.get("scale", 1.0)).reshape(base.shape)
