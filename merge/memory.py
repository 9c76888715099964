"""Models held in memory that the merge engine reads like files, without copying.

`MemoryFile` has the reading surface of merge.reader.TensorFile (specs, read_into, read_tensor,
verify, close) over one aligned buffer: the round merge's running sum is one, and so are the
round's global weights and outer optimizer state once `load_model` has read them, whole and
digest-checked, while the service waited for the workers (merge.incremental), so that the outer
step after the last contribution reads nothing from storage. `GatedFile` is the running sum while
the last contribution is still being added: the outer step reads each slice once it is final.
"""
from __future__ import annotations

import bisect
import math
import threading
from collections.abc import Sequence
from typing import Any

import torch

from core.checkpoint import TORCH_DTYPES, TensorSpec
from core.errors import CheckpointError
from core.storage import Storage
from merge.directio import aligned_bytes, region_bytes
from merge.reader import ITEMSIZE, Model, open_file_model

_ALIGN = 64
_REFUSED = "the contribution being folded into the sum was refused"


class MemoryFile:
    """Tensors in one buffer, readable by the engine's reader threads like a TensorFile."""

    def __init__(self, label: str, entries: Sequence[tuple[str, str, tuple[int, ...]]]) -> None:
        self.label, self.key, self.manifest, self.data_start = label, label, None, 0
        self.metadata: dict[str, str] = {}
        self.specs: dict[str, TensorSpec] = {}
        off = 0
        for name, dtype, shape in entries:
            n = math.prod(shape) * ITEMSIZE[dtype]
            self.specs[name] = TensorSpec(name, dtype, tuple(shape), off, off + n)
            off += (n + _ALIGN - 1) // _ALIGN * _ALIGN
        self.size = off
        self.data = torch.zeros(off, dtype=torch.uint8)

    @classmethod
    def wrap(cls, label: str, specs: dict[str, TensorSpec], data: torch.Tensor, manifest: dict[str, Any] | None,
             metadata: dict[str, str]) -> MemoryFile:
        """A file's data section as read (tensor offsets relative to its start)."""
        self = cls.__new__(cls)
        self.label, self.key, self.manifest, self.metadata, self.data_start = label, label, manifest, metadata, 0
        self.specs, self.data, self.size = dict(specs), data, data.numel()
        return self

    def view(self, name: str) -> torch.Tensor:
        s = self.specs[name]
        return self.data[s.start: s.end].view(TORCH_DTYPES[s.dtype]).reshape(s.shape)

    def read_into(self, offset: int, out: memoryview) -> None:
        out[:] = memoryview(self.data.numpy())[offset: offset + len(out)]

    def read_tensor(self, offset: int, n: int, region: torch.Tensor | None, itemsize: int = 1) -> torch.Tensor:
        """The bytes themselves, not a copy: the engine's methods never write into their inputs."""
        return self.data[offset: offset + n]

    fetch_tensor = read_tensor
    positional = False  # one reader thread: nothing to wait for
    streams = False
    in_memory = True  # reads are views: a lane gives them no buffer

    def complete(self, offset: int, n: int, fetched: torch.Tensor) -> torch.Tensor:
        return fetched  # checked when loaded (see verify); no page cache to drop

    def verify(self) -> None:  # checked when it was loaded, or built here from checked inputs
        pass

    def close(self) -> None:
        pass


def load_model(storage: Storage, key: str, label: str, ident: Any) -> Model:
    """The checkpoint at `key` read whole into memory, its digest checked against its manifest
    (CheckpointError if it does not match, or the file is unreadable)."""
    m = open_file_model(storage, key, label, ident, require_manifest=True)
    try:
        f = m.files[0]
        n = f.size - f.data_start
        data = f.read_tensor(f.data_start, n, aligned_bytes(region_bytes(n)), 8)  # hashed on the way
        f.verify()
    finally:
        m.close()
    mf = MemoryFile.wrap(label, f.specs, data, f.manifest, f.metadata)
    return Model(label, ident, [mf], {name: (mf, spec) for name, spec in mf.specs.items()}, storage)  # type: ignore[list-item]


class GatedFile:
    """A MemoryFile whose tensors become readable piece by piece, as `advance(name, nbytes)` says
    how many of a tensor's first bytes are final: the round's running sum while its last
    contribution is still being folded in (in file order, slice by slice), so that the outer step
    can take each slice of the mean the moment it is final (merge.incremental). A read waits for
    the bytes it covers. `finish(ok=False)` wakes every reader with an error: the contribution was
    refused."""

    def __init__(self, mem: MemoryFile) -> None:
        self.mem, self.label, self.key, self.manifest, self.data_start = mem, mem.label, mem.key, None, 0
        self.metadata, self.specs, self.size = mem.metadata, mem.specs, mem.size
        self._final = {name: 0 for name in mem.specs}  # bytes of each tensor that are final, from its start
        # tensors by first byte; empty ones hold no bytes to wait for and share a start with the next
        self._starts = sorted((s.start, name) for name, s in mem.specs.items() if s.end > s.start)
        self._cv = threading.Condition()
        self._finished = False
        self._ok = True

    def advance(self, name: str, nbytes: int) -> None:
        with self._cv:
            self._final[name] = nbytes
            self._cv.notify_all()

    def finish(self, ok: bool) -> None:
        with self._cv:
            self._ok, self._finished = ok, True
            self._cv.notify_all()

    def _wait(self, offset: int, n: int) -> None:
        if n:
            start, name = self._starts[bisect.bisect_right(self._starts, (offset, "\uffff")) - 1]
            need = offset + n - start
            with self._cv:
                self._cv.wait_for(lambda: self._finished or self._final[name] >= need)
        if not self._ok:
            raise CheckpointError(_REFUSED)

    def read_into(self, offset: int, out: memoryview) -> None:
        self._wait(offset, len(out))
        self.mem.read_into(offset, out)

    def read_tensor(self, offset: int, n: int, region: torch.Tensor | None, itemsize: int = 1) -> torch.Tensor:
        self._wait(offset, n)
        return self.mem.read_tensor(offset, n, region, itemsize)

    fetch_tensor = read_tensor
    positional = False
    streams = False
    in_memory = True

    def complete(self, offset: int, n: int, fetched: torch.Tensor) -> torch.Tensor:
        return fetched

    def verify(self) -> None:
        """Wait until the fold is over; raise if its contribution was refused."""
        with self._cv:
            self._cv.wait_for(lambda: self._finished)
        if not self._ok:
            raise CheckpointError(_REFUSED)

    def close(self) -> None:
        pass
