"""A checkpoint written as one file per rank: a sharded (FSDP) worker's state snapshot and in-flight
checkpoint, which each rank writes in parallel from its own shard (worker/sharded.py).

At key `.../state_00007.safetensors` an R-rank set is R ordinary checkpoints
`state_00007-rank{i}of{R}.safetensors` (each with its manifest, digest and header, through the one
writer) and, written last by rank 0 once every rank's file is whole, the set's manifest
`state_00007.json`: the commit, naming each rank's file and its digest. A rank's file holds its
rows of every sharded tensor (dim 0, torch.chunk's split, as FSDP2 cuts them; the manifest's `rows`
says which: [start, stop, total]) and whole copies of small unsharded ones (AdamW's step counts, the
error-feedback buffer on rank 0).

`read_checkpoint` is the one reader of both kinds, a plain checkpoint or a set: a caller asks for
each tensor whole, for a range of its rows (a job of another rank count: its own chunk), or not at
all, and only the files that hold those rows are read and verified. A set is checked whole before
any tensor is read: a missing rank file, a file replaced since the set was committed, rows that do
not tile a tensor, shapes or dtypes that disagree are each a CheckpointError naming the file.
"""
from __future__ import annotations

import contextlib
import json
import posixpath
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from core.checkpoint import TensorFile, new_hasher
from core.checkpoint_writer import publish_manifest, write_checkpoint
from core.errors import CheckpointError
from core.layout import SAFETENSORS, manifest_key
from core.manifest import HASH, read_manifest
from core.storage import Storage

MAX_RANKS = 4096
Want = Callable[[str, tuple[int, ...]], "bool | tuple[int, int]"]
"""(tensor name, its whole shape) -> True (the whole tensor), False (not wanted) or (start, stop): rows."""


