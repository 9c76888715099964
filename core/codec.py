"""Contributions on the wire: full weights, or the outer gradient `delta = base - weights`, compressed.

A worker publishes either its weights (`round.contribution: weights`) or its delta from the base it
trained from (`delta`), coded as `round.codec` after keeping the top `round.prune_keep` fraction of
each row by magnitude (the DiLoCo paper's Table 6 prunes outer gradients the same way, with little
loss up to about half pruned). The file is plain safetensors; for a float tensor `name`:

    fp32 / bf16, dense    name            F32/BF16, the tensor's shape
    int8, dense           name            I8, the tensor's shape; name::scale F32 [rows]
    any, pruned           name            [rows, k] kept values (I8/F32/BF16); name::index I16/I32 [rows, k]
                          (+ name::scale for int8)

Rows are the first dimension (a 1-D or 0-D tensor is one row); int8 is symmetric per row:
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

from core.checkpoint import DTYPES, Alloc, TensorFile, load_checkpoint, read_manifest
from core.errors import CheckpointError
from core.storage import Storage

META = "islands.contribution"
SCALE = "::scale"
INDEX = "::index"
CODECS = ("fp32", "bf16", "int8")
_STORE = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.int8}
_FLOATS = (torch.float64, torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class Encoding:
    codec: str
    """fp32, bf16 or int8: how the delta's values are stored."""
    keep: float
    """Fraction of each row's entries kept (by magnitude); 1.0 stores the delta dense."""
    base_digest: str
    """digest of the checkpoint the delta is relative to (weights = base - delta)."""

    def metadata(self) -> dict[str, str]:
        return {META: json.dumps({"format": "delta", "codec": self.codec, "keep": self.keep,
                                  "base_digest": self.base_digest}, sort_keys=True)}


def encoding_of(metadata: Mapping[str, str], label: str) -> Encoding | None:
    """How a checkpoint is coded (from its safetensors metadata); None for plain weights."""
    raw = metadata.get(META)
    if raw is None:
        return None
    try:
        d = json.loads(raw)
        enc = Encoding(str(d["codec"]), float(d["keep"]), str(d["base_digest"]))
    except (ValueError, KeyError, TypeError):
        raise CheckpointError(f"{label}: metadata {META} is malformed ({raw[:80]!r}): the file is damaged") from None
    if d.get("format") != "delta" or enc.codec not in CODECS or not 0 < enc.keep <= 1:
        raise CheckpointError(f"{label}: unknown contribution coding {raw[:120]!r}; this version reads delta "
                              f"coded as {', '.join(CODECS)} with 0 < keep <= 1")
    return enc


