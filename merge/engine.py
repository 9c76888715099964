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
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from core.checkpoint import DTYPES, FLOATS, ITEMSIZE, TORCH_DTYPES, TensorFile
from core.checkpoint_writer import OutputFile, StreamWriter
from core.errors import CheckpointError
from core.outer import state_in_specs, state_key, state_slots
from core.progress import track
from merge import DEFAULT_BUFFER_BYTES
from merge.inputs import InputError, Model, finite, nonfinite, overflowed
from merge.methods import check_method_args, method_spec
from merge.outer import OuterStep
from merge.task_vectors import row_length

DEPTH = 4
"""Segments read ahead per input: the maths take segment i of every input at once, so an input
that is ahead waits for the slowest, and needs room to stay ahead meanwhile."""
STALL_S = 300.0
"""An input whose storage gives no segment for this long (a hung NFS server) fails the merge."""
_MIN_CHUNK, _MAX_CHUNK = 1 << 18, 1 << 22
T = TypeVar("T")


class Stalled(InputError):
    """An input's storage gave no data for STALL_S: nothing more is read from it on the caller's thread
    (a read there would block as the reader's did)."""


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
        return _next(self._ready, self.label, self.ident)

    def give_back(self, buf: Buffer) -> None:
        self._free.put(buf)

    def close(self) -> bool:
        """Stop reading; True once the thread has ended, so that its buffers may be used again. A
        read stuck in the kernel (a hung NFS server) keeps its daemon thread, and its buffer."""
        self._closed = True
        self._free.put(None)
        self._thread.join(timeout=5)
        return not self._thread.is_alive()


def read_whole(f: TensorFile, ident: Any, groups: Sequence[Sequence[str]], depth: int = DEPTH
               ) -> Iterator[dict[str | None, torch.Tensor]]:
    """Each group of `f`'s entries, whole, in order ({entry: tensor}), read `depth` ahead by a
    Prefetch: a read that stalls raises InputError naming `ident` after STALL_S instead of blocking
    the caller for good. bf16/f16/f64 tensors come widened to float32. The tensors are views of a
    read buffer, valid until the next group is taken."""
    plan = [[Read(e, f, e, 0, math.prod(f.specs[e].shape), f.specs[e].shape) for e in g] for g in groups]
    reader = Prefetch(f.label, ident, plan, buffers=[Buffer() for _ in range(depth)])
    try:
        for _ in plan:
            buf, got = reader.take()
            yield got
            reader.give_back(buf)
    finally:
        reader.close()


def read_tensors(f: TensorFile, ident: Any, names: Sequence[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for whole tensors of `f` (all, in file order, by default), as read_whole
    reads them; each is the caller's."""
    with contextlib.closing(read_whole(f, ident, [[n] for n in (names or list(f.specs))])) as read:
        for got in read:
            ((name, t),) = got.items()
            yield str(name), t.clone()


def guarded(label: str, ident: Any, read: Callable[[Callable[[str], None]], T]) -> T:
    """`read(on_read)` on a thread of its own, for a reader of whole files that calls `on_read`
    before each tensor it reads (core.codec.load_weights): no tensor begun for STALL_S raises
    Stalled naming `ident` instead of blocking the caller for good (the blocked read keeps its
    daemon thread); what `read` raises is raised here."""
    events: queue.Queue[Any] = queue.Queue()

    def run() -> None:
        try:
            events.put(("done", read(lambda _name: events.put(None))))
        except BaseException as exc:  # handed to the caller, as raised
            events.put(exc)

    threading.Thread(target=run, name=f"merge-read-{ident}", daemon=True).start()
    while (event := _next(events, label, ident)) is None:  # a tensor begun: the read moves
        pass
    return event[1]


def _next(events: queue.Queue[Any], label: str, ident: Any) -> Any:
    """The next thing a reader thread put in `events`; an exception it put is raised here, and
    nothing for STALL_S raises Stalled naming `ident`."""
    try:
        event = events.get(timeout=STALL_S)
    except queue.Empty:
        raise Stalled(ident, f"{label}: no data came from the storage for {STALL_S:.0f} s: it stalls; check it, "
                             "then try again") from None
    if isinstance(event, BaseException):
        raise event
    return event


def _reason(label: str, exc: BaseException) -> str:
    return str(exc) if isinstance(exc, CheckpointError) else f"{label}: {type(exc).__name__}: {exc}"


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
