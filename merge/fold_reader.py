"""Reading one contribution for the round's running sum (merge.incremental), apart from the sum.

The file is read in file order in a merge.lanes lane (reads in flight on a local file, the digest
fed in order on the way, into the sum's own reusable slots). A large tensor stored plain (weights,
fp32/bf16 deltas) comes slice by slice, so that each slice can be added, and handed to the outer
step beside the round's last fold, as soon as it is read; a coded tensor (core/codec.py: values,
then its indices and scales) comes whole once all its entries are in: its rows need them all.
"""
from __future__ import annotations

import math
from collections.abc import Iterator, Mapping

import torch

from core import codec
from core.checkpoint import TensorSpec
from merge.lanes import Lane, Read, Slot
from merge.reader import FLOATS, TensorFile

FOLD_SLOTS = 4
"""Read buffers of a fold: two being read, the rest with the maths (a coded tensor's entries are
held until its last one is in)."""
FOLD_READERS = 2
"""Reads in flight in a fold of a contribution read with positional reads (merge.lanes: one in the
page cache already, or O_DIRECT when asked); 4 measured no faster. A cold one streams instead
(merge.reader.TensorFile.streams: one reader, the kernel's read-ahead keeps its reads in flight,
its pages dropped from the cache behind): a 242 MiB one alone was folded in 0.14-0.17 s, as with
two readers (0.16), 0.23 s with O_DIRECT (reading through the cache without dropping had gained
nothing beside the outer step and cost 0.18 CPU-s more)."""
FOLD_CHUNK = 1 << 22
"""Elements per read of a large tensor stored plain (weights, fp32/bf16 deltas): the slots stay at
16 MiB whatever the model (a coded tensor is read whole: its rows need their scales and indices),
and the outer step beside the last fold takes the mean in these slices as soon as each is final,
the engine's own slice size (merge.engine._MAX_CHUNK)."""


def _plan(f: TensorFile, ref: Mapping[str, TensorSpec]) -> tuple[list[list[Read]], dict[str, list[str]]]:
    """The reads of `f` in file order, and each tensor's stored entries."""
    groups = {n: [n] + ([n + codec.INDEX] if n + codec.INDEX in f.specs else [])
              + ([n + codec.SCALE] if n + codec.SCALE in f.specs else []) for n in ref}
    plan = []
    for e, sp in f.specs.items():
        numel = math.prod(sp.shape)
        # alone (no scales, no indices) and floating point: decoding is the cast, so slices add up as the whole
        sliced = groups.get(e) == [e] and sp.dtype in FLOATS and ref[e].dtype in FLOATS and numel > FOLD_CHUNK
        plan += [[Read(e, f, sp, a, min(a + FOLD_CHUNK, numel), (min(a + FOLD_CHUNK, numel) - a,))]
                 for a in range(0, numel, FOLD_CHUNK)] if sliced else [[Read(e, f, sp, 0, numel, sp.shape)]]
    return plan, groups


def read_contribution(f: TensorFile, ref: Mapping[str, TensorSpec], label: str, ident: int,
                      slots: list[Slot]) -> Iterator[tuple[str, int, int | None, dict[str, torch.Tensor]]]:
    """Yield (tensor, start, stop, entries) in file order: elements [start, stop) of a plain tensor
    (`entries` holds that slice under the tensor's name), or a whole tensor with stop None
    (`entries`: its stored entries by name). The payloads are views of `slots`, the caller's to
    overwrite, valid until the next item is asked for. At the end the file's digest is checked
    (CheckpointError if it does not match). Close the iterator if you stop early (its lane's
    threads stop then)."""
    plan, groups = _plan(f, ref)
    owner = {e: n for n, es in groups.items() for e in es}
    lane = Lane(label, ident, plan, FOLD_SLOTS, check=False, slots=slots, readers=FOLD_READERS)
    pending: dict[str, dict[str, tuple[Slot, torch.Tensor]]] = {}
    try:
        for (read,) in plan:
            slot, got = lane.take()
            name, t = owner[read.tag], got[read.tag]
            if read.shape != read.spec.shape:  # a slice
                yield name, read.start, read.stop, {name: t}
                lane.free.put(slot)
                continue
            have = pending.setdefault(name, {})
            have[read.tag] = (slot, t)
            if len(have) == len(groups[name]):
                done = pending.pop(name)
                yield name, 0, None, {e: t for e, (_, t) in done.items()}
                for sl, _ in done.values():
                    lane.free.put(sl)
        f.verify()
    finally:
        lane.close()