def rows_of(shape: tuple[int, ...]) -> tuple[int, int]:
    """(rows, columns) of the 2-D view a tensor is coded in: rows are its first dimension."""
    n = math.prod(shape)
    rows = shape[0] if len(shape) >= 2 else 1
    return rows, (n // rows if rows else 0)


def kept_per_row(cols: int, keep: float) -> int:
    """Entries kept in a row of `cols`: ceil(keep * cols), at least 1 (all of them at keep = 1)."""
    return cols if keep >= 1 else min(cols, max(1, math.ceil(keep * cols)))


def prune_rows(v: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k entries of largest magnitude of each row of the 2-D `v`: (values, column indices),
    indices ascending (so the same delta always codes to the same bytes)."""
    idx = v.abs().topk(k, dim=1, sorted=False).indices.sort(dim=1).values
    return v.gather(1, idx), idx


def quantize_int8(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8 of the 2-D `v`: (q, scale) with v ~ q * scale[:, None]."""
    amax = v.abs().amax(dim=1) if v.numel() else torch.zeros(v.shape[0])
    scale = (amax / 127.0).to(torch.float32)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero row codes to zeros
    q = torch.round(v / safe[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.to(torch.float32) * scale.to(torch.float32)[:, None]


def encode_tensor(name: str, delta: torch.Tensor, codec: str, keep: float) -> dict[str, torch.Tensor]:
    """The stored entries of one float tensor's delta (see the module docstring)."""
    shape = tuple(delta.shape)
    rows, cols = rows_of(shape)
    v = delta.detach().to(torch.float32).reshape(rows, cols)
    k = kept_per_row(cols, keep)
    out: dict[str, torch.Tensor] = {}
    if k < cols:
        v, idx = prune_rows(v, k)
        out[name + INDEX] = idx.to(torch.int16 if cols <= 1 << 15 else torch.int32)
    if codec == "int8":
        q, scale = quantize_int8(v)
        out[name], out[name + SCALE] = q, scale
    else:
        out[name] = v.to(_STORE[codec])
    if k == cols:
        out[name] = out[name].reshape(shape)
    return out


def encode(base: Mapping[str, torch.Tensor], weights: Mapping[str, torch.Tensor], codec: str, keep: float,
           base_digest: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(tensors, safetensors metadata) of a delta contribution: float tensors as coded deltas
    base - weights (computed in fp32), other tensors as the weights have them."""
    if codec not in CODECS:
        raise ValueError(f"unknown codec {codec!r}; valid: {', '.join(CODECS)}")
    missing = sorted(set(weights) ^ set(base))
    if missing:
        raise CheckpointError(f"cannot code a delta: the weights and their base differ in tensors {missing[:5]}")
    out: dict[str, torch.Tensor] = {}
    for name, w in weights.items():
        if w.dtype in _FLOATS:
            out.update(encode_tensor(name, base[name].to(torch.float32) - w.to(torch.float32), codec, keep))
        else:
            out[name] = w
    return out, Encoding(codec, keep, base_digest).metadata()


def stored_specs(ref: Mapping[str, tuple[str, tuple[int, ...]]], enc: Encoding) -> dict[str, tuple[str, tuple[int, ...]]]:
    """What a file coded as `enc` must hold, given the model's tensors {name: (dtype, shape)}:
    {stored name: (safetensors dtype, shape)}; a coded contribution is checked against it."""
    out = {}
    for name, (dtype, shape) in ref.items():
        if dtype not in ("F64", "F32", "F16", "BF16"):
            out[name] = (dtype, shape)
            continue
        rows, cols = rows_of(shape)
        k = kept_per_row(cols, enc.keep)
        out[name] = (DTYPES[_STORE[enc.codec]], shape if k == cols else (rows, k))
        if k < cols:
            out[name + INDEX] = ("I16" if cols <= 1 << 15 else "I32", (rows, k))
        if enc.codec == "int8":
            out[name + SCALE] = ("F32", (rows,))
    return out


def decode_tensor(name: str, shape: tuple[int, ...], enc: Encoding, get: Callable[[str], torch.Tensor]) -> torch.Tensor:
    """The fp32 delta of tensor `name` (of `shape`) from its stored entries, fetched with `get`."""
    rows, cols = rows_of(shape)
    v = get(name)
    v = dequantize_int8(v.reshape(rows, -1), get(name + SCALE)) if enc.codec == "int8" else v.to(torch.float32)
    if kept_per_row(cols, enc.keep) < cols:
        dense = torch.zeros(rows, cols, dtype=torch.float32)
        idx = get(name + INDEX).to(torch.int64)
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= cols):
            raise CheckpointError(f"tensor {name}: pruned-entry index out of range [0, {cols}): the file is damaged")
        v = dense.scatter_(1, idx, v.reshape(rows, -1))
    return v.reshape(shape)


def outer_gradient(ck: TensorFile, name: str, base: torch.Tensor) -> torch.Tensor:
    """base - weights for tensor `name` of the contribution `ck` (coded or not; relative to `base`,
    the checkpoint it was trained from), in float64 for statistics."""
    enc = encoding_of(ck.metadata, ck.label)
    if enc is None or not base.is_floating_point():
        return base.double() - ck.get(name).double()
    return decode_tensor(name, tuple(base.shape), enc, ck.get).double()


def load_weights(storage: Storage, key: str, label: str = "", depth: int = 0,
                 alloc: Alloc | None = None) -> dict[str, torch.Tensor]:
    """A checkpoint's weights, whole and verified: plain weights as stored; a delta contribution
    decoded as base - delta, with its base (named in its manifest, checked by digest) loaded the
    same way, so a worker may continue from its own coded contribution of an earlier round.
    `alloc` (TensorFile.get) gives the buffers the file's tensors are read into."""
    label = label or storage.display(key)
    tensors, meta, manifest = load_checkpoint(storage, key, label, alloc=alloc)
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
    base = load_weights(storage, base_key, depth=depth + 1)
    out = {}
    for name, b in base.items():
        if b.dtype in _FLOATS:
            delta = decode_tensor(name, tuple(b.shape), enc, lambda n: _entry(tensors, n, label))
            out[name] = (b.to(torch.float32) - delta).to(b.dtype)
        else:
            out[name] = _entry(tensors, name, label)
    return out


def _entry(tensors: Mapping[str, torch.Tensor], name: str, label: str) -> torch.Tensor:
    if name not in tensors:
        raise CheckpointError(f"{label}: has no tensor {name}, which its coding needs: the file is damaged")
    return tensors[name]
