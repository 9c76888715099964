"""The streaming merge: K inputs (+ base, + optimizer state) -> merged safetensors, slice by slice.

How the bytes move (memory does not grow with K, nor with the size of the model):

- Every file's header was checked when it was opened (core.checkpoint), the inputs against each
  other by the caller (merge.inputs.compare_specs).
- The output is cut into segments: slices of at most `chunk` elements of one tensor, in the
  output's order. Every method is element-wise over a segment; one that needs a whole tensor of
  each input first (TIES's trim threshold) reads it beforehand, one input at a time (`prepare`).
- Every input has a reader thread (merge.reading.Prefetch) reading its next segments ahead, and
  the writer thread (core.checkpoint_writer) writes the last ones: readers, maths and writer run
  side by side.
- At the end every input's digest is checked against its manifest (every byte has streamed past),
  and only then are the outputs published. Any error deletes them: nothing half-merged is seen.

merge.manual (`orchestrate merge`) runs it; a round's merge is merge/rounds.py's running sum.
"""
from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from core.checkpoint import DTYPES, FLOATS, TORCH_DTYPES
from core.checkpoint_writer import OutputFile, StreamWriter
from core.errors import CheckpointError
from core.outer import state_in_specs, state_key, state_slots
from core.progress import track
from merge import DEFAULT_BUFFER_BYTES
from merge.inputs import InputError, Model, finite, nonfinite, overflowed
from merge.methods import check_method_args, method_spec
from merge.outer import OuterStep
from merge.reading import DEPTH, Prefetch, Read, merging
from merge.task_vectors import row_length

_MIN_CHUNK, _MAX_CHUNK = 1 << 18, 1 << 22


@dataclass(frozen=True)
class _Segment:
    name: str
    start: int
    stop: int
    numel: int  # of the whole tensor
    floating: bool


@dataclass
class MergeStats:
    bytes_read: int
    seconds: float


@dataclass(frozen=True)
class MergeJob:
    """One streaming merge: opened inputs (headers already checked against each other) into outputs."""

    inputs: Sequence[Model]
    weights: Sequence[float]
    """One per input."""
    method: str
    """A name of merge.methods.METHODS."""
    outputs: Sequence[OutputFile]
    """The files written; their specs give the tensors' order, dtypes and shapes."""
    params: Mapping[str, Any] = field(default_factory=dict)
    """The method's parameters (defaults filled in); `outer`: optimizer (an OuterConfig), inner."""
    base: Model | None = None
    """The inputs' common starting point, for methods that need it (task vectors, outer)."""
    state_in: Model | None = None
    """`outer`: the optimizer state the step starts from; None: zero state."""
    state_out: OutputFile | None = None
    """`outer`: where the new optimizer state goes."""
    buffer_bytes: int = DEFAULT_BUFFER_BYTES
    """Read buffers of all inputs together: the merge's working set."""

    @property
    def models(self) -> list[Model]:
        return [*self.inputs, *([self.base] if self.base else []), *([self.state_in] if self.state_in else [])]


def run_merge(job: MergeJob) -> MergeStats:
    """Do `job`: publish its outputs (and its new state) only if all went well.

    Takes ownership of the models: they are closed on return. An unusable input raises InputError
    naming it (`ident`); the merged result's problems raise CheckpointError.
    """
    try:
        problems = check_method_args(job.method, list(job.weights), job.params, job.base is not None)
        if problems:
            raise ValueError("; ".join(problems))
        with merging():
            return _Run(job).run()
    finally:
        for m in job.models:
            m.close()


