"""The merge engine's readers: one thread per input, filling a few reusable slots ahead of the maths.

A lane reads its input's segments in order, each into a free slot: positional reads straight
into the slot's buffer (O_DIRECT for cold large files: merge.directio), the digest fed on the way
(it must see the file's bytes in order), bf16/f16 widened to float32, a cheap finiteness check;
then it hands the slot to the maths, which gives it back when done. File I/O, hashing, numpy
and torch all release the GIL, so K lanes, the maths and the writer run in parallel.

How many slots matters more than their size: the maths takes segment i from every input at
once, so a lane that is ahead waits for the slowest one, and with 2 slots it soon had no read in
flight (the K = 8 merge read at 0.87 GB/s; with 4 slots of half the size, the same memory, at
1.48 GB/s). More than one read in flight per lane (a thread pool per lane) did not read faster
on this machine's disk (1.18 vs 1.36 GB/s, medians of 4), so a lane reads one segment at a time.
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

    def fill(self, reads: list[Read], check: bool) -> dict[str | None, torch.Tensor]:
        raw_need = sum(region_bytes(r.nbytes) for r in reads)
        f32_need = sum(_align(r.stop - r.start) for r in reads if r.spec.dtype in FLOATS and r.spec.dtype != "F32")
        if self.raw.numel() < raw_need:
            self.raw = aligned_bytes(raw_need)
        if self.f32.numel() < f32_need:
            self.f32 = torch.empty(f32_need, dtype=torch.float32)
        f32_np = self.f32.numpy()
        out: dict[str | None, torch.Tensor] = {}
        o = o32 = 0
        for r in reads:
            numel, region = r.stop - r.start, region_bytes(r.nbytes)
            data = r.file.read_tensor(r.offset, r.nbytes, self.raw[o:o + region], ITEMSIZE[r.spec.dtype])
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
            o += region
        return out


class Lane:
    """Reads one model's segments in order into `depth` reusable slots, in its own thread."""

    def __init__(self, label: str, ident: Any, plan: list[list[Read]], depth: int, check: bool = True) -> None:
        self.label, self.ident, self.plan, self.check = label, ident, plan, check
        self.free: queue.Queue[Slot | None] = queue.Queue()
        for _ in range(depth):
            self.free.put(Slot())
        self.ready: queue.Queue[Any] = queue.Queue()
        self.thread = threading.Thread(target=self._run, name=f"merge-read-{ident}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        for reads in self.plan:
            slot = self.free.get()
            if slot is None:
                return
            try:
                payload = slot.fill(reads, self.check)
            except InputError as exc:
                self.ready.put(exc)
                return
            except CheckpointError as exc:
                self.ready.put(InputError(self.ident, str(exc)))
                return
            except BaseException as exc:  # an unexpected failure still names the input
                self.ready.put(InputError(self.ident, f"{self.label}: {type(exc).__name__}: {exc}"))
                return
            self.ready.put((slot, payload))

    def take(self) -> tuple[Slot, dict[str | None, torch.Tensor]]:
        item = self.ready.get()
        if isinstance(item, BaseException):
            raise item
        return item

    def close(self) -> None:
        self.free.put(None)
        self.thread.join()
