"""How a round's merge reads one contribution: its layout checked against the global weights', then
its values in file order, as pieces the running sum (merge/rounds.py) adds; or its tensors whole,
one at a time, for a robust aggregate (merge/robust.py, `whole_tensors`).

A contribution in the round's space (weights, or a delta coded against this round's base) is read
as it is stored, through the engine's prefetching reader (merge/engine.py) into read buffers kept
from one contribution to the next: a tensor stored alone (plain, or a dense fp32/bf16 delta, whose
decoding is the cast) slice by slice; a sparse delta's (top-k or pruned) chunk rows as
(positions, values), never a dense copy; a dense int8 delta decoded once its values and scales are
in (copied out of the read buffers). One in the other space (a late worker's delta
against an older base) is decoded whole (codec.load_weights, on a thread of its own: merge.engine.guarded)
and converted tensor by tensor.
"""
from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch

from core import codec
from core.checkpoint import DTYPES, FLOATS, TensorFile, TensorSpec
from core.errors import CheckpointError
from core.storage import Storage
from merge.engine import DEPTH, Buffer, Prefetch, Read, guarded, read_whole
from merge.inputs import compare_specs

FOLD_CHUNK = 1 << 22
"""Elements per read of a large tensor stored plain: read buffers of 16 MiB whatever the model (a
coded tensor is read whole: its rows need their scales and indices)."""


@dataclass(frozen=True)
class Piece:
    """Part of one tensor of a contribution, in the round's space."""
    name: str
    values: torch.Tensor
    start: int = 0
    """The flat range of the tensor these values are (dense pieces)."""
    stop: int | None = None
    positions: torch.Tensor | None = None
    """A top-k piece: the distinct flat positions of `values` (core.topk.sparse checks them)."""


class ContributionReader:
    """Reads the contributions of one round, whose global weights have the layout `ref`."""

    def __init__(self, ref: Mapping[str, TensorSpec]) -> None:
        self.ref = ref
        self.buffers = [Buffer() for _ in range(DEPTH)]  # reused by every read: fresh pages cost more than reads

    def check_layout(self, f: TensorFile, enc: codec.Encoding | None, label: str) -> None:
        """The names, shapes and dtypes `f` must store: the global weights', or their coding as `enc`."""
        want = {n: (s.dtype, s.shape) for n, s in self.ref.items()}
        want = codec.stored_specs(want, enc) if enc else want
        _same_layout(want, {n: (s.dtype, s.shape) for n, s in f.specs.items()}, label,
                     "the global weights" if enc is None else f"a {enc.codec} delta of the global weights")

    @contextlib.contextmanager
    def pieces(self, f: TensorFile, enc: codec.Encoding | None, label: str, worker: int) -> Iterator[Iterator[Piece]]:
        """`f`'s values in file order (see the module docstring). A piece's values may lie in a read
        buffer: use them before taking the next."""
        entries = {n: stored_entries(f, n) for n in self.ref}
        owner = {e: n for n, es in entries.items() for e in es}
        plan = []
        for e, sp in f.specs.items():
            numel = math.prod(sp.shape)
            if sp.dtype in FLOATS and numel > FOLD_CHUNK and entries[owner[e]] == [e]:
                plan += [[Read(e, f, e, a, min(a + FOLD_CHUNK, numel), (min(a + FOLD_CHUNK, numel) - a,))]
                         for a in range(0, numel, FOLD_CHUNK)]
            else:
                plan.append([Read(e, f, e, 0, numel, sp.shape)])
        reader = Prefetch(label, worker, plan, buffers=self.buffers)

        def read() -> Iterator[Piece]:
            groups: dict[str, dict[str, torch.Tensor]] = {}
            sparse = enc is not None and enc.sparse
            for (r,) in plan:
                buf, got = reader.take()
                name, t = owner[r.tag], got[r.tag]
                if sparse and self.ref[name].dtype in FLOATS:
                    positions, values = codec.sparse_tensor(name, self.ref[name].shape, enc, {name: t}.__getitem__)
                    yield Piece(name, values, positions=positions)
                elif entries[name] == [r.tag]:
                    yield Piece(name, t, r.start, r.stop)
                else:
                    groups.setdefault(name, {})[r.tag] = t.clone()
                    if len(groups[name]) == len(entries[name]):
                        got_all, shape = groups.pop(name), self.ref[name].shape
                        yield Piece(name, codec.decode_tensor(name, shape, enc, got_all.__getitem__))
                reader.give_back(buf)
        try:
            yield read()
        finally:
            if not reader.close():  # a read still running may yet fill one of them: new ones for the next
                self.buffers = [Buffer() for _ in range(DEPTH)]