def _plan(outputs: Sequence[OutputFile], n_lanes: int, buffer_bytes: int, rows: bool = False) -> list[_Segment]:
    # slices of at most `chunk` elements (n_lanes * DEPTH float32 slices fill the buffer budget);
    # with `rows`, of whole rows (one row when a row is longer than a chunk)
    chunk = max(_MIN_CHUNK, min(_MAX_CHUNK, buffer_bytes // max(1, n_lanes * DEPTH * 4)))
    segments = []
    for out in outputs:
        for name, dtype, shape, _ in out.specs:
            numel = math.prod(shape)
            row = row_length(shape) if rows else 1
            step = max(1, chunk // row) * row if dtype in FLOATS else max(numel, 1)
            segments += [_Segment(name, s, min(s + step, numel), numel, dtype in FLOATS)
                         for s in range(0, max(numel, 1), step)]
    return segments


def _reads(m: Model, segments: list[_Segment]) -> list[list[Read]]:
    out = []
    for seg in segments:
        f, sp = m.tensors[seg.name]
        shape = sp.shape if (seg.start, seg.stop) == (0, seg.numel) else (seg.stop - seg.start,)
        out.append([Read(None, f, seg.name, seg.start, seg.stop, shape)])
    return out


def _state_reads(m: Model, segments: list[_Segment], have: dict[str, list[tuple[str, bool]]]) -> list[list[Read]]:
    out = []
    for seg in segments:
        reads = []
        for slot, full in have.get(seg.name, []):
            f, sp = m.tensors[state_key(seg.name, slot)]
            whole = (seg.start, seg.stop) == (0, seg.numel)
            reads.append(Read(slot, f, sp.name, seg.start, seg.stop, sp.shape if whole else (seg.stop - seg.start,))
                         if full else Read(slot, f, sp.name, 0, 1, ()))
        out.append(reads)
    return out


class _Run:
    """One run of a MergeJob: every input's segments streamed through the method into the writers.
    A stateful method (outer) merges with its `inner` method, then steps through merge.outer.OuterStep."""

    def __init__(self, job: MergeJob) -> None:
        self.job = job
        self.stateful = method_spec(job.method).stateful
        self.method = job.params.get("inner", "average") if self.stateful else job.method
        self.spec = method_spec(self.method)
        self.params = {k: v for k, v in job.params.items() if k not in ("inner", "optimizer")} if self.stateful \
            else dict(job.params)
        # methods that propagate NaN/Inf (sums) get the cheap check on their result only; the inputs
        # are then checked one by one only to name the culprit
        self.check_each = not self.spec.propagates_nonfinite
        self.dtypes = {n: TORCH_DTYPES[d] for out in job.outputs for n, d, _, _ in out.specs}

    def run(self) -> MergeStats:
        job, t0 = self.job, time.perf_counter()
        n_lanes = len(job.inputs) + (job.base is not None) + (job.state_in is not None)
        segments = _plan(job.outputs, n_lanes, job.buffer_bytes, self.spec.rows)
        have = self._state_slots()
        if self.spec.prepare is not None:  # before any reader starts: it reads whole tensors, one input at a time
            self.params["aux"] = self.spec.prepare(job.inputs, job.base, self.params)
        out = OuterStep(list(job.outputs), job.state_out, job.params["optimizer"]) if self.stateful else \
            StreamWriter(list(job.outputs))
        lanes: list[Prefetch] = []
        try:
            lanes = [Prefetch(m.label, m.ident, _reads(m, segments)) for m in [*job.inputs, *([job.base] if job.base else [])]]
            if job.state_in is not None:
                lanes.append(Prefetch(job.state_in.label, job.state_in.ident, _state_reads(job.state_in, segments, have)))
            label = f"merge into {job.outputs[0].storage.display(job.outputs[0].key)}"  # progress: core/progress.py
            for seg in track(segments, label, unit="values", size=lambda g: g.stop - g.start):
                taken = [lane.take() for lane in lanes]
                self._segment(seg, [got for _, got in taken], out)
                for lane, (buf, _) in zip(lanes, taken):
                    lane.give_back(buf)
            out.finish()
            for m in job.models:
                _verify(m)  # every byte has streamed past: compare the digests before publishing anything
            out.commit()
            return MergeStats(sum(m.bytes for m in job.inputs), time.perf_counter() - t0)
        except BaseException:
            out.abort()
            raise
        finally:
            for lane in lanes:
                lane.close()

    def _state_slots(self) -> dict[str, list[tuple[str, bool]]]:
        state_in = self.job.state_in
        if state_in is None:
            return {}
        layout = [(n, d, s) for out in self.job.outputs for n, d, s, _ in out.specs]
        try:
            return state_in_specs({k: (sp.dtype, sp.shape) for k, sp in state_in.specs.items()}, layout,
                                  state_slots(self.job.params["optimizer"]), state_in.label)
        except CheckpointError as exc:
            raise InputError(state_in.ident, str(exc)) from None

    def _segment(self, seg: _Segment, got: list[dict[str | None, torch.Tensor]], out: OuterStep | StreamWriter) -> None:
        """One segment merged and handed to the output: the method over float slices (then the outer
        step, for outer), or the inputs' common value of a non-float tensor."""
        job, k = self.job, len(self.job.inputs)
        parts = [g[None] for g in got[:k]]
        base = got[k][None] if job.base is not None else None
        merged = self._merge(seg, parts, base)
        if not self.stateful:
            out.put(seg.name, merged.to(self.dtypes[seg.name]))
        elif not seg.floating:
            out.keep(seg.name, merged)
        else:
            assert base is not None and job.base is not None
            if not finite(base):
                raise InputError(job.base.ident, nonfinite(job.base.tensors[seg.name][0].label, seg.name))
            out.step(seg.name, base, base.to(torch.float32) - merged, dict(got[-1]) if job.state_in else {},
                     (seg.start, seg.stop, seg.numel))

    def _merge(self, seg: _Segment, parts: list[torch.Tensor], base: torch.Tensor | None) -> torch.Tensor:
        """The method over one segment of every input, checked finite; a non-float tensor's common value
        (such tensors are not merged: every input must hold the same)."""
        job = self.job
        if not seg.floating:
            ref, ref_label = (base, job.base.label) if base is not None else (parts[0], job.inputs[0].label)
            for m, p in zip(job.inputs, parts):
                if not torch.equal(p, ref):
                    raise InputError(m.ident, f"{m.label}: tensor {seg.name} is {DTYPES[p.dtype]} (not floating point) "
                                              f"and differs from {ref_label}'s: such tensors are not merged, they must be "
                                              "identical in every input")
            return ref.clone()
        named = [*zip(job.inputs, parts), *([(job.base, base)] if base is not None else [])]
        if self.check_each:
            _check_finite(seg, named)
        kwargs: dict[str, Any] = {k: v for k, v in self.params.items() if k != "aux"}
        if self.spec.needs_base:
            kwargs["base"] = base
        if "aux" in self.params:
            kwargs["aux"] = self.params["aux"][seg.name]
        result = self.spec.fn(parts, list(job.weights), start=seg.start, **kwargs)
        if not finite(result):
            _check_finite(seg, named)
            raise CheckpointError(overflowed(seg.name, f"{self.method} merge", "check the weights and the scale"))
        return result


def _check_finite(seg: _Segment, named: list[tuple[Model, torch.Tensor]]) -> None:
    for m, p in named:
        if not finite(p):
            raise InputError(m.ident, nonfinite(m.tensors[seg.name][0].label, seg.name))


def _verify(m: Model) -> None:
    try:
        m.verify()
    except InputError:
        raise
    except CheckpointError as exc:
        raise InputError(m.ident, str(exc)) from None
