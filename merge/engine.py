"""The streaming merge: K inputs (+ base, + optimizer state) -> merged safetensors, tensor by tensor.

How the bytes move (memory does not grow with K, nor with the size of the model):

- Headers are validated before any maths (names, shapes, dtypes; file sizes, so a truncated file
  is refused up front).
- The work is cut into segments: slices of at most `chunk` elements of one tensor, in the output's
  order (whole tensors for methods that are not element-wise, such as `ties`).
- Every input has reader threads (merge.lanes) that fill DEFAULT_DEPTH reusable buffers with its next
  segments: positional reads straight into the buffer (a cold large local file streams through
  one reader instead, in 1 MiB pieces hashed as they are read, the kernel's read-ahead keeping
  its reads in flight and its pages dropped from the cache behind: merge.reader,
  merge.directio), digest on the way when the file has a manifest, bf16/f16 widened to float32,
  a cheap finiteness check (one sum; the exact check only when it is not finite). File I/O,
  hashing, numpy and torch all release the GIL, so the K readers, the maths and the writer run in
  parallel (the garbage collector, which would hold the GIL, is paused meanwhile: `merging`).
- The main thread hands each segment's K slices to the registered method (merge.methods) and
  queues the result for the writer thread, which streams it into the output file(s) under a
  temporary name (merge.writer).
- At the end every input's digest is checked against its manifest (every byte has streamed past,
  so this costs nothing more), and only then are the outputs published. Any error on the way
  deletes the temporaries: nothing half-merged is ever visible.

merge.rounds is the merge service's use of it (one DiLoCo/lo-fi round: contributions with
manifests, the outer step with saved optimizer state, bad contributions rejected); for the linear
merge it sums the contributions first (merge.incremental, which also decodes delta contributions)
and streams that one mean here. merge.manual is `orchestrate merge`'s.
"""
from __future__ import annotations

import contextlib
import gc
import logging
import math
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from core.checkpoint import DTYPES, TORCH_DTYPES, TensorSpec
from core.errors import CheckpointError
from core.failpoints import failpoint
from core.progress import track
from merge.methods import check_method_args, method_spec
from merge.outer import state_in_specs, state_key, state_slots
from merge.lanes import Lane, Read, finite, nonfinite
from merge.memory import GatedFile, MemoryFile
from merge.reader import FLOATS, InputError, Model
from merge.writer import OutputFile, PendingWrite, StreamWriter

log = logging.getLogger(__name__)

DEFAULT_BUFFER_BYTES = 512 << 20
"""Read buffers of all inputs together (the segment size adapts to K); the merge's working set.
512 MiB keeps enough bytes in flight for a cold disk (merge.lanes) and the peak RSS of a merge of
1 GiB checkpoints at 0.57-0.85x one checkpoint (K = 2 to 16: docs/benchmarks.md)."""
DEFAULT_DEPTH = 8
"""Read-ahead slots per input (merge.lanes says why this many)."""
# Elements per segment. At most 4 Mi (16 MiB of float32): results stay under glibc's mmap
# threshold, so their memory is recycled instead of being faulted in afresh for every segment.
_MIN_CHUNK, _MAX_CHUNK = 1 << 18, 1 << 22


# -- validation ----------------------------------------------------------------------------
def compare_specs(ref: Mapping[str, TensorSpec], other: Mapping[str, TensorSpec], ref_name: str) -> list[str]:
    """Every reason `other` cannot be merged with `ref` (names, shapes, dtypes); [] if it can."""
    missing = [n for n in ref if n not in other]
    extra = [n for n in other if n not in ref]
    problems = []
    if missing or extra:
        problems.append(f"tensor names differ from {ref_name}: missing {missing[:5]}, unexpected {extra[:5]}"
                        + (f" ({len(missing)} missing, {len(extra)} unexpected in all)" if len(missing) > 5 or len(extra) > 5 else ""))
    for name, spec in ref.items():
        o = other.get(name)
        if o is not None and (o.shape != spec.shape or o.dtype != spec.dtype):
            problems.append(f"tensor {name} is {o.dtype}{list(o.shape)}, {ref_name} has {spec.dtype}{list(spec.shape)}")
    return problems


