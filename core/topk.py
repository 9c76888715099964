"""Top-k of each chunk, in 2, 4 or 8 bits: the sparse coding of an outer gradient (round.codec: topk).

A tensor is seen flat and cut into chunks of CHUNK consecutive entries (a tensor smaller than that
is one chunk of its own size; the last chunk is padded with entries never chosen over a real one).
Each chunk keeps its k entries of largest magnitude, k = ceil(topk x chunk), stored as

    name          U8   [ceil(chunks x k x bits / 8)]  the kept values' codes, packed low bits first
    name::index   I16  [chunks, k]                    their offsets in the chunk, strictly ascending
    name::scale   F32  [chunks]                       the chunk's largest kept magnitude, a

A code q in [0, 2^bits) stands for -a + (q + 1/2) 2a / 2^bits (uniform, symmetric, no zero level:
a kept entry is never small), so a value is off by at most a / 2^bits. Flat chunks rather than
SparseLoCo's 2-D tiles: with plain top-k (no DCT, as DeMo has) a tile's 2-D locality buys nothing,
while a flat chunk is a view of any tensor, whatever its rank, and its offsets fit 16 bits.
Pure logic, no I/O; decoding checks everything a damaged or hostile file could get wrong.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from core.errors import CheckpointError

CHUNK = 4096
"""Entries per chunk (SparseLoCo's 64 x 64): offsets fit int16."""
BITS = (2, 4, 8)


@dataclass(frozen=True)
class Layout:
    """How a tensor of `numel` entries is chunked and kept."""

    numel: int
    chunk: int
    chunks: int
    k: int

    def packed_len(self, bits: int) -> int:
        return math.ceil(self.chunks * self.k * bits / 8)


def layout(numel: int, topk: float, chunk: int = CHUNK) -> Layout:
    size = max(1, min(chunk, numel))
    chunks = math.ceil(numel / size) if numel else 0
    return Layout(numel, size, chunks, min(size, max(1, math.ceil(topk * size - 1e-9))))


def encode(v: torch.Tensor, topk: float, bits: int) -> dict[str, torch.Tensor]:
    """{"values", "index", "scale"} of the fp32 tensor `v` (see the module docstring)."""
    lay = layout(v.numel(), topk)
    padded = torch.zeros(lay.chunks, lay.chunk)
    padded.view(-1)[:lay.numel] = v.detach().reshape(-1)
    mag = padded.abs()
    mag.view(-1)[lay.numel:] = -1.0  # padding: below every real magnitude
    idx = mag.topk(lay.k, dim=1, sorted=False).indices.sort(dim=1).values
    kept = padded.gather(1, idx)
    scale = kept.abs().amax(dim=1) if lay.chunks else torch.zeros(0)
    levels = 1 << bits
    step = torch.where(scale > 0, 2 * scale / levels, torch.ones_like(scale))[:, None]
    codes = torch.floor((kept + scale[:, None]) / step).clamp_(0, levels - 1).to(torch.uint8)
    return {"values": pack(codes.reshape(-1), bits), "index": idx.to(torch.int16), "scale": scale}


def sparse(name: str, numel: int, topk: float, bits: int, values: torch.Tensor, index: torch.Tensor,
           scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(flat positions int64, fp32 values) of the kept entries of tensor `name`, from its stored
    entries (shapes already checked against the header); positions in padding are dropped.
    Raises CheckpointError for offsets out of range or not strictly ascending (a duplicate), and for
    scales that are negative or not finite."""
    lay = layout(numel, topk)
    idx = index.to(torch.int64)
    if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= lay.chunk):
        raise CheckpointError(f"tensor {name}: a kept entry's offset is out of range [0, {lay.chunk}): the file is damaged")
    if lay.k > 1 and not bool((idx[:, 1:] > idx[:, :-1]).all()):
        raise CheckpointError(f"tensor {name}: kept entries' offsets are not strictly ascending in each chunk "
                              "(a duplicate, or out of order): the file is damaged")
    scale = scale.to(torch.float32)
    if not bool(torch.isfinite(scale).all()) or bool((scale < 0).any()):
        raise CheckpointError(f"tensor {name}: a chunk's scale is negative or not finite: the file is damaged")
    codes = unpack(values, bits, lay.chunks * lay.k).view(lay.chunks, lay.k).to(torch.float32)
    step = (2 * scale / (1 << bits))[:, None]
    vals = (codes + 0.5) * step - scale[:, None]
    pos = (idx + torch.arange(lay.chunks)[:, None] * lay.chunk).reshape(-1)
    vals = vals.reshape(-1)
    real = pos < numel
    return (pos, vals) if bool(real.all()) else (pos[real], vals[real])


def dense(numel: int, positions: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    return torch.zeros(numel).index_put_((positions,), values)


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes < 2^bits, 8 / bits to a byte, the first in the lowest bits."""
    per = 8 // bits
    padded = torch.zeros(math.ceil(codes.numel() / per) * per, dtype=torch.uint8)
    padded[:codes.numel()] = codes
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8)
    return (padded.view(-1, per) << shifts).sum(dim=1, dtype=torch.uint8) if per > 1 else padded


def unpack(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    per = 8 // bits
    if per == 1:
        return packed[:n]
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8)
    return ((packed[:, None] >> shifts) & ((1 << bits) - 1)).reshape(-1)[:n]