def chunk(total: int, rank: int, ranks: int) -> tuple[int, int]:
    """Rank `rank`'s rows [start, stop) of `total`, as torch.chunk (and so FSDP2's Shard(0)) splits them."""
    size = -(-total // ranks) if total else 0
    start = min(rank * size, total)
    return start, min(start + size, total)


def shard_key(key: str, rank: int, ranks: int) -> str:
    return f"{key[:-len(SAFETENSORS)]}-rank{rank}of{ranks}{SAFETENSORS}"


def checkpoint_files(storage: Storage, key: str) -> list[str]:
    """Every file of the checkpoint at `key`, its manifest first (a reader never sees the commit
    without the data): the plain file, or every rank file of a set and their manifests."""
    folder, name = posixpath.split(key)
    stem = re.escape(name[:-len(SAFETENSORS)])
    ranked = re.compile(stem + r"-rank\d+of\d+(\.json|" + re.escape(SAFETENSORS) + ")")
    shards = sorted((n for n in storage.list(folder) if ranked.fullmatch(n)), key=lambda n: not n.endswith(".json"))
    return [manifest_key(key), key] + [posixpath.join(folder, n) for n in shards]


def remove_checkpoint(storage: Storage, key: str) -> None:
    for k in checkpoint_files(storage, key):
        storage.remove(k)


def write_shard(storage: Storage, key: str, rank: int, ranks: int, tensors: Mapping[str, torch.Tensor],
                rows: Mapping[str, tuple[int, int, int]], manifest: Mapping[str, Any]) -> dict[str, Any]:
    """This rank's file of the set at `key`: `tensors`, of which those in `rows` are rows
    [start, stop) of a tensor of `total` rows. Returns its manifest (the set's commit needs it)."""
    return write_checkpoint(storage, shard_key(key, rank, ranks), tensors,
                            manifest={**manifest, "rank": rank, "ranks": ranks, "rows": {n: list(v) for n, v in rows.items()}})


def commit_shards(storage: Storage, key: str, entries: list[Mapping[str, Any]], manifest: Mapping[str, Any]) -> dict[str, Any]:
    """The set's manifest, once every rank's file is written (`entries`: their manifests, by rank)."""
    shards = [{"file": e["file"], "digest": e["digest"]} for e in entries]
    digest = new_hasher()
    digest.update(json.dumps(shards, sort_keys=True).encode())
    return publish_manifest(storage, key, {**manifest, "ranks": len(shards), "shards": shards, "hash": HASH,
                                           "digest": digest.hexdigest(), "bytes": sum(e["bytes"] for e in entries)})


@dataclass
class _Tensor:
    """Where one tensor's rows are: (file, start, stop) pieces in order, or whole copies."""

    dtype: str
    shape: tuple[int, ...]
    pieces: list[tuple[TensorFile, int, int]] = field(default_factory=list)
    copies: list[TensorFile] = field(default_factory=list)


def read_checkpoint(storage: Storage, key: str, label: str = "", want: Want | None = None,
                    prefer: int = 0, manifest: Mapping[str, Any] | None = None) -> dict[str, torch.Tensor]:
    """The tensors of the checkpoint at `key` (plain or a set of rank files) that `want` asks for
    (default: all, whole), each file read verified against its manifest's digest. `prefer`: the
    rank whose file a whole copy is read from when several hold one (a rank reads its own).
    `manifest`: its manifest, when the caller has read it already (read_manifest's, checked)."""
    label = label or storage.display(key)
    m = manifest if manifest is not None else read_manifest(storage, key, label)
    if m is None:
        raise CheckpointError(f"{label}: no manifest, so the checkpoint is incomplete or absent")
    with contextlib.ExitStack() as files:
        tensors = _layout(storage, key, m, label, files)
        out, touched = {}, {}
        for name, t in tensors.items():
            ask = True if want is None else want(name, t.shape)
            if ask is False:
                continue
            if t.copies:
                f = t.copies[prefer] if prefer < len(t.copies) else t.copies[0]
                out[name], touched[id(f)] = f.read(name), f
                continue
            start, stop = (0, t.shape[0]) if ask is True else ask
            if not 0 <= start <= stop <= t.shape[0]:
                raise CheckpointError(f"{label}: rows {start}:{stop} of tensor {name} asked for; it has {t.shape[0]}")
            out[name] = _rows(name, t, start, stop, touched)
        for f in touched.values():
            f.verify()
        return out


def _rows(name: str, t: _Tensor, start: int, stop: int, touched: dict[int, TensorFile]) -> torch.Tensor:
    """Rows [start, stop) of tensor `name`, from the pieces that hold them."""
    row = 1
    for d in t.shape[1:]:
        row *= d
    parts = []
    for f, a, b in t.pieces:
        lo, hi = max(a, start), min(b, stop)
        if lo < hi:
            parts.append(f.read(name, (lo - a) * row, (hi - a) * row).reshape(hi - lo, *t.shape[1:]))
            touched[id(f)] = f
    if not parts:
        return torch.empty((0, *t.shape[1:]), dtype=t.pieces[0][0].spec(name).torch_dtype)
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def _layout(storage: Storage, key: str, m: Mapping[str, Any], label: str, files: contextlib.ExitStack) -> dict[str, _Tensor]:
    """Every tensor's pieces, once the set is checked whole (see the module docstring)."""
    if "shards" not in m:
        f = files.enter_context(TensorFile(storage, key, m, label))
        return {n: _Tensor(s.dtype, s.shape, [(f, 0, s.shape[0])]) if s.shape else _Tensor(s.dtype, s.shape, copies=[f])
                for n, s in f.specs.items()}
    shards, ranks = m.get("shards"), m.get("ranks")
    if not (type(ranks) is int and 1 <= ranks <= MAX_RANKS and isinstance(shards, list) and len(shards) == ranks
            and all(isinstance(s, dict) for s in shards)):
        raise CheckpointError(f"{label}: its manifest's ranks {str(ranks)[:20]} and its list of {len(shards) if isinstance(shards, list) else 'no'} rank files disagree; the set "
                              "is damaged: delete it and its rank files")
    out: dict[str, _Tensor] = {}
    for i, s in enumerate(shards):
        skey = shard_key(key, i, ranks)
        slabel = f"{label}, rank {i} of {ranks} ({storage.display(skey)})"
        if s.get("file") != posixpath.basename(skey):
            raise CheckpointError(f"{label}: rank {i}'s file is listed as {str(s.get('file'))[:80]!r}, not "
                                  f"{posixpath.basename(skey)!r}: the set is damaged or forged")
        sm = read_manifest(storage, skey, slabel)
        if sm is None:
            raise CheckpointError(f"{slabel}: missing; the set needs every rank's file")
        if sm["digest"] != s.get("digest"):
            raise CheckpointError(f"{slabel}: its digest differs from the set's record: it was replaced after "
                                  "the set was written")
        if stray := [f"{k} {sm.get(k)!r}, the set's {m[k]!r}" for k in ("round", "worker") if k in m and sm.get(k) != m[k]]:
            raise CheckpointError(f"{slabel}: its manifest names {' and '.join(stray)}: a file of another checkpoint "
                                  "was put in the set; the set is damaged or forged")
        rows = sm.get("rows")
        if sm.get("rank") != i or sm.get("ranks") != ranks or not isinstance(rows, dict):
            raise CheckpointError(f"{slabel}: its manifest says rank {sm.get('rank')!r} of {sm.get('ranks')!r}, or "
                                  "lacks its rows: the set is damaged")
        _add_shard(out, files.enter_context(TensorFile(storage, skey, sm, slabel)), rows, slabel)
    for name, t in out.items():
        if t.pieces and (len(t.pieces) != ranks or t.pieces[-1][2] != t.shape[0]):
            raise CheckpointError(f"{label}: the rank files' rows of tensor {name} do not tile its {t.shape[0]} rows "
                                  f"({[(a, b) for _, a, b in t.pieces]}): a rank file is missing it or damaged")
    return out


def _add_shard(out: dict[str, _Tensor], f: TensorFile, rows: Mapping[str, Any], label: str) -> None:
    """Rank file `f`'s tensors into `out`, each piece checked against what the ranks before it gave."""
    for name, spec in f.specs.items():
        r = rows.get(name)
        if r is None:  # a whole copy
            t = out.setdefault(name, _Tensor(spec.dtype, spec.shape))
            if t.pieces or (t.dtype, t.shape) != (spec.dtype, spec.shape):
                raise CheckpointError(f"{label}: tensor {name} {spec.dtype} {list(spec.shape)} disagrees with the "
                                      "other rank files' copy or rows of it")
            t.copies.append(f)
            continue
        if not (isinstance(r, list) and len(r) == 3 and all(type(v) is int and v >= 0 for v in r)
                and r[0] <= r[1] <= r[2] and spec.shape and spec.shape[0] == r[1] - r[0]):
            raise CheckpointError(f"{label}: tensor {name}'s rows {str(r)[:60]} do not describe its "
                                  f"{list(spec.shape)} in the file")
        shape = (r[2], *spec.shape[1:])
        t = out.setdefault(name, _Tensor(spec.dtype, shape))
        start = t.pieces[-1][2] if t.pieces else 0
        if t.copies or (t.dtype, t.shape) != (spec.dtype, shape) or r[0] != start:
            raise CheckpointError(f"{label}: tensor {name}'s rows {r[0]}:{r[1]} of {list(shape)} ({spec.dtype}) do not "
                                  f"follow the rank files before it (rows up to {start} of {list(t.shape)}, {t.dtype})")
        t.pieces.append((f, r[0], r[1]))