def model_specs(model: Model) -> dict[str, TensorSpec]:
    return {n: spec for n, (_, spec) in model.tensors.items()}


# -- the plan: segments of the output -----------------------------------------------------
@dataclass(frozen=True)
class _Segment:
    name: str
    start: int
    stop: int
    numel: int  # of the whole tensor
    floating: bool

    @property
    def whole(self) -> bool:
        return self.start == 0 and self.stop == self.numel

    @property
    def last(self) -> bool:
        return self.stop == self.numel


# -- the engine ----------------------------------------------------------------------------
@dataclass
class MergeStats:
    bytes_read: int
    seconds: float
    grad_sq: float
    manifests: list[dict[str, Any]]
    state_manifest: dict[str, Any] | None
    pending_state: PendingWrite | None = None
    """With `defer_state`: the outer state, still to be written (start() it, then wait())."""


def run_merge(
    inputs: Sequence[Model],
    weights: Sequence[float],
    method: str,
    outputs: Sequence[OutputFile],
    *,
    params: Mapping[str, Any] | None = None,
    base: Model | None = None,
    state_in: Model | None = None,
    state_out: OutputFile | None = None,
    buffer_bytes: int = DEFAULT_BUFFER_BYTES,
    depth: int = DEFAULT_DEPTH,
    defer_state: bool = False,
) -> MergeStats:
    """Merge `inputs` (headers already checked against each other) into `outputs`, whose specs give
    the tensors' order, dtypes and shapes; publish them (and `state_out`) only if all went well.

    Takes ownership of the models: they are closed on return. An unusable input raises InputError
    naming it (`ident`); the merged result's problems raise CheckpointError.

    `depth`: read-ahead slots per input (DEFAULT_DEPTH). `defer_state`: `state_out` is not
    written here: its tensors are held in memory and returned as `pending_state`, to be written
    after the outputs are published (the round merge's new global is what the next round waits for).
    `params["in_place"]` (outer methods, every model held in memory): the step overwrites base,
    state and the input instead of copying them; the outputs are then views of base and state.
    """
    with merging():
        return _run_merge(inputs, weights, method, outputs, params, base, state_in, state_out, buffer_bytes, depth,
                          defer_state)


_SETTINGS_LOCK = threading.Lock()
_merges = 0
_saved: tuple[int, bool] = (1, True)


@contextlib.contextmanager
def merging() -> Iterator[None]:
    """Process-wide settings for as long as any merge runs (a round's last fold runs beside the
    outer step: merge.incremental), so the first caller in saves them and the last one out
    restores them:
    - torch's intra-op threads at 1: the maths are memory-bound, the cores are the readers'
      (I/O, digests);
    - Python's cyclic garbage collector paused: a full collection holds the GIL while it walks
      every object (torch's ~170 000: 74 ms here) and every reader thread stalls behind it; it came
      once per K = 8 merge, just as the readers started. A merge makes no reference cycles of
      its own, so nothing piles up meanwhile (tests/test_merge_manual.py)."""
    global _merges, _saved
    with _SETTINGS_LOCK:
        if _merges == 0:
            _saved = torch.get_num_threads(), gc.isenabled()
            torch.set_num_threads(1)
            gc.disable()
        _merges += 1
    try:
        yield
    finally:
        with _SETTINGS_LOCK:
            _merges -= 1
            if _merges == 0:
                torch.set_num_threads(_saved[0])
                if _saved[1]:
                    gc.enable()


