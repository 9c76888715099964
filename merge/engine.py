"""The streaming merge: K inputs (+ base, + optimizer state) -> merged safetensors, tensor by tensor.

How the bytes move (memory does not grow with K, nor with the size of the model):

- Headers are validated before any maths (names, shapes, dtypes; file sizes, so a truncated file
  is refused up front).
- The work is cut into segments: slices of at most `chunk` elements of one tensor, in the output's
  order (whole tensors for methods that are not element-wise, such as `ties`).
- Every input has a reader thread (merge.lanes) that fills 4 reusable buffers with its next
  segments: positional reads straight into the buffer (O_DIRECT for cold large local files:
  merge.directio), digest on the way when the file has a manifest, bf16/f16 widened to float32, a
  cheap finiteness check (one sum; the exact check only when it is not finite). File I/O,
  hashing, numpy and torch all release the GIL, so the K readers, the maths and the writer run in
  parallel.
- The main thread hands each segment's K slices to the registered method (merge.methods) and
  queues the result for the writer thread, which streams it into the output file(s) under a
  temporary name (merge.writer).
- At the end every input's digest is checked against its manifest (every byte has streamed past,
  so this costs nothing more), and only then are the outputs published. Any error on the way
  deletes the temporaries: nothing half-merged is ever visible.

`merge_round` is the merge service's use of it (one DiLoCo/lo-fi round: contributions with
manifests, the outer step with saved optimizer state, bad contributions rejected); for the linear
merge it sums the contributions first (merge.incremental, which also decodes delta contributions)
and streams that one mean here. merge.manual is `orchestrate merge`'s.
"""
from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from core.checkpoint import DTYPES, TORCH_DTYPES, TensorSpec
from core.config import OuterConfig
from core.errors import CheckpointError, ContributionRejected, RunError
from core.failpoints import failpoint
from core.progress import track
from core.storage import Storage
from merge.methods import check_method_args, method_spec
from merge.outer import state_in_specs, state_key, state_out_specs, state_slots
from merge.lanes import Lane, Read, finite, nonfinite
from merge.reader import FLOATS, ITEMSIZE, InputError, Model, open_file_model
from merge.writer import OutputFile, PendingWrite, StreamWriter

log = logging.getLogger(__name__)

DEFAULT_BUFFER_BYTES = 256 << 20
"""Read buffers of all inputs together (the segment size adapts to K); the merge's working set."""
# Elements per segment. At most 4 Mi (16 MiB of float32): results stay under glibc's mmap
# threshold, so their memory is recycled instead of being faulted in afresh for every segment.
_MIN_CHUNK, _MAX_CHUNK = 1 << 18, 1 << 22


class QuorumError(RunError):
    """Too few valid contributions remain; `rejected` says which were refused and why."""

    def __init__(self, message: str, rejected: dict[int, str]) -> None:
        super().__init__(message)
        self.rejected = rejected


@dataclass(frozen=True)
class Contribution:
    worker: int
    key: str
    weight: float


@dataclass
class MergeResult:
    merged: list[int]
    rejected: dict[int, str]
    bytes_read: int
    seconds: float
    outer_grad_norm: float
    manifest: dict[str, Any] = field(default_factory=dict)
    order: list[int] = field(default_factory=list)
    """The order the inputs were summed in (merge/incremental.py), when it matters to the bytes."""
    pending_state: PendingWrite | None = None
    """With `defer_state`: the new outer state, not written yet (PendingWrite.start / wait)."""


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
    depth: int = 4,
    defer_state: bool = False,
) -> MergeStats:
    """Merge `inputs` (headers already checked against each other) into `outputs`, whose specs give
    the tensors' order, dtypes and shapes; publish them (and `state_out`) only if all went well.

    Takes ownership of the models: they are closed on return. An unusable input raises InputError
    naming it (`ident`); the merged result's problems raise CheckpointError.

    `depth`: read-ahead slots per input (merge.lanes says why 4). `defer_state`: `state_out` is not
    written here: its tensors are held in memory and returned as `pending_state`, to be written
    after the outputs are published (the round merge's new global is what the next round waits for).
    """
    with _torch_threads(1):  # the maths are memory-bound: leave the cores to the readers (I/O, digest)
        return _run_merge(inputs, weights, method, outputs, params, base, state_in, state_out, buffer_bytes, depth,
                          defer_state)


_THREADS_LOCK = threading.Lock()
_threads_users = 0
_threads_saved = 0


@contextlib.contextmanager
def _torch_threads(n: int) -> Iterator[None]:
    """torch's intra-op threads set to n while any caller is inside: the setting is process-wide,
    and a round's last fold runs beside the outer step (merge.incremental), so the first caller in
    saves it and the last one out restores it."""
    global _threads_users, _threads_saved
    with _THREADS_LOCK:
        if _threads_users == 0:
            _threads_saved = torch.get_num_threads()
            torch.set_num_threads(n)
        _threads_users += 1
    try:
        yield
    finally:
        with _THREADS_LOCK:
            _threads_users -= 1
            if _threads_users == 0:
                torch.set_num_threads(_threads_saved)


