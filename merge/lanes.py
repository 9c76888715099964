"""The merge engine's readers: a few threads per input, filling reusable slots ahead of the maths.

A lane reads its input's segments in order, each into a free slot: positional reads straight
into the slot's buffer, the digest fed on the way (it must see the file's bytes in order), the
pages dropped from the cache once read and hashed for cold large files (merge.directio),
bf16/f16 widened to float32, a cheap finiteness check; then it hands the slot to the maths,
which gives it back when done. File I/O, hashing, numpy and torch all release the GIL, so K
lanes, the maths and the writer run in parallel.

How many slots matters more than their size: the maths takes segment i from every input at
once, so a lane that is ahead waits for the slowest one, and with 2 slots it soon had no read in
flight (the K = 8 merge read at 0.87 GB/s; with 4 slots of half the size, the same memory, at
1.48 GB/s). And how many bytes are in flight: a disk (here a virtio device that splits reads into
4 MiB requests) reads faster with more requests queued, and an O_DIRECT read queues only its own:
8 files read with 8 MiB O_DIRECT reads, one at a time per file, gave 0.88-1.17 GB/s, two at a time
1.54-2.04 GB/s. So a lane over a local file has several reader threads (READERS), each reading its
next segment into a free slot while the others hash and hand over theirs, in segment order. The
engine's default (merge.engine: 512 MiB, 8 slots of 8 MiB per input at K = 8, 4 readers: 256 MiB
in flight) merged 8 cold 1 GiB files at 0.83-1.1x the rate of 64 MiB O_DIRECT reads of the same
files (medians of 4-5 alternating runs, 5 runs), where 256 MiB in 4 slots with 2 readers gave
0.5-1.0x; 6 or 7 readers over 8 slots, or 384 MiB, were no better (docs/benchmarks.md). Cold
files are now read through the page cache with the kernel's read-ahead (merge.directio), which
queues requests of its own: there 2 readers and 4 measured alike (1.71 and 1.78 GB/s, medians of 4),
and so did one reading in turn, a piece at a time, each piece hashed while in the core's cache
(TensorFile.streams), for ~1 CPU-s less per K = 8 merge of 1 GiB inputs: such a file gets one reader.
"""
from __future__ import annotations

import math
import queue
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from core.checkpoint import TORCH_DTYPES, TensorSpec
from core.errors import CheckpointError
from merge.directio import aligned_bytes, region_bytes
from merge.reader import FLOATS, ITEMSIZE, InputError, TensorFile

_ALIGN = 64
READERS = 4
"""Reader threads (reads in flight) per lane over a local file (see above)."""


@dataclass(frozen=True)
class Read:
    tag: str | None
    file: TensorFile
    spec: TensorSpec
    start: int  # elements
    stop: int
    shape: tuple[int, ...]  # the view's shape: the tensor's for whole tensors, 1-D for slices

    @property
    def offset(self) -> int:
        return self.file.data_start + self.spec.start + self.start * ITEMSIZE[self.spec.dtype]

    @property
    def nbytes(self) -> int:
        return (self.stop - self.start) * ITEMSIZE[self.spec.dtype]


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def finite(t: torch.Tensor) -> bool:
    """All values finite? One sum first (cheap; NaN and Inf propagate), the exact test only if it is not."""
    a = t.detach().numpy().reshape(-1)
    return not a.size or math.isfinite(float(np.add.reduce(a, dtype=np.float32))) or bool(np.isfinite(a).all())


def nonfinite(label: str, name: str) -> str:
    return (f"{label}: tensor {name} has NaN or Inf values: the model diverged or the file is damaged; "
            "leave it out of the merge")