def whole_tensors(f: TensorFile, enc: codec.Encoding | None, shapes: Mapping[str, tuple[int, ...]], label: str,
                  worker: int) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, float32 tensor) for `f`'s float tensors `shapes` in that order, whole: plain ones as
    stored (views of a read buffer, valid until the next is taken), a coded delta's decoded
    (core.codec), each read with its scales by merge.engine.read_whole, one at a time (a
    read that stalls fails after merge.engine.STALL_S, naming `worker`)."""
    groups = [stored_entries(f, n) for n in shapes]
    with contextlib.closing(read_whole(f, worker, groups, depth=1)) as read:
        for name, got in zip(shapes, read):
            get = lambda n: codec.entry(got, n, label)  # noqa: E731
            yield name, (get(name).to(torch.float32) if enc is None else codec.decode_tensor(name, shapes[name], enc, get))


def stored_entries(f: TensorFile, name: str) -> list[str]:
    """The entries of `f` that hold tensor `name`: itself, and its coding's scales if any."""
    return [e for e in (name, name + codec.SCALE) if e in f.specs]


def stored_in(space: str | None, enc: codec.Encoding | None, base_digest: str) -> bool:
    """Is a contribution coded as `enc` stored in the round's `space` (`weights`, `delta`; None:
    whichever the first one is), against the round's base? Else it is decoded whole."""
    return (enc is None or enc.base_digest == base_digest) and (space is None or (enc is None) == (space == "weights"))


def in_space(t: torch.Tensor, base: torch.Tensor, space: str | None) -> torch.Tensor:
    """A decoded contribution's tensor `t` (weights) in the round's space: base - t for deltas."""
    return base.to(torch.float32) - t.to(torch.float32) if space == "delta" and t.is_floating_point() else t


def decoded(storage: Storage, key: str, label: str, worker: int,
            ref: Mapping[str, TensorSpec] | None = None) -> dict[str, torch.Tensor]:
    """A contribution in the other space, decoded whole (codec.load_weights) with its base, on a
    thread of its own (a read that stalls fails after merge.engine.STALL_S, naming `worker`): its
    weights, their layout checked against `ref`'s if given."""
    weights = guarded(label, worker, lambda on_read: codec.load_weights(storage, key, label, on_read=on_read))
    if ref is None:
        return weights
    _same_layout({n: (s.dtype, s.shape) for n, s in ref.items()},
                 {n: (DTYPES[t.dtype], tuple(t.shape)) for n, t in weights.items()}, label, "the global weights")
    return weights


def _same_layout(want: Mapping[str, tuple[str, tuple[int, ...]]], got: Mapping[str, tuple[str, tuple[int, ...]]],
                 label: str, what: str) -> None:
    """Refuse a contribution whose tensors' names, dtypes and shapes (`got`) are not `want`'s."""
    problems = compare_specs({n: TensorSpec(n, d, s, 0, 0) for n, (d, s) in want.items()},
                             {n: TensorSpec(n, d, s, 0, 0) for n, (d, s) in got.items()}, what)
    if problems:
        raise CheckpointError(f"{label}: {problems[0]}")