def _run_merge(inputs, weights, method, outputs, params, base, state_in, state_out, buffer_bytes, depth,
               defer_state) -> MergeStats:
    t0 = time.perf_counter()
    spec = method_spec(method)
    params = dict(params or {})
    problems = check_method_args(method, list(weights), params, base is not None)
    if problems:
        raise ValueError("; ".join(problems))
    models = [*inputs, *([base] if base else []), *([state_in] if state_in else [])]
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
                    for m, p in [*zip(inputs, parts), *([(base, base_part)] if base else [])]:
                        if not bool(torch.isfinite(p).all()):
                            raise InputError(m.ident, nonfinite(m.tensors[seg.name][0].label, seg.name))
                    raise CheckpointError(f"merged tensor {seg.name} has NaN or Inf values although every input is "
                                          f"finite: the {method} merge overflowed; check the weights and the scale")
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


# -- one round of a run --------------------------------------------------------------------
def merge_round(
    storage: Storage,
    base_key: str,
    contributions: Sequence[Contribution],
    out_key: str,
    outer: OuterConfig,
    *,
    state_in_key: str | None,
    state_out_key: str | None,
    min_inputs: int = 1,
    method: str = "average",
    metadata: Mapping[str, str] | None = None,
    manifest: Mapping[str, Any] | None = None,
    accumulator: Any = None,
    defer_state: bool = False,
) -> MergeResult:
    """Merge `contributions` into the weights at `base_key`; write `out_key` (and the outer state).

    Rejected contributions are reported in the result, not raised; RunError if fewer than
    `min_inputs` valid ones remain. `average` is summed in the contributions' order, or through
    `accumulator` (a merge.incremental.RunningSum folded while they arrived), which decode delta
    contributions (core/codec.py); the other methods stream every input at once, here.
    `defer_state`: the new outer state is returned unwritten, as the result's `pending_state`
    (the service writes it after the round's record: the next round needs only the new global).
    """
    if method == "average":
        from merge.incremental import merge_summed  # it builds on this module
        return merge_summed(storage, base_key, contributions, out_key, outer, accumulator=accumulator,
                            state_in_key=state_in_key, state_out_key=state_out_key, min_inputs=min_inputs,
                            metadata=metadata, manifest=manifest, defer_state=defer_state)
    t0 = time.perf_counter()
    rejected: dict[int, str] = {}
    live = list(contributions)
    while True:
        if len(live) < min_inputs:
            raise QuorumError(f"only {len(live)} valid contribution(s) for {out_key}, the quorum is {min_inputs}; "
                              f"rejected: {rejected or 'none'}", rejected)
        try:
            stats = _merge_once(storage, base_key, live, out_key, outer, state_in_key, state_out_key,
                                method, metadata, manifest, defer_state)
        except ContributionRejected as exc:
            log.warning("merge: rejected worker %d: %s", exc.worker, exc.reason)
            rejected[exc.worker] = exc.reason
            live = [c for c in live if c.worker != exc.worker]
            continue
        return MergeResult(merged=[c.worker for c in live], rejected=rejected, bytes_read=stats.bytes_read,
                           seconds=time.perf_counter() - t0, outer_grad_norm=stats.grad_sq ** 0.5,
                           manifest=stats.manifests[0], pending_state=stats.pending_state)


def _merge_once(storage, base_key, live, out_key, outer, state_in_key, state_out_key, method, metadata,
                manifest, defer_state=False) -> MergeStats:
    opened: list[Model] = []
    try:
        base = open_file_model(storage, base_key, f"global weights {storage.display(base_key)}", "base",
                               require_manifest=True)
        opened.append(base)
        ref = model_specs(base)
        inputs = []
        for c in live:
            try:
                m = open_file_model(storage, c.key, f"worker {c.worker} ({storage.display(c.key)})", c.worker,
                                    require_manifest=True)
            except CheckpointError as exc:
                raise ContributionRejected(c.worker, str(exc)) from None
            opened.append(m)
            problems = compare_specs(ref, model_specs(m), "the global weights")
            if problems:
                raise ContributionRejected(c.worker, problems[0])
            inputs.append(m)
        state_in = None
        if state_in_key is not None:
            state_in = open_file_model(storage, state_in_key, f"outer optimizer state {storage.display(state_in_key)}",
                                       "state", require_manifest=True)
            opened.append(state_in)
    except BaseException:
        for m in opened:
            m.close()
        raise
    order = [(n, s.dtype, s.shape) for n, s in ref.items()]
    out = OutputFile(storage, out_key, [(n, d, s, math.prod(s) * ITEMSIZE[d]) for n, d, s in order], metadata,
                     dict(manifest or {}))
    state_out = None
    if state_out_key is not None:
        state_out = OutputFile(storage, state_out_key, state_out_specs(order, outer), None, {"optimizer": outer.optimizer})
    try:
        return run_merge(inputs, [c.weight for c in live], "outer", [out], params={"optimizer": outer, "inner": method},
                         base=base, state_in=state_in, state_out=state_out, defer_state=defer_state)
    except InputError as exc:
        if isinstance(exc.ident, int):
            raise ContributionRejected(exc.ident, exc.reason) from None
        raise CheckpointError(exc.reason) from None
