"""Top-k of each chunk: the one sparse coding of an outer gradient (round.codec: topk, and the
pruned deltas of round.prune_keep, core/codec.py).

A tensor is seen flat and cut into chunks of consecutive entries: CHUNK of them for round.codec
topk, one row of the tensor for a pruned delta (a tensor smaller than a chunk is one chunk of its
own size; the last chunk is padded with entries never chosen over a real one). Each chunk keeps its
k entries of largest magnitude, k = ceil(fraction x chunk), stored as one row of the tensor's
single entry `name`, U8 [chunks, Layout.row_bytes(bits)]:

    4 bytes                   the chunk's largest kept magnitude a, F32 little-endian
    ceil(k x bits / 8) bytes  the kept values' codes, packed low bits first
    index_bytes               their offsets in the chunk: Elias-Fano's code, or a bitmap

(One entry a tensor, not three: a safetensors header costs about 90 bytes an entry, which for the
built-in model's 29 tensors was a fifth of the file.)

In 2, 4 or 8 bits, a code q in [0, 2^bits) stands for -a + (q + 1/2) 2a / 2^bits (uniform,
symmetric, no zero level: a kept entry is never small), so a value is off by at most a / 2^bits;
in 16 or 32 bits, the code is the value itself as bfloat16 or float32 (a pruned bf16 or fp32
delta). Flat chunks rather than SparseLoCo's 2-D tiles: with plain top-k (no DCT, as DeMo has) a
tile's 2-D locality buys nothing, while a flat chunk is a view of any tensor, whatever its rank.

Offsets, ascending, in Elias-Fano's code (a fixed size for a given chunk and k, so the reader
checks a file's shapes before it decodes a byte): with l = floor(log2(chunk / k)), each offset's
low l bits, packed, then its high part o >> l in unary, a bit set at (o >> l) + i for the i-th
offset in a field of k + (chunk >> l) bits. That is about 2 + log2(chunk / k) bits an offset
(8 at 1/64, 6 at 1/16) instead of 16. Where a bitmap of the chunk (a bit a position, set where
kept) is no larger, from about k = chunk / 4 on, the offsets are that bitmap instead, which is
also the faster to decode (a pruned delta keeping half of each row: docs/benchmarks.md).
Pure logic, no I/O; decoding checks everything a damaged or hostile file could get wrong.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from core.errors import CheckpointError

CHUNK = 4096
"""Entries per chunk (SparseLoCo's 64 x 64)."""
BITS = (2, 4, 8)
"""Widths of the quantized values (round.bits)."""
RAW = {16: torch.bfloat16, 32: torch.float32}
"""Widths at which a value is stored as it is, in that dtype."""
LAYOUT = "rows/elias-fano-or-bitmap"
"""How chunks are stored, named in a file's metadata (an older islands wrote "rows/elias-fano",
with no bitmap, and before it files without a layout, of three entries a tensor)."""


@dataclass(frozen=True)
class Layout:
    """How a tensor of `numel` entries is chunked and kept."""

    numel: int
    chunk: int
    chunks: int
    k: int

    def code_bytes(self, bits: int) -> int:
        return math.ceil(self.k * bits / 8)

    def row_bytes(self, bits: int) -> int:
        """Bytes of one chunk's row: scale, codes, offsets."""
        return 4 + self.code_bytes(bits) + self.index_bytes

    @property
    def low_bits(self) -> int:
        """Elias-Fano's l: the bits of each offset stored as they are."""
        return (self.chunk // self.k).bit_length() - 1

    @property
    def high_bits(self) -> int:
        """Bits of the unary field of the offsets' high parts."""
        return self.k + (self.chunk >> self.low_bits)

    @property
    def bitmap(self) -> bool:
        """Offsets stored as a bitmap of the chunk: it is no larger than their Elias-Fano code."""
        return math.ceil(self.chunk / 8) <= math.ceil(self.k * self.low_bits / 8) + math.ceil(self.high_bits / 8)

    @property
    def index_bytes(self) -> int:
        """Bytes of one chunk's coded offsets: the bitmap, or the low bits then the high field, each
        whole bytes."""
        if self.bitmap:
            return math.ceil(self.chunk / 8)
        return math.ceil(self.k * self.low_bits / 8) + math.ceil(self.high_bits / 8)


_SHIFTS = torch.arange(8, dtype=torch.uint8)


def layout(numel: int, topk: float, chunk: int = CHUNK) -> Layout:
    size = max(1, min(chunk, numel))
    chunks = math.ceil(numel / size) if numel else 0
    return Layout(numel, size, chunks, min(size, max(1, math.ceil(topk * size - 1e-9))))


def largest(mag: torch.Tensor, k: int) -> torch.Tensor:
    """The column indices of the k largest entries of each row of `mag`, ascending: the one sparse
    selection of a coded delta, sorted so that the same delta always codes to the same bytes."""
    return mag.topk(k, dim=1, sorted=False).indices.sort(dim=1).values


def encode(v: torch.Tensor, topk: float, bits: int, chunk: int = CHUNK) -> torch.Tensor:
    """U8 [chunks, row_bytes] of the fp32 tensor `v` (see the module docstring)."""
    lay = layout(v.numel(), topk, chunk)
    padded = torch.zeros(lay.chunks, lay.chunk)
    padded.view(-1)[:lay.numel] = v.detach().reshape(-1)
    mag = padded.abs()
    mag.view(-1)[lay.numel:] = -1.0  # padding: below every real magnitude
    idx = largest(mag, lay.k)
    kept = padded.gather(1, idx)
    scale = kept.abs().amax(dim=1) if lay.chunks else torch.zeros(0)
    head = scale.to(torch.float32).view(torch.uint8).view(lay.chunks, 4)
    if bits in RAW:
        return torch.cat([head, kept.to(RAW[bits]).view(torch.uint8), encode_offsets(idx, lay)], dim=1)
    levels = 1 << bits
    step = torch.where(scale > 0, 2 * scale / levels, torch.ones_like(scale))[:, None]
    codes = torch.floor((kept + scale[:, None]) / step).clamp_(0, levels - 1).to(torch.uint8)
    return torch.cat([head, pack(codes, bits), encode_offsets(idx, lay)], dim=1)


def encode_offsets(idx: torch.Tensor, lay: Layout) -> torch.Tensor:
    """U8 [chunks, index_bytes]: each row of `idx` ([chunks, k], ascending, in [0, chunk]) in
    Elias-Fano's code, or as a bitmap (module docstring)."""
    idx = idx.to(torch.int64)
    if lay.bitmap:
        return to_bytes(torch.zeros(lay.chunks, lay.chunk, dtype=torch.uint8).scatter_(1, idx, 1))
    high = torch.zeros(lay.chunks, lay.high_bits, dtype=torch.uint8)
    high.scatter_(1, (idx >> lay.low_bits) + torch.arange(lay.k), 1)
    return torch.cat([pack(idx & ((1 << lay.low_bits) - 1), lay.low_bits), to_bytes(high)], dim=1)


def decode_offsets(name: str, coded: torch.Tensor, lay: Layout) -> torch.Tensor:
    """int32 [chunks, k] offsets from their code (encode_offsets); CheckpointError where a chunk's
    bitmap or high field does not hold exactly k set bits (positions are otherwise checked by the
    caller)."""
    if lay.bitmap:
        return (bitmap_positions(name, coded, lay).view(lay.chunks, lay.k) - _starts(lay)[:, None]).to(torch.int32)
    low_len = math.ceil(lay.k * lay.low_bits / 8)
    high = to_bits(coded[:, low_len:], lay.high_bits)
    if lay.chunks and not bool((high.sum(dim=1, dtype=torch.int32) == lay.k).all()):
        raise CheckpointError(_miscounted(name, lay))
    # set bits in reading order: each chunk's k, ascending; less each bit's row start and rank
    at = set_bits(high).view(lay.chunks, lay.k)  # int64: a field of a big tensor passes 2^31 bits
    his = (at - torch.arange(lay.chunks)[:, None] * lay.high_bits - torch.arange(lay.k)).to(torch.int32)
    if not lay.low_bits:  # k > chunk / 2: the high field alone is the offsets
        return his
    return his << lay.low_bits | unpack(coded[:, :low_len], lay.k, lay.low_bits, torch.int32)


def bitmap_positions(name: str, coded: torch.Tensor, lay: Layout) -> torch.Tensor:
    """Flat positions (int64) of the bits set in the chunks' bitmaps (U8 [chunks, chunk / 8]):
    each chunk's k, ascending; CheckpointError where a chunk does not hold exactly k."""
    pos = set_bits(to_bits(coded, lay.chunk))
    if pos.numel() != lay.chunks * lay.k:
        raise CheckpointError(_miscounted(name, lay))
    # all k x chunks in ascending order: each chunk holds k exactly when each run of k (a row of
    # this view) begins and ends inside its own chunk
    ends, starts = pos.view(lay.chunks, lay.k)[:, [0, -1]], _starts(lay)
    if not bool(((ends[:, 0] >= starts) & (ends[:, 1] < starts + lay.chunk)).all()):
        raise CheckpointError(_miscounted(name, lay))
    return pos


def set_bits(bits: torch.Tensor) -> torch.Tensor:
    """Flat indices (int64, ascending) of the 1s of a 0/1 uint8 tensor: numpy's nonzero of a bool
    view, which is several times faster than torch.nonzero (docs/benchmarks.md, Compressed contributions)."""
    return torch.from_numpy(np.flatnonzero(bits.numpy().view(np.bool_)))


def _starts(lay: Layout) -> torch.Tensor:
    return torch.arange(lay.chunks) * lay.chunk


def _miscounted(name: str, lay: Layout) -> str:
    return f"tensor {name}: a chunk's coded offsets do not hold exactly {lay.k} entries: the file is damaged"


def to_bytes(bits: torch.Tensor) -> torch.Tensor:
    """uint8 [rows, ceil(n / 8)] of 0/1 entries [rows, n], the first in the lowest bit (numpy.packbits)."""
    return torch.from_numpy(np.packbits(bits.to(torch.uint8).numpy(), axis=1, bitorder="little"))


def to_bits(coded: torch.Tensor, n: int) -> torch.Tensor:
    """uint8 0/1 [rows, n] of uint8 [rows, >= n / 8] (to_bytes undone: numpy.unpackbits)."""
    return torch.from_numpy(np.unpackbits(coded.numpy(), axis=1, count=n, bitorder="little"))


def pack(values: torch.Tensor, width: int) -> torch.Tensor:
    """uint8 [rows, ceil(count x width / 8)] of [rows, count] numbers below 2^width, low bits first."""
    rows, count = values.shape
    if width == 8:
        return values.to(torch.uint8)
    bits = (values.to(torch.int32)[:, :, None] >> torch.arange(width, dtype=torch.int32)) & 1
    return to_bytes(bits.reshape(rows, count * width))


def unpack(coded: torch.Tensor, count: int, width: int, dtype: torch.dtype) -> torch.Tensor:
    """[rows, count] numbers of `width` bits each, packed low bits first in the uint8 rows `coded` (pack undone)."""
    rows = coded.shape[0]
    if width and 8 % width == 0:  # whole fields in each byte: shift them out of the bytes
        fields = (coded[:, :, None] >> _SHIFTS[::width]) & ((1 << width) - 1)
        return fields.reshape(rows, coded.shape[1] * (8 // width))[:, :count].to(dtype)
    bits = to_bits(coded, count * width).reshape(rows, count, width)
    out = torch.zeros(rows, count, dtype=dtype)
    for j in range(width):  # one pass a bit: cheaper than a tensor of every bit's weight
        out |= bits[:, :, j].to(dtype) << j
    return out


def sparse(name: str, numel: int, topk: float, bits: int, rows: torch.Tensor, chunk: int = CHUNK
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """(flat positions int64, fp32 values) of the kept entries of tensor `name`, from its stored
    rows (shape already checked against the header); positions in padding are dropped.
    Raises CheckpointError for offsets out of range or not strictly ascending (a duplicate), for
    scales that are negative, not finite, or so large that the values overflow, and for stored
    values (16 or 32 bits) that are not finite."""
    lay = layout(numel, topk, chunk)
    code_end = 4 + lay.code_bytes(bits)
    coded = rows[:, code_end:]
    pos = bitmap_positions(name, coded, lay) if lay.bitmap else _ef_positions(name, coded, lay)
    scale = rows[:, :4].reshape(-1).clone().view(torch.float32)  # a fresh buffer: aligned for F32
    if not bool(torch.isfinite(scale).all()) or bool((scale < 0).any()):
        raise CheckpointError(f"tensor {name}: a chunk's scale is negative or not finite: the file is damaged")
    if bits in RAW:
        vals = rows[:, 4:code_end].reshape(-1).clone().view(RAW[bits]).to(torch.float32)  # a fresh, aligned buffer
        if not bool(torch.isfinite(vals).all()):
            raise CheckpointError(f"tensor {name}: a kept value is NaN or Inf: the file is damaged")
    else:
        step = (2 * scale / (1 << bits))[:, None]
        vals = torch.addcmul(0.5 * step - scale[:, None], unpack(rows[:, 4:code_end], lay.k, bits, torch.float32), step)
        if not bool(torch.isfinite(vals).all()):  # a finite scale near float32's largest: its values overflow
            raise CheckpointError(f"tensor {name}: a chunk's scale ({float(scale.max()):.3g}) is too large for its "
                                  "values to be float32 numbers: the file is damaged")
    vals = vals.reshape(-1)
    if lay.chunks * lay.chunk == numel:  # no padding
        return pos, vals
    real = pos < numel
    return pos[real], vals[real]


def _ef_positions(name: str, coded: torch.Tensor, lay: Layout) -> torch.Tensor:
    """Flat positions (int64) of the offsets in Elias-Fano's code, checked in range and ascending
    (a bitmap's are, as they are decoded)."""
    idx = decode_offsets(name, coded, lay)
    if idx.numel() and int(idx.max()) >= lay.chunk:  # never below 0 from Elias-Fano's code
        raise CheckpointError(f"tensor {name}: a kept entry's offset is out of range [0, {lay.chunk}): the file is damaged")
    if lay.k > 1 and not bool((idx[:, 1:] > idx[:, :-1]).all()):
        raise CheckpointError(f"tensor {name}: kept entries' offsets are not strictly ascending in each chunk "
                              "(a duplicate, or out of order): the file is damaged")
    return (idx + _starts(lay)[:, None]).reshape(-1)


def dense(numel: int, positions: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    return torch.zeros(numel).index_put_((positions,), values)
