"""The streaming merge: K inputs (+ base, + optimizer state) -> merged safetensors, slice by slice.

How the bytes move (memory does not grow with K, nor with the size of the model):

- Every file's header was checked when it was opened (core.checkpoint), the inputs against each
  other by the caller (merge.inputs.compare_specs).
- The output is cut into segments: slices of at most `chunk` elements of one tensor, in the
  output's order. Every method is element-wise over a segment; one that needs a whole tensor of
  each input first (TIES's trim threshold) reads it beforehand, one input at a time (`prepare`).
- Every input has a reader thread (Prefetch) filling `depth` reusable buffers with its next
  segments: the digest fed on the way (core.checkpoint.TensorFile), bf16/f16 widened to float32.
  File I/O, hashing and torch's kernels release the GIL, so the readers, the maths and the writer
  thread (core.checkpoint_writer) run side by side.
- At the end every input's digest is checked against its manifest (every byte has streamed past),
  and only then are the outputs published. Any error deletes them: nothing half-merged is seen.

merge.rounds is the merge service's own use of it; merge.manual is `orchestrate merge`'s.
"""
from __future__ import annotations

import contextlib
import gc
import math
import queue
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from core.checkpoint import DTYPES, FLOATS, ITEMSIZE, TORCH_DTYPES, TensorFile
from core.errors import CheckpointError
from core.progress import track
from merge.inputs import InputError, Model
from merge.methods import check_method_args, method_spec
from merge.task_vectors import row_length
from merge.outer import state_in_specs, state_key, state_slots
from merge import DEFAULT_BUFFER_BYTES
from core.checkpoint_writer import OutputFile, StreamWriter

DEPTH = 4
"""Segments read ahead per input: the maths take segment i of every input at once, so an input
that is ahead waits for the slowest, and needs room to stay ahead meanwhile."""
STALL_S = 300.0
"""An input whose storage gives no segment for this long (a hung NFS server) fails the merge."""
_MIN_CHUNK, _MAX_CHUNK = 1 << 18, 1 << 22


@dataclass(frozen=True)
class Read:
    """Elements [start, stop) of tensor `name` in `file`, viewed as `shape`; `tag` names it in the payload."""

    tag: str | None
    file: TensorFile
    name: str
    start: int
    stop: int
    shape: tuple[int, ...]


class Buffer:
    """Reusable memory of one segment: raw bytes as read, and float32 for widened bf16/f16."""

    def __init__(self) -> None:
        self.raw = torch.empty(0, dtype=torch.uint8)
        self.f32 = torch.empty(0, dtype=torch.float32)

    def fill(self, reads: list[Read]) -> dict[str | None, torch.Tensor]:
        need = [(r.stop - r.start) * ITEMSIZE[r.file.specs[r.name].dtype] for r in reads]
        if self.raw.numel() < sum(need):
            self.raw = torch.empty(sum(need), dtype=torch.uint8)
        widen = sum(r.stop - r.start for r in reads if r.file.specs[r.name].dtype in FLOATS - {"F32"})
        if self.f32.numel() < widen:
            self.f32 = torch.empty(widen, dtype=torch.float32)
        out, o, o32 = {}, 0, 0
        for r, n in zip(reads, need):
            t = r.file.read(r.name, r.start, r.stop, self.raw[o:o + n]).reshape(-1)
            o += n
            if t.dtype in (torch.bfloat16, torch.float16, torch.float64):
                t = self.f32[o32:o32 + t.numel()].copy_(t)
                o32 += t.numel()
            out[r.tag] = t.reshape(r.shape)
        return out


class Prefetch:
    """Reads one model's segments (`plan`, each a list of Reads) in order, `depth` ahead, in its own
    thread. take() hands over the next payload (tag -> tensor, views of a reused buffer) and the
    buffer, which goes back with give_back() once the maths are done with it."""

    def __init__(self, label: str, ident: Any, plan: list[list[Read]], buffers: list[Buffer] | None = None) -> None:
        """`buffers`: the caller's to reuse from one reader to the next (DEPTH new ones by default)."""
        self.label, self.ident, self.plan = label, ident, plan
        self._free: queue.Queue[Buffer | None] = queue.Queue()
        for buf in buffers if buffers is not None else [Buffer() for _ in range(DEPTH)]:
            self._free.put(buf)
        self._ready: queue.Queue[Any] = queue.Queue()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=f"merge-read-{ident}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        for reads in self.plan:
            buf = self._free.get()
            if buf is None or self._closed:
                return
            try:
                self._ready.put((buf, buf.fill(reads)))
            except BaseException as exc:  # handed to take(), naming this input
                self._ready.put(exc if isinstance(exc, InputError) else InputError(self.ident, _reason(self.label, exc)))
                return

    def take(self) -> tuple[Buffer, dict[str | None, torch.Tensor]]:
        try:
            item = self._ready.get(timeout=STALL_S)
        except queue.Empty:
            raise InputError(self.ident, f"{self.label}: no data came from the storage for {STALL_S:.0f} s: it "
                                         "stalls; check it, then try again") from None
        if isinstance(item, BaseException):
            raise item
        return item

    def give_back(self, buf: Buffer) -> None:
        self._free.put(buf)

    def close(self) -> bool:
        """Stop reading; True once the thread has ended, so that its buffers may be used again. A
        read stuck in the kernel (a hung NFS server) keeps its daemon thread, and its buffer."""
        self._closed = True
        self._free.put(None)
        self._thread.join(timeout=5)
        return not self._thread.is_alive()


