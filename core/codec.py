"""Contributions on the wire: full weights, or the outer gradient `delta = base - weights`, compressed.

A worker publishes either its weights (`round.contribution: weights`) or its delta from the base it
trained from (`delta`), coded as `round.codec`: fp32, bf16 or int8, or `topk`: the top
`round.topk` of each chunk of 4096 entries in `round.bits` bits, with error feedback (the worker
adds what it did not send to its next delta: encode's `feedback`). Sparse deltas have one format,
core/topk.py's: topk's, and a delta pruned to the top `round.prune_keep` of each row by magnitude
(the DiLoCo paper's Table 6 prunes outer gradients so, with little loss up to about half pruned),
whose chunks are its rows and whose kept values are stored in the codec's width (fp32 and bf16 as
they are, int8 as 8-bit codes). The file is plain safetensors; for a float tensor `name`:

    fp32 / bf16, dense    name            F32/BF16, the tensor's shape
    int8, dense           name            I8, the tensor's shape; name::scale F32 [rows]
    topk, or pruned       name            U8 [chunks, row bytes]: per chunk its scale, values and offsets (Elias-Fano, or a bitmap)

Rows are the first dimension (a 1-D or 0-D tensor is one row); dense int8 is symmetric per row:
q = round(v / s), s = max|v| / 127, so |v - q s| <= s / 2. Non-float tensors are stored as they are.
The safetensors header metadata `islands.contribution` (JSON) says how the file is coded and the
digest of the base the delta is relative to; a file without it holds plain weights. Decoding is
per tensor, so a merge streams coded contributions like plain ones. Pure logic: no role imports.
"""
from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from core import topk as sparse_code
from core.checkpoint import DTYPES, Alloc, TensorFile, load_checkpoint, read_manifest
from core.config import Config, RoundConfig
from core.errors import CheckpointError
from core.storage import Storage

META = "islands.contribution"
SCALE = "::scale"
CODECS = ("fp32", "bf16", "int8", "topk")
_STORE = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.int8}
_FLOATS = (torch.float64, torch.float32, torch.float16, torch.bfloat16)
_PRUNED_BITS = {"fp32": 32, "bf16": 16, "int8": 8}
"""A pruned delta's kept values: as they are in fp32 and bf16, 8-bit codes for int8 (core/topk.py)."""
ROWS = "rows"
"""A pruned delta's chunks, as its metadata names them: each row of a tensor."""


@dataclass(frozen=True)
class Encoding:
    codec: str
    """fp32, bf16 or int8: how the delta's values are stored."""
    keep: float
    """Fraction of each row's entries kept (by magnitude); 1.0 stores the delta dense."""
    base_digest: str
    """digest of the checkpoint the delta is relative to (weights = base - delta)."""
    topk: float = 0.0
    """topk only: fraction of each chunk kept."""
    bits: int = 0
    """topk only: bits per kept value (2, 4 or 8)."""

    @property
    def sparse(self) -> bool:
        """Stored as chunks of kept entries (core/topk.py): topk, or a pruned delta."""
        return self.codec == "topk" or self.keep < 1

    @property
    def fraction(self) -> float:
        """A sparse delta's fraction of each chunk kept."""
        return self.topk if self.codec == "topk" else self.keep

    @property
    def value_bits(self) -> int:
        """The width of a sparse delta's kept values."""
        return self.bits if self.codec == "topk" else _PRUNED_BITS[self.codec]

    def chunk(self, shape: tuple[int, ...]) -> int:
        """Entries a chunk of a sparse delta of a tensor of `shape`: 4096 (topk), or a row."""
        return sparse_code.CHUNK if self.codec == "topk" else rows_of(shape)[1]

    def layout(self, shape: tuple[int, ...]) -> sparse_code.Layout:
        return sparse_code.layout(math.prod(shape), self.fraction, self.chunk(shape))

    def metadata(self) -> dict[str, str]:
        d = {"format": "delta", "codec": self.codec, "keep": self.keep, "base_digest": self.base_digest}
        if self.codec == "topk":
            d.update(topk=self.topk, bits=self.bits)
        if self.sparse:
            d.update(chunk=sparse_code.CHUNK if self.codec == "topk" else ROWS, layout=sparse_code.LAYOUT)
        return {META: json.dumps(d, sort_keys=True)}