class Slot:
    """A reusable pair of buffers: raw bytes as read (page-aligned, so O_DIRECT reads land in them
    directly: merge.directio), and float32 for widened bf16/f16."""

    def __init__(self) -> None:
        self.raw = aligned_bytes(0)
        self.f32 = torch.empty(0, dtype=torch.float32)

    def fetch(self, reads: list[Read]) -> list[torch.Tensor]:
        """The reads' bytes in this slot's raw buffer, not yet hashed (finish completes them, in
        file order: TensorFile.complete); for a file in memory, a view of its bytes (no buffer:
        the slot allocates none for it)."""
        raw_need = sum(region_bytes(r.nbytes) for r in reads if not r.file.in_memory)
        if self.raw.numel() < raw_need:
            self.raw = aligned_bytes(raw_need)
        out, o = [], 0
        for r in reads:
            if r.file.in_memory:
                out.append(r.file.fetch_tensor(r.offset, r.nbytes, None, ITEMSIZE[r.spec.dtype]))
                continue
            region = self.raw[o:o + region_bytes(r.nbytes)]
            out.append(r.file.fetch_tensor(r.offset, r.nbytes, region, ITEMSIZE[r.spec.dtype]))
            o += len(region)
        return out

    def finish(self, reads: list[Read], fetched: list[torch.Tensor], check: bool) -> dict[str | None, torch.Tensor]:
        """Digest fed, bf16/f16 widened to float32, finiteness checked: the payload the maths takes."""
        f32_need = sum(_align(r.stop - r.start) for r in reads if r.spec.dtype in FLOATS and r.spec.dtype != "F32")
        if self.f32.numel() < f32_need:
            self.f32 = torch.empty(f32_need, dtype=torch.float32)
        f32_np = self.f32.numpy()
        out: dict[str | None, torch.Tensor] = {}
        o32 = 0
        for r, data in zip(reads, fetched):
            data = r.file.complete(r.offset, r.nbytes, data)
            numel = r.stop - r.start
            t = data.view(TORCH_DTYPES[r.spec.dtype])
            if r.spec.dtype in FLOATS:
                if r.spec.dtype == "BF16":  # bf16 is the top half of a float32: widen with one shift
                    np.left_shift(data.numpy().view(np.uint16), 16, out=f32_np[o32:o32 + numel].view(np.uint32),
                                  dtype=np.uint32)
                    t = self.f32[o32:o32 + numel]
                elif r.spec.dtype != "F32":
                    t = self.f32[o32:o32 + numel].copy_(t)
                o32 += _align(numel)
                if check and not finite(t):
                    raise CheckpointError(nonfinite(r.file.label, r.spec.name))
            out[r.tag] = t.reshape(r.shape)
        return out


class Lane:
    """Reads one model's segments in order into `depth` reusable slots, in its own threads: up to
    READERS for local files (positional reads), each reading a segment while the others' are hashed
    and handed over in turn; one otherwise, and for streaming files (read in turn, piece by piece)."""

    def __init__(self, label: str, ident: Any, plan: list[list[Read]], depth: int, check: bool = True,
                 slots: list[Slot] | None = None, readers: int = READERS) -> None:
        """`slots`: the slots to use (a caller's, reused from lane to lane; `depth` is then their
        number), else `depth` new ones. `readers`: reader threads over a local file (at most one
        per slot)."""
        self.label, self.ident, self.plan, self.check = label, ident, plan, check
        slots = slots if slots is not None else [Slot() for _ in range(depth)]
        self.free: queue.Queue[Slot | None] = queue.Queue()
        for slot in slots:
            self.free.put(slot)
        self.ready: queue.Queue[Any] = queue.Queue()
        files = [r.file for reads in plan for r in reads]
        parallel = all(f.positional and not f.streams for f in files)
        n_threads = min(readers, len(slots)) if parallel else 1
        self._turn = self._next = 0  # the segment to hand over next; the next one to read
        self._cv = threading.Condition()
        self._stop = False
        self.threads = [threading.Thread(target=self._run, name=f"merge-read-{ident}-{i}", daemon=True)
                        for i in range(n_threads)]
        for t in self.threads:
            t.start()

    def _run(self) -> None:
        while True:
            slot = self.free.get()
            with self._cv:
                i = self._next
                if slot is None or self._stop or i >= len(self.plan):
                    return
                self._next += 1
            reads = self.plan[i]
            try:
                fetched: Any = slot.fetch(reads)
            except BaseException as exc:
                fetched = self._input_error(exc)
            with self._cv:  # in segment order from here: the digest must see the file's bytes in order
                self._cv.wait_for(lambda: self._turn == i or self._stop)
                if self._stop:
                    return
            item = fetched
            if not isinstance(fetched, InputError):
                try:
                    item = slot, slot.finish(reads, fetched, self.check)
                except BaseException as exc:
                    item = self._input_error(exc)
            with self._cv:
                # only ever set: close() may have stopped the lane while this segment was finished,
                # and a reader woken by that stop has left its segment unhanded: the rest must stop too
                self._stop = self._stop or isinstance(item, InputError)
                self.ready.put(item)
                self._turn += 1
                self._cv.notify_all()

    def _input_error(self, exc: BaseException) -> InputError:
        """Any failure reading this input, as an InputError that names it."""
        if isinstance(exc, InputError):
            return exc
        if isinstance(exc, CheckpointError):
            return InputError(self.ident, str(exc))
        return InputError(self.ident, f"{self.label}: {type(exc).__name__}: {exc}")

    def take(self) -> tuple[Slot, dict[str | None, torch.Tensor]]:
        item = self.ready.get()
        if isinstance(item, BaseException):
            raise item
        return item

    def close(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        for _ in self.threads:
            self.free.put(None)
        for t in self.threads:
            t.join()
