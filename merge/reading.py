"""How every merge reads its inputs, and how a round's merge reads its contributions.

Every input of a merge is read by a thread of its own (Prefetch), `DEPTH` segments ahead into
reusable buffers, the digest fed on the way (core.checkpoint.TensorFile), bf16/f16 widened to
float32. File I/O, hashing and torch's kernels release the GIL, so the readers and the maths run
side by side; a storage that gives nothing for STALL_S (a hung NFS server) fails that input
(Stalled, naming it) instead of blocking the caller for good. The streaming merge
(merge/engine.py) reads its inputs' segments so; so do LTE, robust aggregation and late folds,
whole tensors at a time (read_whole, read_tensors, guarded).

A round's contribution (ContributionReader, for merge/rounds.py's running sum) is read in file
order. One in the round's space (weights, or a delta coded against this round's base) is read as it
is stored, into read buffers kept from one contribution to the next: a tensor stored alone (plain,
or a dense fp32/bf16 delta, whose decoding is the cast) slice by slice; a sparse delta's (top-k or
pruned) chunk rows as (positions, values), never a dense copy; a dense int8 delta decoded once its
values and scales are in (copied out of the read buffers). One in the other space (a late worker's
delta against an older base) is decoded whole (codec.load_weights, on a thread of its own: guarded)
and converted tensor by tensor (`decoded`, `in_space`).
"""
from __future__ import annotations

import contextlib
import gc
import math
import queue
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from core import codec
from core.checkpoint import DTYPES, FLOATS, ITEMSIZE, TensorFile, TensorSpec
from core.errors import CheckpointError
from core.storage import Storage
from merge.inputs import InputError, compare_specs, refusal

DEPTH = 4
"""Segments read ahead per input: the maths take segment i of every input at once, so an input
that is ahead waits for the slowest, and needs room to stay ahead meanwhile."""
STALL_S = 300.0
"""An input whose storage gives no segment for this long (a hung NFS server) fails the merge."""
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
                self._ready.put(exc if isinstance(exc, InputError) else InputError(self.ident, refusal(self.label, exc)))
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


# -- a round's contributions ------------------------------------------------------------
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
    (core.codec), each read with its scales by read_whole, one at a time (a
    read that stalls fails after STALL_S, naming `worker`)."""
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
    thread of its own (a read that stalls fails after STALL_S, naming `worker`): its
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