def encoding_for(rc: RoundConfig, base_digest: str, r: int | None = None) -> Encoding:
    """How a worker of a run with round config `rc` codes its delta of round `r` against the base of
    `base_digest` (round.dense_rounds: dense fp32 in a topk run's first rounds)."""
    if rc.codec == "topk" and r is not None and r < rc.dense_rounds:
        return Encoding("fp32", 1.0, base_digest)
    topk = rc.codec == "topk"
    return Encoding(rc.codec, rc.prune_keep, base_digest, rc.topk if topk else 0.0, rc.bits if topk else 0)


def uses_feedback(rc: RoundConfig) -> bool:
    """Whether a worker of a run with round config `rc` keeps an error-feedback buffer."""
    return rc.contribution == "delta" and rc.codec == "topk" and rc.error_feedback > 0


def encoding_of(metadata: Mapping[str, str], label: str) -> Encoding | None:
    """How a checkpoint is coded (from its safetensors metadata); None for plain weights."""
    raw = metadata.get(META)
    if raw is None:
        return None
    try:
        d = json.loads(raw)
        topk = d.get("codec") == "topk"
        enc = Encoding(str(d["codec"]), float(d["keep"]), str(d["base_digest"]),
                       float(d["topk"]) if topk else 0.0, int(d["bits"]) if topk else 0)
    except (ValueError, KeyError, TypeError, AttributeError):
        raise CheckpointError(f"{label}: metadata {META} is malformed ({raw[:80]!r}): the file is damaged") from None
    if d.get("format") != "delta" or enc.codec not in CODECS or not 0 < enc.keep <= 1 or \
            topk and not (0 < enc.topk <= 1 and enc.bits in sparse_code.BITS and enc.keep == 1) or \
            enc.sparse and (d.get("chunk") != (sparse_code.CHUNK if topk else ROWS) or d.get("layout") != sparse_code.LAYOUT):
        raise CheckpointError(f"{label}: unknown contribution coding {raw[:160]!r}; this version reads delta "
                              f"coded as {', '.join(CODECS)} with 0 < keep <= 1 (topk: 0 < topk <= 1, bits 2, 4 or "
                              f"8, keep 1, chunks of {sparse_code.CHUNK}; keep < 1: chunks {ROWS}; both layout "
                              f"{sparse_code.LAYOUT}; a sparse file without a layout was written by an older islands, as was "
                              "one of layout rows/elias-fano: finish that run with it)")
    return enc