def read_tensors(f: TensorFile, ident: Any, names: Sequence[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for whole tensors of `f` (all, in file order, by default), read ahead by a
    Prefetch: a read that stalls raises InputError naming `ident` after STALL_S instead of blocking
    the caller for good. bf16/f16/f64 tensors come widened to float32; each is the caller's."""
    plan = [[Read(n, f, n, 0, math.prod(f.specs[n].shape), f.specs[n].shape)] for n in (names or list(f.specs))]
    reader = Prefetch(f.label, ident, plan)
    try:
        for (r,) in plan:
            buf, got = reader.take()
            t = got[r.tag].clone()
            reader.give_back(buf)
            yield r.name, t
    finally:
        reader.close()


def _reason(label: str, exc: BaseException) -> str:
    return str(exc) if isinstance(exc, CheckpointError) else f"{label}: {type(exc).__name__}: {exc}"


def finite(t: torch.Tensor) -> bool:
    """All values finite? One sum first (cheap; NaN and Inf propagate), the exact test only if it is not."""
    return not t.numel() or math.isfinite(float(t.sum(dtype=torch.float32))) or bool(torch.isfinite(t).all())


def nonfinite(label: str, name: str) -> str:
    return (f"{label}: tensor {name} has NaN or Inf values: the model diverged or the file is damaged; "
            "leave it out of the merge")


@contextlib.contextmanager
def merging() -> Iterator[None]:
    """While a merge runs, torch uses one thread: the maths are memory-bound, the cores are the
    readers' (I/O, digests) and the writer's. And the objects alive so far (torch's are many) leave
    the garbage collector's view for good (gc.freeze): a merge makes garbage fast, and every full
    collection walked them all while holding the GIL the readers need (docs/benchmarks.md, Merge)."""
    gc.freeze()
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


# -- the engine ----------------------------------------------------------------------------
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


def run_merge(inputs: Sequence[Model], weights: Sequence[float], method: str, outputs: Sequence[OutputFile], *,
              params: Mapping[str, Any] | None = None, base: Model | None = None, state_in: Model | None = None,
              state_out: OutputFile | None = None, buffer_bytes: int = DEFAULT_BUFFER_BYTES) -> MergeStats:
    """Merge `inputs` (headers already checked against each other) into `outputs`, whose specs give
    the tensors' order, dtypes and shapes; publish them (and `state_out`) only if all went well.

    Takes ownership of the models: they are closed on return. An unusable input raises InputError
    naming it (`ident`); the merged result's problems raise CheckpointError.
    """
    models = [*inputs, *([base] if base else []), *([state_in] if state_in else [])]
    try:
        spec = method_spec(method)
        params = dict(params or {})
        problems = check_method_args(method, list(weights), params, base is not None)
        if problems:
            raise ValueError("; ".join(problems))
        with merging():
            return _run_merge(inputs, list(weights), spec, method, list(outputs), params, base, state_in, state_out,
                              buffer_bytes)
    finally:
        for m in models:
            m.close()


def _plan(outputs: list[OutputFile], n_lanes: int, buffer_bytes: int, rows: bool = False) -> list[_Segment]:
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


def _run_merge(inputs, weights, spec, method, outputs, params, base, state_in, state_out, buffer_bytes) -> MergeStats:
    t0 = time.perf_counter()
    lanes: list[Prefetch] = []
    writers: list[StreamWriter] = []
    try:
        n_lanes = len(inputs) + (base is not None) + (state_in is not None)
        segments = _plan(outputs, n_lanes, buffer_bytes, spec.rows)
        order = [(n, d, s) for out in outputs for n, d, s, _ in out.specs]
        slots = state_slots(params["optimizer"]) if spec.stateful else []
        have = {}
        if state_in is not None:
            try:
                have = state_in_specs({k: (sp.dtype, sp.shape) for k, sp in state_in.specs.items()}, order, slots,
                                      state_in.label)
            except CheckpointError as exc:
                raise InputError(state_in.ident, str(exc)) from None
        if spec.prepare is not None:  # before any reader starts: it reads whole tensors, one input at a time
            params["aux"] = spec.prepare(inputs, base, params)
        writers.append(StreamWriter(list(outputs)))
        if state_out is not None:
            writers.append(StreamWriter([state_out]))
        lanes = [Prefetch(m.label, m.ident, _reads(m, segments)) for m in [*inputs, *([base] if base else [])]]
        if state_in is not None:
            lanes.append(Prefetch(state_in.label, state_in.ident, _state_reads(state_in, segments, have)))
        # Methods that propagate NaN/Inf (sums) get the cheap check on their result only; the inputs
        # are then checked one by one only to name the culprit.
        inner = params.get("inner", "average") if spec.stateful else method
        check_each = not (spec.propagates_nonfinite and method_spec(inner).propagates_nonfinite)
        dtypes = {n: TORCH_DTYPES[d] for n, d, _ in order}
        pending: dict[str, torch.Tensor] = {}  # state slots of the current tensor, when they cannot stream
        label = f"merge into {outputs[0].storage.display(outputs[0].key)}"  # progress: core/progress.py
        for seg in track(segments, label, unit="values", size=lambda g: g.stop - g.start):
            taken = [lane.take() for lane in lanes]
            parts = [p[None] for _, p in taken[: len(inputs)]]
            base_part = taken[len(inputs)][1][None] if base is not None else None
            state = dict(taken[-1][1]) if state_in is not None else {}
            out_t = _merge_segment(seg, inputs, parts, base, base_part, weights, spec, method, params, state,
                                   check_each)
            for lane, (buf, _) in zip(lanes, taken):
                lane.give_back(buf)
            writers[0].put(seg.name, out_t.to(dtypes[seg.name]))
            if state_out is not None and seg.floating:
                _put_state(writers[1], seg, state, slots, pending)
        for w in writers:
            w.finish()
        for m in [*inputs, *([base] if base else []), *([state_in] if state_in else [])]:
            _verify(m)  # every byte has streamed past: compare the digests before publishing anything
        for w in writers:
            w.commit()
        return MergeStats(sum(m.bytes for m in inputs), time.perf_counter() - t0)
    except BaseException:
        for w in writers:
            w.abort()
        raise
    finally:
        for lane in lanes:
            lane.close()


def _verify(m: Model) -> None:
    try:
        m.verify()
    except InputError:
        raise
    except CheckpointError as exc:
        raise InputError(m.ident, str(exc)) from None


def _merge_segment(seg, inputs, parts, base, base_part, weights, spec, method, params, state,
                   check_each) -> torch.Tensor:
    """One segment merged: the method over float slices, or the inputs' common value of a
    non-float tensor (such tensors are not merged: every input must hold the same)."""
    if not seg.floating:
        ref, ref_label = (base_part, base.label) if base_part is not None else (parts[0], inputs[0].label)
        for m, p in zip(inputs, parts):
            if not torch.equal(p, ref):
                raise InputError(m.ident, f"{m.label}: tensor {seg.name} is {DTYPES[p.dtype]} (not floating point) and "
                                          f"differs from {ref_label}'s: such tensors are not merged, they must be "
                                          "identical in every input")
        return ref[0].clone()
    named = [*zip(inputs, parts), *([(base, base_part)] if base is not None else [])]
    if check_each:
        for m, p in named:
            if not finite(p):
                raise InputError(m.ident, nonfinite(m.tensors[seg.name][0].label, seg.name))
    kwargs: dict[str, Any] = {k: v for k, v in params.items() if k != "aux"}
    if spec.needs_base:
        kwargs["base"] = base_part
    if spec.stateful:
        kwargs["state"] = state
    if "aux" in params:
        kwargs["aux"] = params["aux"][seg.name]
    result = spec.fn(parts, weights, start=seg.start, **kwargs)
    if not finite(result):
        for m, p in named:
            if not finite(p):
                raise InputError(m.ident, nonfinite(m.tensors[seg.name][0].label, seg.name))
        raise CheckpointError(f"merged tensor {seg.name} has NaN or Inf values although every input is finite: the "
                              f"{method} merge overflowed; check the weights and the scale (for outer: the outer "
                              "learning rate)")
    return result


def _put_state(writer: StreamWriter, seg: _Segment, state: dict[str, torch.Tensor], slots: list[tuple[str, bool]],
               pending: dict[str, torch.Tensor]) -> None:
    """Queue the new optimizer state of a segment. One full-size slot (momentum) streams as it
    comes; otherwise the slots of one tensor are gathered, then written slot after slot."""
    if len(slots) == 1 and slots[0][1]:
        writer.put(state_key(seg.name, slots[0][0]), state[slots[0][0]].reshape(-1))
        return
    for slot, full in slots:
        new = state[slot].detach()
        if full:
            buf = pending.setdefault(slot, torch.empty(seg.numel, dtype=torch.float32))
            buf[seg.start: seg.stop] = new.reshape(-1)
        else:
            pending[slot] = new.to(torch.float32).reshape(())
    if seg.stop == seg.numel:
        for slot, _ in slots:
            writer.put(state_key(seg.name, slot), pending.pop(slot))