def _run_merge(inputs, weights, method, outputs, params, base, state_in, state_out, buffer_bytes, depth,
               defer_state) -> MergeStats:
    t0 = time.perf_counter()
    spec = method_spec(method)
    params = dict(params or {})
    problems = check_method_args(method, list(weights), params, base is not None)
    models = [*inputs, *([base] if base else []), *([state_in] if state_in else [])]
    if params.get("in_place") and not all(isinstance(f, (MemoryFile, GatedFile)) for m in models for f in m.files):
        # a file's payloads are views of read slots that are reused: a result written there would
        # be overwritten before the writer has it
        problems.append("in_place needs every input held in memory (merge.memory)")
    if problems:
        for m in models:  # they are ours (see run_merge)
            m.close()
        raise ValueError("; ".join(problems))
    lanes: list[Lane] = []
    writers: list[StreamWriter] = []
    try:
        order = [(name, dtype, shape) for out in outputs for name, dtype, shape, _ in out.specs]
        n_lanes = len(models)
        # slices of at most `chunk` elements: n_lanes * depth float32 slices fill the buffer budget
        chunk = max(_MIN_CHUNK, min(_MAX_CHUNK, buffer_bytes // max(1, n_lanes * depth * 4)))
        segments: list[_Segment] = []
        for name, dtype, shape in order:
            numel = math.prod(shape)
            floating = dtype in FLOATS
            step = chunk if spec.elementwise and floating else max(numel, 1)
            segments += [_Segment(name, s, min(s + step, numel), numel, floating) for s in range(0, max(numel, 1), step)]

        slots = state_slots(params["optimizer"]) if spec.stateful else []
        state_specs = state_in_specs(state_in, order, slots) if state_in else {}

        def model_plan(m: Model) -> list[list[Read]]:
            plan = []
            for seg in segments:
                f, sp = m.tensors[seg.name]
                shape = sp.shape if seg.whole else (seg.stop - seg.start,)
                plan.append([Read(None, f, sp, seg.start, seg.stop, shape)])
            return plan

        def state_plan(m: Model) -> list[list[Read]]:
            plan = []
            for seg in segments:
                reads = []
                for slot, full in state_specs.get(seg.name, []):
                    f, sp = m.tensors[state_key(seg.name, slot)]
                    if full:
                        shape = sp.shape if seg.whole else (seg.stop - seg.start,)
                        reads.append(Read(slot, f, sp, seg.start, seg.stop, shape))
                    else:
                        reads.append(Read(slot, f, sp, 0, 1, ()))
                plan.append(reads)
            return plan

        writers.append(StreamWriter(list(outputs)))
        defer = defer_state and state_out is not None
        if state_out is not None:  # deferred: held whole in the queue, written by PendingWrite
            writers.append(StreamWriter([state_out], depth=0, start=False) if defer else StreamWriter([state_out]))
        # Methods that propagate NaN/Inf (sums) get the cheap check on their result only; the
        # inputs are then checked one by one only to name the culprit. The state is always checked.
        inner = params.get("inner", "average") if spec.stateful else method
        check_each = not (spec.propagates_nonfinite and method_spec(inner).propagates_nonfinite)
        for i, m in enumerate(inputs):
            lanes.append(Lane(m.label, m.ident, model_plan(m), depth, check_each))
        base_lane = Lane(base.label, base.ident, model_plan(base), depth, check_each) if base else None
        state_lane = Lane(state_in.label, state_in.ident, state_plan(state_in), depth) if state_in else None
        lanes += [lane for lane in (base_lane, state_lane) if lane is not None]

        stats: dict[str, float] = {}
        dtypes = {name: TORCH_DTYPES[dtype] for name, dtype, _ in order}
        shapes = {name: shape for name, _, shape in order}
        pending: dict[str, torch.Tensor] = {}  # state slots of the current tensor, when they cannot stream
        stream_state = len(slots) == 1 and slots[0][1]
        label = f"merge into {outputs[0].storage.display(outputs[0].key)}"  # progress: core/progress.py
        for seg in track(segments, label, unit="values", size=lambda g: g.stop - g.start):
            taken = [lane.take() for lane in lanes]
            parts = [p[None] for _, p in taken[: len(inputs)]]
            base_part = taken[len(inputs)][1][None] if base_lane else None
            state = dict(taken[-1][1]) if state_lane else {}
            if seg.floating:
                kwargs: dict[str, Any] = dict(params)
                if spec.needs_base:
                    kwargs["base"] = base_part
                if spec.stateful:
                    kwargs.update(state=state, stats=stats)
                result = spec.fn(parts, list(weights), **kwargs)
                if not finite(result):
                    _name_nonfinite(inputs, parts, base, base_part, seg.name, method, bool(params.get("in_place")))
                out_t = result if dtypes[seg.name] == torch.float32 else result.to(dtypes[seg.name])
            else:
                ref, ref_label = (base_part, base.label) if base_part is not None else (parts[0], inputs[0].label)
                for m, p in zip(inputs, parts):
                    if not torch.equal(p, ref):
                        raise InputError(m.ident, f"{m.label}: tensor {seg.name} is {DTYPES[p.dtype]} (not floating point) "
                                                  f"and differs from {ref_label}'s: such tensors are not merged, they must "
                                                  "be identical in every input")
                out_t = ref.clone()
            for lane, (slot, _) in zip(lanes, taken):
                lane.free.put(slot)
            writers[0].put(seg.name, out_t)
            failpoint("merge.while_reading")  # crash tests: half the inputs read, temporaries on disk
            if state_out is not None and seg.floating:
                _put_state(writers[1], seg, state, slots, shapes[seg.name], pending, stream_state)
        for w in writers[:1] if defer else writers:
            w.finish()
        for m in models:  # every byte has streamed past: compare the hashes before publishing anything
            try:
                m.verify()
            except InputError:
                raise
            except CheckpointError as exc:
                raise InputError(m.ident, str(exc)) from None
        manifests = writers[0].commit()
        failpoint("merge.after_global")  # crash tests: new global published, outer state not yet
        pending = PendingWrite(writers.pop()) if defer else None
        state_manifest = writers[1].commit()[0] if len(writers) > 1 else None
        return MergeStats(sum(m.bytes for m in inputs), time.perf_counter() - t0, stats.get("grad_sq", 0.0),
                          manifests, state_manifest, pending)
    except BaseException:
        for w in writers:
            w.abort()
        raise
    finally:
        for lane in lanes:
            lane.close()
        for m in models:
            m.close()


def _name_nonfinite(inputs: Sequence[Model], parts: list[torch.Tensor], base: Model | None,
                    base_part: torch.Tensor | None, name: str, method: str, in_place: bool) -> None:
    """Raise for a merged tensor with NaN or Inf values: InputError naming the input that has
    some, else CheckpointError (the merge overflowed). An in-place step has overwritten its
    inputs by then: the round merge checked them as they were read (merge.incremental)."""
    if not in_place:
        for m, p in [*zip(inputs, parts), *([(base, base_part)] if base is not None else [])]:
            if not bool(torch.isfinite(p).all()):
                raise InputError(m.ident, nonfinite(m.tensors[name][0].label, name))
    raise CheckpointError(f"merged tensor {name} has NaN or Inf values although every input is finite: the "
                          f"{method} merge overflowed; check the weights and the scale (for outer: the outer learning rate)")


def _put_state(writer: StreamWriter, seg: _Segment, state: dict[str, torch.Tensor], slots: list[tuple[str, bool]],
               shape: tuple[int, ...], pending: dict[str, torch.Tensor], stream: bool) -> None:
    """Queue the new optimizer state of a segment. One full-size slot (momentum) streams as it
    comes; otherwise the slots of one tensor are gathered, then written slot after slot."""
    if stream:
        slot = slots[0][0]
        writer.put(state_key(seg.name, slot), state[slot].reshape(-1))
        return
    for slot, full in slots:
        new = state[slot].detach()
        if full:
            buf = pending.setdefault(slot, torch.empty(seg.numel, dtype=torch.float32))
            buf[seg.start: seg.stop] = new.reshape(-1)
        else:
            pending[slot] = new.to(torch.float32).reshape(())
    if seg.last:
        for slot, full in slots:
            t = pending.pop(slot)
            writer.put(state_key(seg.name, slot), t.reshape(shape) if full else t)