def rows_of(shape: tuple[int, ...]) -> tuple[int, int]:
    """(rows, columns) of the 2-D view a tensor is coded in: rows are its first dimension."""
    n = math.prod(shape)
    rows = shape[0] if len(shape) >= 2 else 1
    return rows, (n // rows if rows else 0)


def quantize_int8(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8 of the 2-D `v`: (q, scale) with v ~ q * scale[:, None]."""
    amax = v.abs().amax(dim=1) if v.numel() else torch.zeros(v.shape[0])
    scale = (amax / 127.0).to(torch.float32)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero row codes to zeros
    q = torch.round(v / safe[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.to(torch.float32) * scale.to(torch.float32)[:, None]


def encode_tensor(name: str, delta: torch.Tensor, enc: Encoding) -> dict[str, torch.Tensor]:
    """The stored entries of one float tensor's delta (see the module docstring)."""
    shape = tuple(delta.shape)
    if enc.sparse:
        return {name: sparse_code.encode(delta, enc.fraction, enc.value_bits, enc.chunk(shape))}
    if enc.codec == "int8":
        q, scale = quantize_int8(delta.detach().to(torch.float32).reshape(rows_of(shape)))
        return {name: q.reshape(shape), name + SCALE: scale}
    return {name: delta.detach().to(_STORE[enc.codec])}


def max_update(cfg: Config) -> float:
    """The largest magnitude an entry of a worker's outer gradient can have in run `cfg`
    (round.max_update, or derived): what a contribution's values and an error-feedback buffer are
    checked against, so that a forged or damaged file of finite but huge values (a chunk scale of
    1e30) is refused rather than merged. Derived: an AdamW step moves an entry by at most lr x
    (|m_hat| / sqrt(v_hat) + weight decay); the ratio is bounded by Cauchy-Schwarz over the steps
    (1 at the first step); x 10 for weight decay, a continuing worker's drift and margin."""
    rc, i = cfg.round, cfg.inner
    if rc.max_update > 0:
        return rc.max_update
    steps = i.steps * (1 + math.ceil(rc.overlap_ahead) if rc.overlap != "off" else 1)
    b1, b2, q = i.beta1, i.beta2, i.beta1 * i.beta1 / max(i.beta2, 1e-12)
    ratio, series = 1.0, 0.0
    for t in range(1, min(steps, 10_000) + 1):  # q < 1 (the usual betas) converges long before
        series += q ** (t - 1)
        ratio = max(ratio, (1 - b1) / math.sqrt(max(1 - b2, 1e-12)) * math.sqrt(series)
                    * math.sqrt(1 - b2 ** t) / (1 - b1 ** t))
    bound = 10 * i.lr * steps * ratio
    if uses_feedback(rc):  # the buffer carries what earlier rounds left out, decayed
        bound *= cfg.rounds if rc.error_feedback >= 1 else min(cfg.rounds, 1 / (1 - rc.error_feedback))
    return bound


DRIFT = 10
"""How much farther than max_update a contribution in weights (or a delta against an older base)
may lie from this round's global: a worker that continued from its own weights (round.late_policy
continue) also carries the global's moves since it last adopted one."""


def check_bound(label: str, name: str, values: torch.Tensor, bound: float, what: str = "moves an entry by") -> float:
    """The largest magnitude in `values` (an outer gradient, or an error-feedback buffer);
    CheckpointError when it is past `bound` (max_update)."""
    if not values.numel():
        return 0.0
    lo, hi = torch.aminmax(values.detach().reshape(-1))  # one pass, a few times cheaper than an inf-norm
    peak = max(-float(lo), float(hi))
    if peak > bound:
        raise CheckpointError(f"{label}: tensor {name} {what} {peak:.3g}, more than a round of inner training can "
                              f"({bound:.3g}, round.max_update): the file is forged or damaged, or the run's "
                              "inner steps are far larger than its config says; it is refused (set round.max_update "
                              "to raise the bound if this run's updates are really that large)")
    return peak


Feedback = dict[str, torch.Tensor]
"""Error feedback: per float tensor, fp32, what was not sent yet (a worker's state, like AdamW's)."""


def encode(base: Mapping[str, torch.Tensor], weights: Mapping[str, torch.Tensor], enc: Encoding,
           feedback: Feedback | None = None, decay: float = 0.0, in_place: bool = False
           ) -> tuple[dict[str, torch.Tensor], dict[str, str], Feedback | None]:
    """(tensors, safetensors metadata, new feedback) of a delta contribution: float tensors as coded
    deltas base - weights (computed in fp32), other tensors as the weights have them.

    With `feedback` (error feedback; {} at first), each float tensor codes decay x feedback + delta
    instead, and the new feedback is what that coding left out (the entries not kept and the kept
    ones' rounding): SparseLoCo's error feedback. `feedback` itself is not changed, unless
    `in_place`: then it is the new feedback, each tensor overwritten once it is coded, so that a
    worker holds one buffer of the model's size while it codes, not two."""
    if enc.codec not in CODECS:
        raise ValueError(f"unknown codec {enc.codec!r}; valid: {', '.join(CODECS)}")
    missing = sorted(set(weights) ^ set(base))
    if missing:
        raise CheckpointError(f"cannot code a delta: the weights and their base differ in tensors {missing[:5]}")
    out: dict[str, torch.Tensor] = {}
    left: Feedback = feedback if in_place and feedback is not None else {}
    for name, w in weights.items():
        if w.dtype not in _FLOATS:
            out[name] = w
            continue
        d = base[name].to(torch.float32) - w.to(torch.float32)
        if feedback is not None and name in feedback:
            if feedback[name].numel() != d.numel():
                raise CheckpointError(f"error feedback for tensor {name} has {feedback[name].numel()} entries, the "
                                      f"tensor {d.numel()}: the worker's state file is another model's")
            d = d.add_(feedback[name].reshape(d.shape), alpha=decay)
        entries = encode_tensor(name, d, enc)
        out.update(entries)
        if feedback is not None:
            rest = d - decode_tensor(name, tuple(d.shape), enc, entries.__getitem__)  # an entry may be d itself
            held = left.get(name)
            if held is not None and held.dtype == rest.dtype and held.numel() == rest.numel() and held.is_contiguous():
                held.view(rest.shape).copy_(rest)
            else:
                left[name] = rest
    return out, enc.metadata(), (left if feedback is not None else None)


def stored_specs(ref: Mapping[str, tuple[str, tuple[int, ...]]], enc: Encoding) -> dict[str, tuple[str, tuple[int, ...]]]:
    """What a file coded as `enc` must hold, given the model's tensors {name: (dtype, shape)}:
    {stored name: (safetensors dtype, shape)}; a coded contribution is checked against it."""
    out = {}
    for name, (dtype, shape) in ref.items():
        if dtype not in ("F64", "F32", "F16", "BF16"):
            out[name] = (dtype, shape)
            continue
        if enc.sparse:
            lay = enc.layout(shape)
            out[name] = ("U8", (lay.chunks, lay.row_bytes(enc.value_bits)))
            continue
        out[name] = (DTYPES[_STORE[enc.codec]], shape)
        if enc.codec == "int8":
            out[name + SCALE] = ("F32", (rows_of(shape)[0],))
    return out


def sparse_tensor(name: str, shape: tuple[int, ...], enc: Encoding, get: Callable[[str], torch.Tensor]
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """A sparse delta of tensor `name` (of `shape`) as (flat positions, fp32 values), checked
    (core.topk.sparse), from its stored entries, fetched with `get`."""
    return sparse_code.sparse(name, math.prod(shape), enc.fraction, enc.value_bits, get(name), enc.chunk(shape))


def decode_tensor(name: str, shape: tuple[int, ...], enc: Encoding, get: Callable[[str], torch.Tensor]) -> torch.Tensor:
    """The fp32 delta of tensor `name` (of `shape`) from its stored entries, fetched with `get`."""
    if enc.sparse:
        return sparse_code.dense(math.prod(shape), *sparse_tensor(name, shape, enc, get)).reshape(shape)
    v = get(name)
    if enc.codec == "int8":
        return dequantize_int8(v.reshape(rows_of(shape)[0], -1), get(name + SCALE)).reshape(shape)
    return v.to(torch.float32).reshape(shape)


def outer_gradient(ck: TensorFile, name: str, base: torch.Tensor) -> torch.Tensor:
    """base - weights for tensor `name` of the contribution `ck` (coded or not; relative to `base`,
    the checkpoint it was trained from), in float64 for statistics."""
    enc = encoding_of(ck.metadata, ck.label)
    if enc is None or not base.is_floating_point():
        return base.double() - ck.get(name).double()
    return decode_tensor(name, tuple(base.shape), enc, ck.get).double()


def load_weights(storage: Storage, key: str, label: str = "", depth: int = 0,
                 alloc: Alloc | None = None, on_read: Callable[[str], None] | None = None) -> dict[str, torch.Tensor]:
    """A checkpoint's weights, whole and verified: plain weights as stored; a delta contribution
    decoded as base - delta, with its base (named in its manifest, checked by digest) loaded the
    same way, so a worker may continue from its own coded contribution of an earlier round.
    `alloc` (TensorFile.get) gives the buffers the file's tensors are read into; `on_read(name)` is
    called before each tensor of the file and of its bases is read (merge.reading.guarded's sign of
    progress)."""
    label = label or storage.display(key)
    read_into = alloc if on_read is None else lambda n, shape, dt: on_read(n) or (alloc(n, shape, dt) if alloc else None)
    tensors, meta, manifest = load_checkpoint(storage, key, label, alloc=read_into)
    enc = encoding_of(meta, label)
    if enc is None:
        return tensors
    base_key = manifest.get("base")
    if not base_key or depth > 64:
        raise CheckpointError(f"{label}: a delta contribution whose manifest names no usable base: it cannot be decoded")
    base_m = read_manifest(storage, base_key)
    if base_m is None or base_m["digest"] != enc.base_digest:
        raise CheckpointError(f"{label}: its base {storage.display(base_key)} is gone or was replaced (digest differs): "
                              "the delta cannot be decoded")
    base = load_weights(storage, base_key, depth=depth + 1, on_read=on_read)
    out = {}
    for name, b in base.items():
        if b.dtype in _FLOATS:
            delta = decode_tensor(name, tuple(b.shape), enc, lambda n: entry(tensors, n, label))
            out[name] = (b.to(torch.float32) - delta).to(b.dtype)
        else:
            out[name] = entry(tensors, name, label)
    return out


def entry(tensors: Mapping[str, torch.Tensor], name: str, label: str) -> torch.Tensor:
    """Entry `name` of a delta's stored tensors, which its coding needs; CheckpointError if absent."""
    if name not in tensors:
        raise CheckpointError(f"{label}: has no tensor {name}, which its coding needs: the file is damaged")
    return tensors[name]
